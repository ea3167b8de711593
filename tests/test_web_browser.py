"""The dashboard in a real headless Chromium (Selenium with the distribution's chromedriver).

uvicorn serves the dashboard from a thread, mounted under a path of an outer Starlette app as a
user would mount it; the tests run on SQLite and PostgreSQL. With ``DELAYEDQ_SCREENSHOTS=docs``
they also write the screenshots of ``docs/dashboard.md`` into ``docs/images/``.

Chromium and chromedriver come from the distribution (``apt-get install chromium
chromium-driver``; ``.ci/run`` installs them). Without them the tests are skipped, except with
``CI=true``, where they fail.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from sqla_delayedq import DelayedQueue, ExponentialBackoff, QueueControls
from sqla_delayedq.models import stats_table, workers_table
from tests.fix_db import Backend, in_ci

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import uvicorn
    from selenium import webdriver
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.support.ui import Select, WebDriverWait
    from starlette.applications import Starlette
    from starlette.routing import Mount

from sqla_delayedq.web import dashboard

pytestmark = pytest.mark.parametrize("backend", ["sqlite", "postgresql"], indirect=True)

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("DELAYEDQ_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("DELAYEDQ_CHROMEDRIVER", "/usr/bin/chromedriver")
TOKEN = "browser-token-0123456789"
MOUNT = "/ops/queues"
HOSTILE = '<script>window.pwned=1</script><img src=x onerror="window.pwned=2">'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDriver]:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not shutil.which(p)]
    if missing:
        reason = f"no {', '.join(missing)}: apt-get install chromium chromium-driver"
        if in_ci():
            pytest.fail(f"the browser tests must run with CI=true: {reason}")
        pytest.skip(reason)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


class Served:
    """A dashboard served by uvicorn from a thread, mounted under MOUNT."""

    def __init__(self, backend: Backend) -> None:
        self.board = dashboard(
            backend.Session, token=TOKEN, actions=True, counts_ttl=0.2, refresh=1
        )
        app = Starlette(routes=[Mount(MOUNT, app=self.board)])
        self.port = free_port()
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        self.origin = f"http://127.0.0.1:{self.port}"
        self.base = self.origin + MOUNT

    def url(self, path: str) -> str:
        return self.base + path

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.board.data.close()


@pytest.fixture
def served(backend: Backend, browser: WebDriver) -> Iterator[Served]:
    s = Served(backend)
    browser.delete_all_cookies()
    try:
        yield s
    finally:
        browser.get("about:blank")
        s.stop()


def sign_in(browser: WebDriver, served: Served, path: str = "/") -> None:
    browser.get(served.url(path) + ("&" if "?" in path else "?") + f"token={TOKEN}")
    assert "token=" not in browser.current_url  # the redirect drops it from the address bar


def wait(browser: WebDriver, check: Callable[[WebDriver], Any], timeout: float = 15) -> Any:
    """Until ``check`` holds; elements of a page being replaced may go stale meanwhile.

    Chromium reports some of those as "Node with given id does not belong to the document" (a
    plain ``WebDriverException``) rather than as a stale element: the same race, retried too.
    """

    def tolerant(b: WebDriver) -> Any:
        try:
            return check(b)
        except WebDriverException as exc:
            if "does not belong to the document" in str(exc):
                return False
            raise

    return WebDriverWait(
        browser, timeout, poll_frequency=0.1, ignored_exceptions=[StaleElementReferenceException]
    ).until(tolerant)


def text_of(browser: WebDriver, css: str) -> str:
    return str(browser.find_element(By.CSS_SELECTOR, css).text)


def screenshot(browser: WebDriver, backend: Backend, name: str) -> None:
    """With DELAYEDQ_SCREENSHOTS=docs, save the page for docs/dashboard.md (from the PostgreSQL
    run, or the backend named by DELAYEDQ_SCREENSHOTS_BACKEND)."""
    if os.environ.get("DELAYEDQ_SCREENSHOTS") != "docs":
        return
    if backend.name != os.environ.get("DELAYEDQ_SCREENSHOTS_BACKEND", "postgresql"):
        return
    target = REPO / "docs" / "images" / f"dashboard-{name}.png"
    target.parent.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(target))


def offer(backend: Backend, q: DelayedQueue[Any], keys: list[str], **payload: Any) -> None:
    with backend.Session() as s, s.begin():
        for i, key in enumerate(keys):
            q.offer(s, key, {"i": i, **payload})


def kill_all(backend: Backend, q: DelayedQueue[Any], error: str = "boom") -> None:
    with backend.Session() as s, s.begin():
        for env in q.try_poll_many(s, 1000):
            q.nack(s, env, RuntimeError(error))


def dead_queue(name: str = "orders") -> DelayedQueue[Any]:
    return DelayedQueue(name, retry=ExponentialBackoff(max_attempts=1))


def history(backend: Backend, queue: str) -> None:
    """An hour of per-minute counters and two workers, for the screenshots."""
    now = datetime.now(UTC).replace(second=0, microsecond=0)
    with backend.engine.begin() as conn:
        for i in range(60):
            conn.execute(
                stats_table.insert().values(
                    worker_id="w1",
                    table_name="delayed_queue",
                    queue=queue,
                    minute=now - timedelta(minutes=i),
                    processed=40 + (i * 7) % 25,
                    failed=(i % 9 == 0) * 3,
                    dead=0,
                )
            )
        exact = datetime.now(UTC)
        for i, beat in enumerate((exact, exact - timedelta(minutes=3))):
            conn.execute(
                workers_table.insert().values(
                    id=f"w{i}",
                    name=f"orders-worker-{i}",
                    host="app-1",
                    pid=4100 + i,
                    runtime="threads",
                    started_by="cli",
                    queues=f'["delayed_queue:{queue}"]',
                    concurrency=4,
                    heartbeat_seconds=10.0,
                    started_at=now - timedelta(hours=2),
                    heartbeat_at=beat,
                    in_flight=2 - i,
                    processed=5120,
                    failed=12,
                )
            )


# -- the tests -----------------------------------------------------------------------------------


def test_overview_counts_change_after_offers_without_a_reload(
    backend: Backend, browser: WebDriver, served: Served
) -> None:
    q: DelayedQueue[Any] = DelayedQueue("emails")
    offer(backend, q, ["a", "b"])
    history(backend, "emails")
    sign_in(browser, served)
    assert browser.execute_script("return typeof htmx") == "object"  # loaded under the CSP
    due = 'tr[data-queue="emails"] td.due'
    assert text_of(browser, due) == "2"
    browser.execute_script("window.notReloaded = 42")
    offer(backend, q, ["c", "d", "e"])
    wait(browser, lambda b: text_of(b, due) == "5")
    assert browser.execute_script("return window.notReloaded") == 42
    screenshot(browser, backend, "overview")
    browser.get(served.url("/workers"))
    assert text_of(browser, 'tr[data-pid="4100"] td.state') == "running"
    assert text_of(browser, 'tr[data-pid="4101"] td.state') == "dead"
    screenshot(browser, backend, "workers")


def test_filter_dead_messages_by_a_payload_field_and_retry_one(
    backend: Backend, browser: WebDriver, served: Served
) -> None:
    q = dead_queue()
    offer(backend, q, [f"invoice/{i}" for i in range(4)], companyId=3345)
    offer(backend, q, [f"other/{i}" for i in range(3)], companyId=7)
    kill_all(backend, q, "payment provider timed out")
    sign_in(browser, served)
    browser.find_element(By.LINK_TEXT, "orders").click()
    Select(browser.find_element(By.ID, "state")).select_by_value("dead")
    browser.find_element(By.ID, "where").send_keys("companyId=3345")
    browser.find_element(By.ID, "apply").click()

    def rows(b: WebDriver) -> list[str]:
        found = b.find_elements(By.CSS_SELECTOR, "#messages tbody tr[data-key]")
        return sorted(str(r.get_attribute("data-key")) for r in found)

    wait(browser, lambda b: "companyId" in b.current_url)
    wait(browser, lambda b: rows(b) == [f"invoice/{i}" for i in range(4)])
    screenshot(browser, backend, "messages")

    browser.find_element(By.CSS_SELECTOR, 'tr[data-key="invoice/0"] button.retry').click()
    wait(browser, lambda b: "invoice/0" not in rows(b))
    assert "state=dead" in browser.current_url and "companyId" in browser.current_url
    assert rows(browser) == [f"invoice/{i}" for i in (1, 2, 3)]
    with backend.Session() as s:
        info = q.get(s, "invoice/0")
        assert info is not None and info.state.value == "due"

    browser.find_element(By.ID, "bulk-retry").click()
    assert "This will change 3 messages" in text_of(browser, "#confirm-count")
    screenshot(browser, backend, "confirm")
    browser.find_element(By.ID, "confirm").click()
    wait(browser, lambda b: "Done: 3 messages changed." in text_of(b, "#job-status"))
    browser.get(served.url("/messages?table=delayed_queue&queue=orders&key_prefix=invoice/0"))
    browser.find_element(By.LINK_TEXT, "invoice/0").click()
    assert "payment provider timed out" in text_of(browser, "#last-error")
    screenshot(browser, backend, "message")


def submit_forged(browser: WebDriver, action: str, fields: dict[str, str]) -> None:
    """Build and submit a form with the page's own JavaScript context (as an attacker's page
    or a tampered form would)."""
    browser.execute_script(
        """
        const [action, fields] = arguments;
        const form = document.createElement('form');
        form.method = 'post';
        form.action = action;
        for (const [name, value] of Object.entries(fields)) {
            const input = document.createElement('input');
            input.type = 'hidden'; input.name = name; input.value = value;
            form.appendChild(input);
        }
        document.body.appendChild(form);
        form.submit();
        """,
        action,
        fields,
    )


class Attacker(BaseHTTPRequestHandler):
    """Another origin, serving a page with a form that posts to the dashboard."""

    target = ""
    fields: dict[str, str] = {}
    timeout = 2  # Chrome's idle preconnections must not hold the server's shutdown

    def do_GET(self) -> None:
        inputs = "".join(
            f'<input type="hidden" name="{k}" value="{v}">' for k, v in self.fields.items()
        )
        body = (
            f'<!doctype html><form method="post" action="{self.target}">{inputs}'
            '<button id="go" type="submit">win a prize</button></form>'
        ).encode()
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_actions_are_refused_without_auth_csrf_token_or_same_origin(
    backend: Backend, browser: WebDriver, served: Served
) -> None:
    q = dead_queue()
    offer(backend, q, ["victim"])
    kill_all(backend, q)
    with backend.Session() as s:
        victim = q.get(s, "victim")
    assert victim is not None
    fields = {"action": "retry", "table": "delayed_queue", "queue": "orders", "id": str(victim.id)}
    actions = served.url("/actions")

    browser.get(served.url("/messages?table=delayed_queue&queue=orders&state=dead"))
    assert "Sign in" in browser.title and "victim" not in browser.page_source
    submit_forged(browser, actions, fields)
    wait(browser, lambda b: "Sign in" in b.title)

    sign_in(browser, served, "/messages?table=delayed_queue&queue=orders&state=dead")
    submit_forged(browser, actions, fields)  # no CSRF token
    wait(browser, lambda b: "403" in b.title)
    assert "CSRF token is missing or wrong" in text_of(browser, "#error-message")
    browser.back()
    submit_forged(browser, actions, {**fields, "csrf": "x" * 43})  # a wrong one
    wait(browser, lambda b: "403" in b.title)
    assert "CSRF token is missing or wrong" in text_of(browser, "#error-message")

    csrf = browser.get_cookie("delayedq_csrf")
    assert csrf is not None and csrf["httpOnly"] and csrf["sameSite"] == "Strict"
    Attacker.target = actions
    Attacker.fields = {**fields, "csrf": csrf["value"]}  # even with the right token
    evil = ThreadingHTTPServer(("127.0.0.1", 0), Attacker)
    evil.daemon_threads = True
    threading.Thread(target=evil.serve_forever, daemon=True).start()
    try:
        # Another port of the same host: another origin, but the same site, so the browser
        # sends the SameSite=Strict cookies; the Origin check is what refuses it.
        browser.get(f"http://127.0.0.1:{evil.server_address[1]}/")
        browser.find_element(By.ID, "go").click()
        wait(browser, lambda b: b.current_url.startswith(served.origin))
        assert "403" in browser.title
        assert "does not come from this dashboard's origin" in text_of(browser, "#error-message")
    finally:
        evil.shutdown()
        evil.server_close()
    with backend.Session() as s:
        info = q.get(s, "victim")
        assert info is not None and info.state.value == "dead"


def test_sign_out_ends_the_sign_in(backend: Backend, browser: WebDriver, served: Served) -> None:
    sign_in(browser, served, "/workers")
    session = browser.get_cookie("delayedq_session")
    assert session is not None and session["httpOnly"] and session.get("expiry")
    browser.find_element(By.ID, "logout").click()
    wait(browser, lambda b: "Sign in" in b.title)
    assert browser.current_url == served.url("/login")
    assert browser.get_cookie("delayedq_session") is None
    browser.add_cookie(session)  # the old value, replayed
    browser.get(served.url("/workers"))
    assert "Sign in" in browser.title
    assert not browser.find_elements(By.ID, "logout")


def test_a_hostile_payload_is_shown_as_text_and_never_runs(
    backend: Backend, browser: WebDriver, served: Served
) -> None:
    q = dead_queue("hostile")
    with backend.Session() as s, s.begin():
        q.offer(s, "<b>bold</b>", {"comment": HOSTILE})
    kill_all(backend, q, HOSTILE)
    sign_in(browser, served, "/messages?table=delayed_queue&queue=hostile")
    assert HOSTILE[:30] in text_of(browser, "#messages")
    assert "<b>bold</b>" in text_of(browser, "#messages")
    browser.find_element(By.LINK_TEXT, "<b>bold</b>").click()
    assert "<script>window.pwned=1</script>" in text_of(browser, "#payload-1")
    assert HOSTILE in text_of(browser, "#last-error")
    time.sleep(0.3)  # an <img onerror> would have fired by now
    assert browser.execute_script("return window.pwned") is None
    try:
        logs = browser.get_log("browser")  # type: ignore[attr-defined]
    except WebDriverException:
        logs = []
    assert not [entry for entry in logs if "pwned" in entry.get("message", "")]


def click(browser: WebDriver, css: str) -> None:
    """Click ``css``, again if the overview's refresh replaced it meanwhile."""

    def clicked(b: WebDriver) -> bool:
        b.find_element(By.CSS_SELECTOR, css).click()
        return True

    wait(browser, clicked)


