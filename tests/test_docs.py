"""The documentation works when pasted, and the API reference matches the docstrings.

Every ```` ```python ```` block of a page runs, in page order, as one script in a fresh temporary
directory (a subprocess with this interpreter, ``cwd`` = that directory), so the blocks of a
page share their names exactly as a reader pasting them into one session would. Fences:

- ```` ```python ```` runs;
- ```` ```python no-run ```` is a fragment shown for reading (needs a server, a project of yours);
- ```` ```python needs=MODULE ```` runs only where ``MODULE`` is importable; the page then runs
  once without it and, when it can, once more with it;
- any other language tag (``console``, ``sql``, ``text``) is not Python and never runs.

Each block keeps its line numbers from the Markdown file (the script is padded with blank lines),
so a traceback points at the page's own line. A block that calls ``Worker.run()`` blocks until
SIGTERM as documented: when the worker has started and the page has printed nothing for a
second, the test sends SIGTERM and expects the graceful stop to let the page carry on to exit 0.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Pages whose Python blocks are self-contained and run in order.
PAGES = [
    "README.md",
    "docs/quickstart.md",
    "docs/queue.md",
    "docs/retries.md",
    "docs/admin.md",
    "docs/workers.md",
    "docs/cron.md",
    "docs/entity-queues.md",
    "docs/testing.md",
    "docs/payloads.md",
    "docs/controls.md",
    "docs/traces.md",
]

FENCE = re.compile(r"^```(\S*)[ \t]*(.*?)[ \t]*$")
STARTED = "[test_docs] worker started"

#: Line 1 of every script (a page's line 1 is its title, never code): announce worker starts, so
#: the test knows a blocking ``run()`` has its signal handlers in place before sending SIGTERM.
PRELUDE = (
    "import sys as _s, sqla_delayedq.worker as _w; _start = _w.Worker.start; "
    "_w.Worker.start = lambda self: (_start(self), "
    f"print({STARTED!r}, file=_s.stderr, flush=True))[0]"
)


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the first code line in the page
    code: str
    options: tuple[str, ...]

    @property
    def runs(self) -> bool:
        return "no-run" not in self.options

    @property
    def needs(self) -> tuple[str, ...]:
        return tuple(o.split("=", 1)[1] for o in self.options if o.startswith("needs="))


def python_blocks(text: str) -> list[Block]:
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match or not match.group(1):
            i += 1
            continue
        lang, options = match.group(1), tuple(match.group(2).split())
        start = i + 1
        i = start
        while i < len(lines) and lines[i].rstrip() != "```":
            i += 1
        if lang == "python":
            blocks.append(Block(start + 1, "\n".join(lines[start:i]), options))
        i += 1
    return blocks


def script(blocks: list[Block]) -> str:
    """The blocks at their own line numbers, blank lines in between, the prelude on line 1."""
    out: list[str] = [PRELUDE]
    for block in blocks:
        assert block.line > len(out), "a block overlaps the one before it"
        out += [""] * (block.line - 1 - len(out))
        out += block.code.splitlines()
    return "\n".join(out) + "\n"


def variants(page: str) -> list[tuple[str, tuple[str, ...]]]:
    """(page, optional modules to include): the page without optional blocks, then with each."""
    blocks = python_blocks((ROOT / page).read_text())
    optional = sorted({m for b in blocks for m in b.needs})
    return [(page, ())] + [(page, (m,)) for m in optional]


def test_fences_are_recognised() -> None:
    text = "# t\n```python\na = 1\n```\n```python no-run\nb\n```\n```console\n$ x\n```\n"
    blocks = python_blocks(text)
    assert [(b.line, b.code, b.runs) for b in blocks] == [(3, "a = 1", True), (6, "b", False)]
    assert script([b for b in blocks if b.runs]).splitlines() == [PRELUDE, "", "a = 1"]


class Run:
    """A page script in a subprocess, its output collected by reader threads."""

    def __init__(self, path: Path, cwd: Path) -> None:
        path_var = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path_var}
        self.proc = subprocess.Popen(
            [sys.executable, str(path)],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.last_output = time.monotonic()
        self.threads = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.stdout), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.stderr), daemon=True),
        ]
        for t in self.threads:
            t.start()

    def _read(self, stream, sink: list[str]) -> None:
        for line in stream:
            sink.append(line)
            if not line.startswith(STARTED):
                self.last_output = time.monotonic()

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        signalled = 0
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait()
                pytest.fail(f"the page did not finish within {timeout} s\n{self.output()}")
            started = sum(line.startswith(STARTED) for line in self.stderr)
            if started > signalled and time.monotonic() - self.last_output > 1.0:
                self.proc.send_signal(signal.SIGTERM)  # what Worker.run() waits for
                signalled = started
            time.sleep(0.05)
        for t in self.threads:
            t.join(5)
        return self.proc.returncode

    def output(self) -> str:
        err = "".join(line for line in self.stderr if not line.startswith(STARTED))
        return f"--- stdout\n{''.join(self.stdout)}--- stderr\n{err}"


VARIANTS = [v for page in PAGES for v in variants(page)]


@pytest.mark.parametrize(
    ("page", "optional"),
    VARIANTS,
    ids=[page + "".join(f"+{m}" for m in optional) for page, optional in VARIANTS],
)
def test_page_runs_when_pasted(page: str, optional: tuple[str, ...], tmp_path: Path) -> None:
    for module in optional:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install {module})")
    blocks = [
        b
        for b in python_blocks((ROOT / page).read_text())
        if b.runs and set(b.needs) <= set(optional)
    ]
    assert blocks, f"{page} has no runnable python block"
    path = tmp_path / (Path(page).name + ".py")  # tracebacks name the page and its line
    path.write_text(script(blocks))
    run = Run(path, tmp_path)
    code = run.wait(timeout=60)
    assert code == 0, f"{page} failed (exit {code}); line numbers are the page's\n{run.output()}"


@pytest.mark.parametrize("hash_seed", ["0", "1"])
def test_reference_is_up_to_date(hash_seed: str) -> None:
    """docs/reference.md is what the script makes now, whatever the hash seed (deterministic)."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_reference.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONHASHSEED": hash_seed},
    )
    assert result.returncode == 0, result.stdout + result.stderr


#: Pages whose links are checked: anchors must exist in every linked page that exists.
LINKED_PAGES = [
    *PAGES,
    "docs/dashboard.md",
    "docs/cli.md",
    "docs/alembic.md",
    "docs/backends.md",
    "docs/contributing.md",
    "docs/recipes.md",
    "docs/why.md",
    "docs/reference.md",
]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    found: set[str] = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return found


@pytest.mark.parametrize("page", LINKED_PAGES)
def test_links_to_headings_resolve(page: str) -> None:
    source = ROOT / page
    broken = []
    for target in LINK.findall(source.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        file, _, anchor = target.partition("#")
        linked = (source.parent / file).resolve() if file else source
        if anchor and linked.exists() and anchor not in anchors(linked):
            broken.append(target)
    assert not broken, f"{page}: links to missing headings: {broken}"
