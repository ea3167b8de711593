"""Check the package's architecture rules; exit 1 and print each violation.

1. **No import circle** between the package's modules: every ``import`` counts, at module level,
   under ``TYPE_CHECKING`` or inside a function.
2. **No private name crosses a module**: ``from .x import _name`` is refused, and so is
   ``obj._name`` unless ``_name`` is defined in the same module (an attribute, method or
   function of its own), reached through ``self``, ``cls`` or ``super()``, or is public API of a
   library we use (``Row._mapping``, ``namedtuple._replace``, ...). Importing a private *module*
   (``from . import _statements``) is how the package shares its helpers, and allowed.
3. **Dialect names are read in two places only**: ``_dialects.py`` (the strategies) and
   ``_engine.py`` (the engine set-up, with :func:`~sqla_delayedq._engine.family`). Elsewhere no
   ``dialect.name``/``get_backend_name()`` and no ``==``/``in`` against a backend's name.

Run: ``python scripts/check_architecture.py`` (``make lint`` and the test suite run it).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sqla_delayedq"
NAME = "sqla_delayedq"

#: Underscore attributes that are public API of the libraries the package uses.
PUBLIC_UNDERSCORE = {
    "_mapping",  # sqlalchemy Row
    "_asdict",  # namedtuple
    "_replace",  # namedtuple
    "_fields",  # namedtuple
    "_exit",  # os._exit
    "_getframe",  # sys._getframe
}
DIALECT_MODULES = {f"{NAME}._dialects", f"{NAME}._engine"}
BACKEND_NAMES = {"postgresql", "mysql", "mariadb", "sqlite"}


def modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        if "versions" in parts:  # Alembic revisions are frozen, not architecture
            continue
        yield ".".join(parts), path


def resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name a relative import refers to."""
    if level == 0:
        return target or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


def imports(module: str, path: Path, tree: ast.AST) -> Iterator[tuple[str, list[str], int]]:
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            target = resolve(module, is_package, node.level, node.module)
            yield target, [a.name for a in node.names], node.lineno


def check() -> list[str]:
    problems: list[str] = []
    mods = dict(modules())
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        rel = path.relative_to(ROOT)
        for target, names, line in imports(module, path, tree):
            for name in names:
                sub = f"{target}.{name}"
                if sub in mods:  # from . import _statements: a module, not a name
                    if sub != module:
                        graph[module].add(sub)
                    continue
                if target in mods and target != module:
                    graph[module].add(target)
                    if name.startswith("_") and not name.startswith("__"):
                        problems.append(f"{rel}:{line}: imports private name {name} of {target}")
            if not names and target in mods and target != module:
                graph[module].add(target)
        own = defined_here(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and node.attr not in PUBLIC_UNDERSCORE
                and node.attr not in own
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                and not is_super(node.value)
            ):
                problems.append(f"{rel}:{node.lineno}: reaches into private attribute {node.attr}")
        if module not in DIALECT_MODULES:
            problems += [f"{rel}:{line}: {what}" for line, what in dialect_names(tree)]
    problems += [f"import circle: {' -> '.join(c)}" for c in cycles(graph)]
    return problems


def defined_here(tree: ast.AST) -> set[str]:
    """Private names this module defines: functions, methods, classes, attributes it sets."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if n.startswith("_")}


def is_super(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def dialect_names(tree: ast.AST) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "get_backend_name":
            yield node.lineno, "reads a backend name (use _engine.url_family)"
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "name"
            and (
                (isinstance(node.value, ast.Attribute) and node.value.attr == "dialect")
                or (isinstance(node.value, ast.Name) and node.value.id == "dialect")
            )
        ):
            yield node.lineno, "reads dialect.name (use _engine.family or a strategy)"
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for operand in operands:
                literals: list[ast.expr] = [operand] if isinstance(operand, ast.Constant) else []
                if isinstance(operand, (ast.Tuple, ast.List, ast.Set)):
                    literals = list(operand.elts)
                for lit in literals:
                    if isinstance(lit, ast.Constant) and lit.value in BACKEND_NAMES:
                        yield node.lineno, f"compares with the backend name {lit.value!r}"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main() -> int:
    problems = check()
    for problem in problems:
        print(problem)
    if problems:
        print(f"{len(problems)} architecture problem(s)")
        return 1
    print("architecture: no import circle, no private name across modules, dialect names in place")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
