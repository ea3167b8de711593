"""The headers every dashboard response carries: a Content-Security-Policy that allows only the
dashboard's own script and stylesheet, no framing, no sniffing, no caching of pages."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["CSP", "SECURITY_HEADERS", "security_headers"]

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
]


def security_headers(app: ASGIApp) -> ASGIApp:
    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    h for h in message.get("headers", []) if h[0].lower() != b"cache-control"
                ]
                path = scope.get("path", "")
                extra = SECURITY_HEADERS
                if "/static/" in path:
                    extra = [*SECURITY_HEADERS[:-1], (b"cache-control", b"max-age=3600")]
                message["headers"] = headers + extra
            await send(message)

        await app(scope, receive, send_with_headers)

    return wrapped
