"""A griffe extension for the documentation site (``mkdocs.yml`` loads it for mkdocstrings).

The package's docstrings are reST-flavoured (``:param x:``, ``:class:`~a.B```, ``::`` blocks,
simple tables) and its fields are documented by ``#:`` comments. This turns each docstring into
Markdown with the same converter as ``scripts/gen_reference.py`` (one set of rules for both
references), and gives an attribute without a docstring the ``#:`` comment above it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

import griffe

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gen_reference import markdown


class ReSTDocstrings(griffe.Extension):
    """Docstrings as Markdown; ``#:`` comments as attribute docstrings."""

    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)

    def on_attribute_instance(
        self, *, node: Any, attr: griffe.Attribute, agent: Any, **kwargs: Any
    ) -> None:
        if attr.docstring is not None or not isinstance(node, ast.AST) or not attr.lineno:
            return
        lines = attr.module.lines
        comment: list[str] = []
        i = attr.lineno - 2
        while i >= 0 and lines[i].strip().startswith("#:"):
            comment.insert(0, lines[i].strip()[2:].strip())
            i -= 1
        if comment:
            attr.docstring = griffe.Docstring(
                markdown(" ".join(comment)), lineno=attr.lineno, parent=attr
            )
