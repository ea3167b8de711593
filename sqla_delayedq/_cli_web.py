"""``delayedq web``: serve the dashboard (:mod:`sqla_delayedq.web`) with uvicorn.

It binds to 127.0.0.1 by default and always asks for a token: the one given with ``--token``
(or ``$DELAYEDQ_WEB_TOKEN``), else a random one printed once at start. A host that is not a
loopback address is refused unless the token is given. Read-only unless ``--allow-actions``.
The database URL is never printed; uvicorn's access log is off, because the first visit's URL
carries the token.
"""

from __future__ import annotations

import ipaddress
import secrets
from typing import Any

import click
from click.core import ParameterSource

from ._cli_base import BadInput, RuntimeFailure, db_options
from ._cli_target import as_worker, import_object, open_db

WEB_HINT = "pip install 'sqla_delayedq[web]'"
TOKEN_ENV_VAR = "DELAYEDQ_WEB_TOKEN"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def serve(app: Any, host: str, port: int, root_path: str) -> None:
    """Run ``app`` with uvicorn until interrupted (tests replace this)."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, root_path=root_path, access_log=False, log_level="info")


@click.command()
@db_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option(
    "--token",
    envvar=TOKEN_ENV_VAR,
    help=f"The access token (or ${TOKEN_ENV_VAR}); a random one is printed when not given. "
    "Required with a --host that is not loopback.",
)
@click.option("--allow-actions", is_flag=True, help="Allow retry, process now and drop.")
@click.option(
    "--counts-ttl",
    type=click.FloatRange(min=0),
    default=5.0,
    show_default=True,
    help="Seconds the overview's counts are shared between viewers.",
)
@click.option(
    "--root-path",
    default="",
    help="The path a reverse proxy serves the dashboard at, stripped before it passes requests "
    "on (uvicorn's --root-path): the pages link to it.",
)
@click.pass_context
def web(
    ctx: click.Context,
    app: str | None,
    url: str | None,
    table: str,
    host: str,
    port: int,
    token: str | None,
    allow_actions: bool,
    counts_ttl: float,
    root_path: str,
) -> None:
    """Serve the web dashboard: queues, messages, workers, cron (read-only by default).

    \b
    delayedq web --url postgresql+psycopg://app@db/app
    delayedq web --app myapp.jobs:worker --allow-actions
    """
    try:
        from .web import dashboard
    except ImportError as exc:
        raise RuntimeFailure(f"delayedq web needs {exc.name}: {WEB_HINT}") from exc
    if not is_loopback(host) and not token:
        raise BadInput(
            f"--host {host} is reachable from other machines: give --token (or "
            f"${TOKEN_ENV_VAR}) so the dashboard is not open to anyone"
        )
    root_path = "/" + root_path.strip("/") if root_path.strip("/") else ""
    shown = token is None
    token = token or secrets.token_urlsafe(24)
    if app:
        if ctx.get_parameter_source("url") is ParameterSource.COMMANDLINE:
            raise BadInput("--url and --app both name the database: give one of them")
        target: Any = as_worker(import_object(app, "--app"), app, "--app")
        board = dashboard(target, token=token, actions=allow_actions, counts_ttl=counts_ttl)
    else:
        db = open_db(ctx, url, table)
        board = dashboard(
            db.sessions,
            tables=[db.model],
            token=token,
            actions=allow_actions,
            counts_ttl=counts_ttl,
        )
    shown_host = f"[{host}]" if ":" in host else host
    address = f"http://{shown_host}:{port}/"
    first_visit = f"?token={token}" if shown else " (sign in with your token)"
    if root_path:
        # uvicorn serves the app at its own "/" and the pages link to root_path: only a proxy
        # that strips the prefix makes both meet.
        click.echo(f"dashboard: serving {address} behind a proxy at {root_path}/", err=True)
        click.echo(
            f"open <your proxy's address>{root_path}/{first_visit}; the proxy must pass requests "
            f"on without {root_path}, as the pages' links and cookies use it",
            err=True,
        )
    else:
        click.echo(f"dashboard: {address}{first_visit}", err=True)
    if shown:
        click.echo("(a new token on every start; pass --token to keep one)", err=True)
    click.echo(f"actions: {'enabled' if allow_actions else 'off (read-only)'}", err=True)
    try:
        serve(board, host, port, root_path)
    finally:
        board.data.close()
