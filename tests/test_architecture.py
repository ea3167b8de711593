"""The package's architecture rules hold (scripts/check_architecture.py), and they can fail."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import check_architecture as arch  # noqa: E402


def test_the_package_keeps_its_architecture_rules() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_architecture.py")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_rules_catch_what_they_forbid() -> None:
    code = """
from ._queue import _envelope
def f(queue, dialect):
    if dialect.name == "mysql":
        return queue._settle
    return family(dialect) in ("sqlite", "postgresql")
"""
    tree = ast.parse(code)
    names = [what for _, what in arch.dialect_names(tree)]
    assert any("dialect.name" in n for n in names)
    assert any("'sqlite'" in n for n in names)
    assert "_settle" not in arch.defined_here(tree)
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert arch.cycles(graph) == [["a", "b", "c"]]