def test_pause_limit_and_resume_a_queue(
    backend: Backend, browser: WebDriver, served: Served
) -> None:
    q: DelayedQueue[Any] = DelayedQueue("emails")
    offer(backend, q, ["a", "b"])
    offer(backend, DelayedQueue("reports"), ["r"])
    sign_in(browser, served)
    row = 'tr[data-queue="emails"]'

    def shown(b: WebDriver, css: str) -> list[str]:
        return [str(e.text) for e in b.find_elements(By.CSS_SELECTOR, f"{css} .control")]

    assert shown(browser, row) == []
    click(browser, f"{row} button.pause")
    wait(browser, lambda b: shown(b, row) == ["paused"])
    assert shown(browser, 'tr[data-queue="reports"]') == []
    with backend.Session() as s:
        assert q.controls(s).paused

    browser.find_element(By.CSS_SELECTOR, f"{row} td a").click()
    wait(browser, lambda b: shown(b, "#controls") == ["paused"])
    browser.find_element(By.ID, "max_in_flight").send_keys("3")
    browser.find_element(By.ID, "set-limits").click()
    wait(browser, lambda b: shown(b, "#controls") == ["paused", "≤ 3 in flight"])
    assert "queue=emails" in browser.current_url
    screenshot(browser, backend, "controls")
    browser.find_element(By.CSS_SELECTOR, "button.resume").click()
    wait(browser, lambda b: shown(b, "#controls") == ["≤ 3 in flight"])
    with backend.Session() as s:
        assert q.controls(s) == QueueControls(max_in_flight=3)
    browser.get(served.url("/"))
    assert shown(browser, row) == ["≤ 3 in flight"]
    assert browser.find_elements(By.CSS_SELECTOR, f"{row} button.pause")
