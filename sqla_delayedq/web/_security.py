"""The headers every dashboard response carries: a Content-Security-Policy that allows only the
dashboard's own script and stylesheet, no framing, no sniffing, no caching of pages."""

from __future__ import annotations

from collections.abc import Collection

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


def security_headers(app: ASGIApp, cached: Collection[str] = ()) -> ASGIApp:
    """``app`` with the security headers on every response; ``cached`` are the paths, under the
    app's root path, of its own static files, which browsers may keep for an hour."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    h for h in message.get("headers", []) if h[0].lower() != b"cache-control"
                ]
                extra = SECURITY_HEADERS
                if message["status"] == 200 and route_path(scope) in cached:
                    extra = [*SECURITY_HEADERS[:-1], (b"cache-control", b"max-age=3600")]
                message["headers"] = headers + extra
            await send(message)

        await app(scope, receive, send_with_headers)

    return wrapped


def route_path(scope: Scope) -> str:
    """The request's path under the app's root path (where it is mounted, or uvicorn's
    ``--root-path``): only that part is the dashboard's own."""
    path = str(scope.get("path", ""))
    root = str(scope.get("root_path", "")).rstrip("/")
    return path[len(root) :] if root and path.startswith(root + "/") else path
