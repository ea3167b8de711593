"""The dashboard's Starlette application: routes, authorization, CSRF, headers, error pages.

Pages are rendered on the server with Jinja2 (autoescaped); htmx, vendored in ``static/``,
refreshes the overview and the progress of bulk actions. No page is served without the
``authorize`` hook's consent or the token; changes (message actions and queue controls) are POSTs
with a CSRF token and a same-origin check, and only when ``actions=True``. Every response carries
a Content-Security-Policy that allows only the dashboard's own script and stylesheet.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import inspect
import logging
import math
import re
import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

from jinja2 import Environment, FileSystemLoader, select_autoescape
from sqlalchemy.exc import SQLAlchemyError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from .._handlers import is_async_callable
from .._types import MessageFilter, MessageInfo
from ..errors import DelayedQueueError, InvalidArgument, TransientError
from ..monitor import DEAD_AFTER_BEATS
from ._data import (
    ACTIONS,
    ENTITY_STATES,
    MESSAGE_STATES,
    Data,
    NotFound,
    database_problem,
    describe,
    parse_filter,
)
from ._render import (
    bars,
    compact,
    control_labels,
    human_seconds,
    number,
    payload_views,
    short,
    when,
)
from ._security import security_headers

__all__ = ["Dashboard", "dashboard"]

log = logging.getLogger("sqla_delayedq.web")
HERE = Path(__file__).resolve().parent
MAX_ID = 2**63 - 1
#: A decimal id as the form sends it: ASCII digits only (``"²".isdigit()`` is True).
DIGITS = re.compile(r"[0-9]+")
MAX_LIMIT = 500
DEFAULT_LIMIT = 50
#: The largest in-flight limit or rate count (the columns are 32-bit integers).
MAX_COUNT = 2**31 - 1
#: The shortest and the longest rate period, in seconds (a millisecond, a year).
MIN_PERIOD = 0.001
MAX_PERIOD = 365 * 86400
#: What the controls form may ask: pause, resume, or set the limits.
STEERING = {"pause": True, "resume": False, "limits": None}
SESSION_COOKIE = "delayedq_session"
CSRF_COOKIE = "delayedq_csrf"
#: How long a sign-in lasts by default (seconds).
SESSION_TTL = 12 * 3600.0
STATIC = {
    "htmx.min.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
Authorize = Callable[[Request], "bool | Awaitable[bool]"]


class Refused(Exception):
    """A request the dashboard does not serve: (status, message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# -- the application ------------------------------------------------------------------------


class Dashboard:
    """The dashboard as an ASGI application (see :func:`dashboard`)."""

    def __init__(
        self,
        data: Data,
        *,
        authorize: Authorize | None,
        token: str | None,
        actions: bool,
        title: str,
        refresh: float,
        secret: str | bytes | None = None,
        session_ttl: float = SESSION_TTL,
    ) -> None:
        self.data = data
        self.authorize = authorize
        self.token = token
        self.actions = actions
        self.title = title
        self.refresh = refresh
        self.session_ttl = session_ttl
        secret = secrets.token_bytes(32) if secret is None else secret
        secret = secret.encode() if isinstance(secret, str) else secret
        # Sessions are signed with the secret and the token: a new token ends every sign-in.
        self._session_key = hmac.new(
            secret, b"delayedq session\0" + (token or "").encode(), hashlib.sha256
        ).digest()
        #: Signed-out sessions of this process: id -> expiry, kept until they expire.
        self._ended: dict[str, float] = {}
        self._ended_lock = threading.Lock()
        self.env = Environment(
            loader=FileSystemLoader(HERE / "templates"),
            autoescape=select_autoescape(default=True, default_for_string=True),
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.env.filters.update(
            when=when,
            compact=compact,
            short=short,
            seconds=human_seconds,
            controls=control_labels,
            number=number,
        )
        routes = [
            Route("/", self.overview),
            Route("/fragments/overview", self.overview_fragment),
            Route("/messages", self.messages),
            Route("/message", self.message),
            Route("/confirm", self.confirm),
            Route("/actions", self.act, methods=["POST"]),
            Route("/controls", self.steer, methods=["POST"]),
            Route("/jobs/{id}", self.job),
            Route("/fragments/jobs/{id}", self.job_fragment),
            Route("/workers", self.workers),
            Route("/cron", self.cron),
            Route("/entities", self.entities),
            Route("/login", self.login, methods=["GET", "POST"]),
            Route("/logout", self.logout, methods=["POST"]),
            Route("/static/{name}", self.static),
        ]
        self.app = Starlette(
            routes=routes,
            exception_handlers={
                HTTPException: self._http_error,
                Exception: self._crash,
            },
        )
        self.asgi = security_headers(self.app, cached=[f"/static/{name}" for name in STATIC])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.asgi(scope, receive, send)

    # -- security ------------------------------------------------------------------------

    def _sign(self, text: str) -> str:
        return hmac.new(self._session_key, text.encode(), hashlib.sha256).hexdigest()

    def _new_session(self) -> str:
        """A sign-in's cookie value: its own id and expiry, signed (``id.expiry.signature``)."""
        text = f"{secrets.token_urlsafe(18)}.{math.ceil(time.time() + self.session_ttl)}"
        return f"{text}.{self._sign(text)}"

    def _session(self, request: Request) -> tuple[str, float] | None:
        """(id, expiry) of the request's sign-in when its cookie is one of ours, unexpired and
        not signed out; else None."""
        id, _, rest = request.cookies.get(SESSION_COOKIE, "").partition(".")
        expiry, _, signature = rest.partition(".")
        if not id or not (expiry.isascii() and expiry.isdigit()) or len(expiry) > 12:
            return None
        # Bytes: compare_digest refuses str with non-ASCII characters (a TypeError, a 500).
        expected = self._sign(f"{id}.{expiry}").encode()
        if not hmac.compare_digest(signature.encode(), expected):
            return None
        if int(expiry) <= time.time() or id in self._ended:
            return None
        return id, float(expiry)

    def _end_session(self, id: str, expiry: float) -> None:
        now = time.time()
        with self._ended_lock:
            self._ended = {k: t for k, t in self._ended.items() if t > now}
            self._ended[id] = expiry

    def _sign_in(self, request: Request, response: Response) -> None:
        self._set_cookie(
            request, response, SESSION_COOKIE, self._new_session(), max_age=self.session_ttl
        )

    async def _allowed(self, request: Request) -> bool:
        if self.authorize is not None:
            if is_async_callable(self.authorize):
                verdict = self.authorize(request)
            else:  # a blocking check (a session looked up in a database) runs off the loop
                verdict = await run_in_threadpool(self.authorize, request)
            if inspect.isawaitable(verdict):
                verdict = await verdict
            return bool(verdict)
        assert self.token is not None
        header = request.headers.get("authorization", "")
        if header.lower().startswith("bearer ") and hmac.compare_digest(
            header[7:].strip().encode(), self.token.encode()
        ):
            return True
        return self._session(request) is not None

    async def _guard(self, request: Request) -> Response | None:
        """None when the request may proceed; else the response that refuses it."""
        if await self._allowed(request):
            return None
        if self.authorize is not None:
            return self._error(request, 403, "You are not allowed to see this dashboard.")
        given = request.query_params.get("token")
        if given is not None and hmac.compare_digest(given.encode(), (self.token or "").encode()):
            query = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
            target = self.link(request, request.url.path[len(self.root(request)) :] or "/", query)
            response = RedirectResponse(target, status_code=303)
            self._sign_in(request, response)
            return response
        return self.render(request, "login.html", {"failed": given is not None}, status=401)

    def root(self, request: Request) -> str:
        return str(request.scope.get("root_path", "")).rstrip("/")

    def link(self, request: Request, path: str, query: Any = None) -> str:
        url = self.root(request) + path
        if query:
            items = query.items() if isinstance(query, dict) else query
            pairs = [(k, v) for k, v in items if v is not None and v != ""]
            if pairs:
                url += "?" + urlencode(pairs, doseq=False)
        return url

    def _set_cookie(
        self,
        request: Request,
        response: Response,
        name: str,
        value: str,
        max_age: float | None = None,
    ) -> None:
        response.set_cookie(
            name,
            value,
            max_age=None if max_age is None else math.ceil(max_age),
            path=self.root(request) + "/",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )

    def _csrf(self, request: Request) -> str:
        value = request.cookies.get(CSRF_COOKIE, "")
        if len(value) < 32:
            value = getattr(request.state, "csrf_new", None) or secrets.token_urlsafe(32)
            request.state.csrf_new = value
        return value

    def _same_origin(self, request: Request) -> bool:
        expected = f"{request.url.scheme}://{request.headers.get('host', '')}"
        origin = request.headers.get("origin")
        if origin is None or origin == "null":
            referer = request.headers.get("referer")
            if not referer:
                return False
            parts = urlsplit(referer)
            origin = f"{parts.scheme}://{parts.netloc}"
        # Bytes: compare_digest refuses str with non-ASCII characters (a TypeError, a 500).
        return hmac.compare_digest(origin.lower().encode(), expected.lower().encode())

    async def _check_post(self, request: Request) -> FormData:
        if not self.actions:
            raise Refused(403, "Actions are disabled on this dashboard (read-only).")
        return await self._check_form(request)

    async def _check_form(self, request: Request) -> FormData:
        """The form of a POST from the dashboard's own page: same origin, CSRF token."""
        if not self._same_origin(request):
            raise Refused(403, "Refused: the request does not come from this dashboard's origin.")
        form = await request.form()
        sent = str(form.get("csrf", ""))
        cookie = request.cookies.get(CSRF_COOKIE, "")
        if not sent or not cookie or not hmac.compare_digest(sent.encode(), cookie.encode()):
            raise Refused(403, "Refused: the form's CSRF token is missing or wrong; reload it.")
        return form

    # -- responses -----------------------------------------------------------------------

    def render(
        self, request: Request, template: str, context: dict[str, Any], status: int = 200
    ) -> Response:
        csrf = self._csrf(request)

        def url(path: str, **query: Any) -> str:
            return self.link(request, path, query)

        html = self.env.get_template(template).render(
            request=request,
            url=url,
            title=self.title,
            actions=self.actions,
            csrf=csrf,
            entities=bool(self.data.entities),
            action_names=ACTIONS,
            signed_in=self.token is not None and self._session(request) is not None,
            **context,
        )
        response = HTMLResponse(html, status_code=status)
        if request.cookies.get(CSRF_COOKIE) != csrf:
            self._set_cookie(request, response, CSRF_COOKIE, csrf)
        return response

    def _error(self, request: Request, status: int, message: str) -> Response:
        return self.render(request, "error.html", {"status": status, "message": message}, status)

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        messages = {404: "No such page.", 405: "This page does not take that method."}
        return self._error(request, exc.status_code, messages.get(exc.status_code, exc.detail))

    async def _crash(self, request: Request, exc: Exception) -> Response:
        ref = secrets.token_hex(4)
        log.error("dashboard: %s %s failed (error id %s)", request.method, request.url.path, ref,
                  exc_info=exc)  # fmt: skip
        return HTMLResponse(
            "<!doctype html><title>Error</title><h1>500</h1>"
            "<p>The dashboard failed on this request; the server's log has the details under "
            f"error id {ref}.</p>",
            status_code=500,
        )

    async def _serve(self, request: Request, build: Callable[[], Awaitable[Response]]) -> Response:
        refused = await self._guard(request)
        if refused is not None:
            return refused
        try:
            return await build()
        except Refused as exc:
            return self._error(request, exc.status, exc.message)
        except NotFound as exc:
            return self._error(request, 404, str(exc.args[0]))
        except InvalidArgument as exc:
            return self._error(request, 400, str(exc))
        except TransientError:
            log.warning("dashboard: %s %s: transient database error", request.method,
                        request.url.path, exc_info=True)  # fmt: skip
            return self._error(request, 503, "The database is busy; reload in a moment.")
        except DelayedQueueError as exc:  # ours: says what to do, no connection details
            log.error("dashboard: %s %s: %s", request.method, request.url.path, exc)
            return self._error(request, 503, str(exc))
        except SQLAlchemyError as exc:
            ref = secrets.token_hex(4)
            log.error("dashboard: %s %s failed (error id %s)", request.method, request.url.path,
                      ref, exc_info=True)  # fmt: skip
            return self._error(request, 503, database_problem(exc, self.data.table_names(), ref))

    # -- parameters ----------------------------------------------------------------------

    @staticmethod
    def _int(request: Request, name: str, lo: int, hi: int, default: int | None = None) -> Any:
        raw = request.query_params.get(name)
        if raw is None or raw == "":
            return default
        try:
            value = int(raw)
        except ValueError:
            raise InvalidArgument(f"{name} must be a whole number, got {raw[:40]!r}") from None
        if not lo <= value <= hi:
            raise InvalidArgument(f"{name} must be between {lo} and {hi}, got {raw[:40]}")
        return value

    @staticmethod
    def _shown(params: Any) -> datetime | None:
        """The ``created_at`` of the message a page showed (its forms and links carry it)."""
        raw = str(params.get("shown") or "")
        if not raw:
            return None
        try:
            shown = datetime.fromisoformat(raw)
        except ValueError:
            shown = None
        if shown is None or shown.tzinfo is None:
            raise InvalidArgument(f"shown must be a time with its offset, got {raw[:40]!r}")
        return shown

    @staticmethod
    def _form_int(form: Any, name: str) -> int | None:
        """A whole number from 0 to ``MAX_ID`` in a posted form; None when absent."""
        raw = str(form.get(name) or "")
        if not raw:
            return None
        if not DIGITS.fullmatch(raw) or int(raw) > MAX_ID:
            raise InvalidArgument(f"{name} must be a whole number, got {raw[:40]!r}")
        return int(raw)

    @staticmethod
    def _required(params: Any, name: str) -> str:
        value = params.get(name)
        if not value:
            raise InvalidArgument(f"missing parameter {name!r}")
        return str(value)

    @staticmethod
    def _local(form: Any, default: str) -> str:
        """The form's ``next`` page when it is one of the dashboard's own, else ``default``."""
        target = str(form.get("next") or "")
        if not target.startswith("/") or target.startswith(("//", "/\\")):
            return default
        return target

    @staticmethod
    def _limits(form: Any) -> dict[str, Any]:
        """``set_limits``'s arguments from the controls form: an empty field removes a limit, a
        field left out keeps it."""
        limits: dict[str, Any] = {}
        if "max_in_flight" in form:
            limits["max_in_flight"] = count_field(form, "max_in_flight")
        if "rate_count" in form or "rate_period" in form:
            count = count_field(form, "rate_count")
            period = period_field(form, "rate_period")
            if (count is None) != (period is None):
                raise InvalidArgument(
                    "a rate limit needs both rate_count and rate_period (seconds); leave both "
                    "empty for no rate limit"
                )
            limits["rate"] = None if count is None else (count, period)
        if not limits:
            raise InvalidArgument("give max_in_flight, or rate_count and rate_period")
        return limits

    def _filter(self, params: Any) -> MessageFilter:
        return parse_filter(
            params.get("state") or None,
            params.get("key_prefix") or None,
            [str(w) for w in params.getlist("where")],
        )

    # -- pages ---------------------------------------------------------------------------

    async def overview(self, request: Request) -> Response:
        async def build() -> Response:
            snap = await run_in_threadpool(self.data.overview)
            return self.render(request, "overview.html", self._overview_context(snap))

        return await self._serve(request, build)

    async def overview_fragment(self, request: Request) -> Response:
        async def build() -> Response:
            snap = await run_in_threadpool(self.data.overview)
            return self.render(request, "_overview.html", self._overview_context(snap))

        return await self._serve(request, build)

    def _overview_context(self, snap: Any) -> dict[str, Any]:
        processed = tuple(sum(col) for col in zip(*(q.processed for q in snap.queues), strict=True))
        failed = tuple(sum(col) for col in zip(*(q.failed for q in snap.queues), strict=True))
        n = len(snap.minutes)
        return {
            "snap": snap,
            "refresh": self.refresh,
            "total": bars(processed or (0,) * n, failed or (0,) * n, width=720, height=120),
            "bars": bars,
            "processed_hour": sum(processed),
            "failed_hour": sum(failed),
        }

    async def messages(self, request: Request) -> Response:
        async def build() -> Response:
            params = request.query_params
            table = self._required(params, "table")
            queue = self._required(params, "queue")
            where = self._filter(params)
            after = self._int(request, "after", 0, MAX_ID)
            limit = self._int(request, "limit", 1, MAX_LIMIT, DEFAULT_LIMIT)
            found, more = await run_in_threadpool(
                self.data.search, table, queue, where, after, limit
            )
            controls = await run_in_threadpool(self.data.controls, table, queue)
            query = {
                "table": table,
                "queue": queue,
                "state": where.state,
                "key_prefix": where.key_prefix,
                "limit": limit if limit != DEFAULT_LIMIT else None,
            }
            wheres = [w for w in params.getlist("where") if w.strip()]
            filter_query = [*query.items(), *(("where", w) for w in wheres)]
            here = self.link(request, "/messages", [*filter_query, ("after", after)])
            return self.render(
                request,
                "messages.html",
                {
                    "table": table,
                    "queue": queue,
                    "where": where,
                    "wheres": wheres,
                    "messages": found,
                    "more": more,
                    "after": after,
                    "limit": limit,
                    "states": MESSAGE_STATES,
                    "next_page": self.link(
                        request, "/messages", [*filter_query, ("after", found[-1].id)]
                    )
                    if more
                    else None,
                    "first_page": self.link(request, "/messages", filter_query)
                    if after is not None
                    else None,
                    "filter_query": filter_query,
                    "here": here[len(self.root(request)) :],
                    "now": self.data.now(),
                    "controls": controls,
                },
            )

        return await self._serve(request, build)

    async def message(self, request: Request) -> Response:
        async def build() -> Response:
            params = request.query_params
            table = self._required(params, "table")
            queue = self._required(params, "queue")
            id = self._int(request, "id", 0, MAX_ID)
            if id is None:
                raise InvalidArgument("missing parameter 'id'")
            info: MessageInfo = await run_in_threadpool(self.data.message, table, queue, id)
            return self.render(
                request,
                "message.html",
                {
                    "table": table,
                    "queue": queue,
                    "m": info,
                    "views": payload_views(info.payload),
                    "now": self.data.now(),
                    "here": f"/message?{urlencode({'table': table, 'queue': queue, 'id': id})}",
                },
            )

        return await self._serve(request, build)

    async def confirm(self, request: Request) -> Response:
        async def build() -> Response:
            if not self.actions:
                raise Refused(403, "Actions are disabled on this dashboard (read-only).")
            params = request.query_params
            action = self._required(params, "action")
            table = self._required(params, "table")
            queue = self._required(params, "queue")
            id = self._int(request, "id", 0, MAX_ID)
            if action not in ACTIONS:
                raise InvalidArgument(f"unknown action {action!r}")
            if id is not None:
                shown = self._shown(params)
                info = await run_in_threadpool(self.data.message, table, queue, id, shown)
                where = self.data.action_filter(action, MessageFilter(keys=(info.key,)))
                count = await run_in_threadpool(self.data.count, table, queue, where, action)
                fields = [
                    ("table", table),
                    ("queue", queue),
                    ("id", str(id)),
                    ("shown", info.created_at.isoformat()),
                ]
                what = f"message {info.key!r} of queue {queue}"
            else:
                where = self.data.action_filter(action, self._filter(params))
                count, upto = await run_in_threadpool(self.data.bound, table, queue, where, action)
                fields = [
                    ("table", table),
                    ("queue", queue),
                    ("state", str(where.state or "")),
                    ("key_prefix", where.key_prefix or ""),
                    *(("where", w) for w in params.getlist("where") if w.strip()),
                    # What the operator confirms: none offered since, no more than shown.
                    ("upto", str(upto)),
                    ("expected", str(count)),
                ]
                what = describe(queue, where)
            return self.render(
                request,
                "confirm.html",
                {
                    "action": action,
                    "count": count,
                    "what": what,
                    "fields": fields,
                    "back": self.link(request, "/messages", {"table": table, "queue": queue}),
                },
            )

        return await self._serve(request, build)

    async def act(self, request: Request) -> Response:
        async def build() -> Response:
            form = await self._check_post(request)
            action = self._required(form, "action")
            table = self._required(form, "table")
            queue = self._required(form, "queue")
            raw_id = str(form.get("id") or "")
            if raw_id:
                if not DIGITS.fullmatch(raw_id) or int(raw_id) > MAX_ID:
                    raise InvalidArgument(f"id must be a message id, got {raw_id[:40]!r}")
                info, changed = await run_in_threadpool(
                    self.data.act_one, action, table, queue, int(raw_id), self._shown(form)
                )
                self.data.invalidate()
                log.info("dashboard: %s on %s/%s: %d changed", action, queue, info.key, changed)
                back = "/messages?" + urlencode({"table": table, "queue": queue})
                return RedirectResponse(self.root(request) + self._local(form, back), 303)
            where = self._filter(form)
            upto = self._form_int(form, "upto")
            expected = self._form_int(form, "expected")
            job = await run_in_threadpool(
                functools.partial(self.data.start_job, upto=upto, at_most=expected),
                action,
                table,
                queue,
                where,
            )
            log.info("dashboard: %s on %s (%d messages)", action, job.description, job.total)
            return RedirectResponse(self.link(request, f"/jobs/{job.id}"), status_code=303)

        return await self._serve(request, build)

    async def steer(self, request: Request) -> Response:
        async def build() -> Response:
            form = await self._check_post(request)
            op = self._required(form, "op")
            if op not in STEERING:
                raise InvalidArgument(
                    f"unknown change {op[:40]!r}; use one of: {', '.join(STEERING)}"
                )
            limits = self._limits(form) if op == "limits" else {}
            entity = str(form.get("entity") or "")
            target: str | tuple[str, str]
            if entity:
                target, name = entity, entity
                back = "/entities?" + urlencode({"name": entity})
            else:
                table, queue = self._required(form, "table"), self._required(form, "queue")
                target, name = (table, queue), f"{table}/{queue}"
                back = "/messages?" + urlencode({"table": table, "queue": queue})
            result = await run_in_threadpool(self.data.steer, target, STEERING[op], limits)
            self.data.invalidate()
            shown = ", ".join(label for _, label in control_labels(result)) or "plain"
            log.info("dashboard: %s %s: %s", op, name, shown)
            return RedirectResponse(self.root(request) + self._local(form, back), 303)

        return await self._serve(request, build)

    async def job(self, request: Request) -> Response:
        async def build() -> Response:
            job = self.data.job(request.path_params["id"])
            return self.render(request, "job.html", {"job": job})

        return await self._serve(request, build)

    async def job_fragment(self, request: Request) -> Response:
        async def build() -> Response:
            job = self.data.job(request.path_params["id"])
            return self.render(request, "_job.html", {"job": job})

        return await self._serve(request, build)

    async def workers(self, request: Request) -> Response:
        async def build() -> Response:
            rows = await run_in_threadpool(self.data.workers)
            return self.render(
                request,
                "workers.html",
                {"workers": rows, "now": self.data.now(), "dead_after": DEAD_AFTER_BEATS},
            )

        return await self._serve(request, build)

    async def cron(self, request: Request) -> Response:
        async def build() -> Response:
            rows = await run_in_threadpool(self.data.cron)
            return self.render(request, "cron.html", {"rows": rows, "now": self.data.now()})

        return await self._serve(request, build)

    async def entities(self, request: Request) -> Response:
        async def build() -> Response:
            params = request.query_params
            name = params.get("name")
            snap = await run_in_threadpool(self.data.overview)
            here = "/entities?" + urlencode({"name": name}) if name else "/entities"
            context: dict[str, Any] = {
                "snap": snap,
                "name": name,
                "states": ENTITY_STATES,
                "here": here,
            }
            if name:
                state = params.get("state") or None
                after_raw = params.get("after") or None
                eq = self.data.entity(name)
                after: Any = None
                if after_raw is not None:
                    try:
                        after = eq.pk.type.python_type(after_raw)
                    except (ValueError, TypeError, NotImplementedError):
                        raise InvalidArgument(f"after: {after_raw[:40]!r} is not a key") from None
                    if isinstance(after, int) and not 0 <= after <= MAX_ID:
                        raise InvalidArgument(f"after must be between 0 and {MAX_ID}")
                limit = self._int(request, "limit", 1, MAX_LIMIT, DEFAULT_LIMIT)
                columns, rows, more = await run_in_threadpool(
                    self.data.entity_rows, name, state, after, limit
                )
                pk_index = columns.index(eq.pk.name)
                context.update(
                    state=state,
                    columns=columns,
                    rows=rows,
                    next_page=self.link(
                        request,
                        "/entities",
                        {"name": name, "state": state, "after": rows[-1][pk_index]},
                    )
                    if more
                    else None,
                )
            return self.render(request, "entities.html", context)

        return await self._serve(request, build)

    async def login(self, request: Request) -> Response:
        if self.token is None:
            return self._error(request, 404, "No such page.")
        if request.method == "GET":
            return self.render(request, "login.html", {"failed": False})
        if not self._same_origin(request):
            return self._error(request, 403, "Refused: the login form comes from elsewhere.")
        form = await request.form()
        given = str(form.get("token", ""))
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            return self.render(request, "login.html", {"failed": True}, status=401)
        response = RedirectResponse(self.link(request, "/"), status_code=303)
        self._sign_in(request, response)
        return response

    async def logout(self, request: Request) -> Response:
        """Ends the sign-in: its value is refused from now on (in this process; in every process
        sharing ``secret`` once it expires) and the browser forgets its cookie."""
        if self.token is None:
            return self._error(request, 404, "No such page.")
        try:
            await self._check_form(request)
        except Refused as exc:
            return self._error(request, exc.status, exc.message)
        session = self._session(request)
        if session is not None:
            self._end_session(*session)
            log.info("dashboard: signed out")
        response = RedirectResponse(self.link(request, "/login"), status_code=303)
        response.delete_cookie(
            SESSION_COOKIE,
            path=self.root(request) + "/",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return response

    async def static(self, request: Request) -> Response:
        name = request.path_params["name"]
        media = STATIC.get(name)
        if media is None:
            return self._error(request, 404, "No such file.")
        body = resources.files(__package__).joinpath("static", name).read_bytes()
        return Response(body, media_type=media)


def count_field(form: Any, name: str) -> int | None:
    """A positive whole number of the form (None: left empty)."""
    raw = str(form.get(name) or "").strip()
    if not raw:
        return None
    if not re.fullmatch(r"[-+]?[0-9]+", raw):
        raise InvalidArgument(f"{name} must be a whole number, got {raw[:40]!r}")
    if len(raw) > 12 or not 1 <= int(raw) <= MAX_COUNT:
        raise InvalidArgument(
            f"{name} must be between 1 and {MAX_COUNT} (empty: no limit), got {raw[:40]}"
        )
    return int(raw)


def period_field(form: Any, name: str) -> timedelta | None:
    """A positive number of seconds of the form (None: left empty)."""
    raw = str(form.get(name) or "").strip()
    if not raw:
        return None
    if not re.fullmatch(r"[-+]?[0-9]+(\.[0-9]+)?", raw):
        raise InvalidArgument(f"{name} must be a number of seconds, got {raw[:40]!r}")
    if len(raw) > 20 or not MIN_PERIOD <= float(raw) <= MAX_PERIOD:
        raise InvalidArgument(
            f"{name} must be between {MIN_PERIOD} and {MAX_PERIOD} seconds, got {raw[:40]}"
        )
    return timedelta(seconds=float(raw))


def dashboard(
    target: Any,
    *,
    authorize: Authorize | None = None,
    token: str | None = None,
    actions: bool = False,
    queues: Any = (),
    tables: Any = (),
    counts_ttl: float = 5.0,
    refresh: float | None = None,
    title: str = "sqla_delayedq",
    clock: Callable[[], datetime] | None = None,
    secret: str | bytes | None = None,
    session_ttl: float = SESSION_TTL,
) -> Dashboard:
    """The dashboard as an ASGI app, to mount in your Starlette or FastAPI application.

    :param target: your ``Worker`` or ``AsyncWorker`` (its queues, models and database), a
        ``sessionmaker`` bound to an engine, or an ``Engine`` (then the default table
        ``delayed_queue``, with every queue in it).
    :param authorize: ``authorize(request) -> bool`` (or an ``async def``): your own check
        (a session, a role). Required unless ``token`` is given.
    :param token: a shared secret instead: ``Authorization: Bearer <token>``, or the login form
        (which sets an HttpOnly cookie).
    :param actions: allow changes (retry, process now, drop; pause, resume and limit queues);
        read-only by default.
    :param queues: more ``DelayedQueue`` / ``EntityQueue`` objects to show.
    :param tables: more message tables (mapped classes with ``QueueMessageMixin``) whose
        queues to show, every queue found in them.
    :param counts_ttl: the overview's counts are shared by every viewer and recounted at most
        this often (seconds).
    :param refresh: seconds between the overview's automatic refreshes (default: counts_ttl,
        at least 1).
    :param secret: the key that signs sign-in cookies (with ``token``): give every process
        serving the dashboard the same one, so a sign-in works on all of them; by default a
        random key of this process (a restart signs everyone out).
    :param session_ttl: seconds a sign-in lasts (12 hours by default); the Sign out button
        ends it before.
    """
    if authorize is None and not token:
        raise InvalidArgument(
            "dashboard() serves no page without authorization: pass authorize=<your check> "
            "(mounted in your app) or token=<a secret>"
        )
    if authorize is not None and token:
        raise InvalidArgument("pass authorize= or token=, not both")
    if authorize is not None and not callable(authorize):
        raise InvalidArgument("authorize must be a function of the request")
    if not (isinstance(session_ttl, int | float) and 0 < session_ttl < math.inf):
        raise InvalidArgument(
            f"session_ttl must be a positive number of seconds, got {session_ttl!r}"
        )
    if secret is not None and (not isinstance(secret, str | bytes) or len(secret) < 16):
        raise InvalidArgument("secret must be a string or bytes of at least 16 characters")
    data = Data(target, queues=queues, tables=tables, counts_ttl=counts_ttl, clock=clock)
    return Dashboard(
        data,
        authorize=authorize,
        token=token,
        actions=actions,
        title=title,
        refresh=refresh if refresh is not None else max(1.0, counts_ttl),
        secret=secret,
        session_ttl=session_ttl,
    )
