"""MkDocs hooks for the documentation site (``hooks:`` in ``mkdocs.yml``).

The pages mark code fences for ``tests/test_docs.py``: ```` ```python no-run ```` (a fragment
for reading) and ```` ```python needs=MODULE ```` (runs where that module is installed). Markdown
would not recognise such a line as a fence, so the site sees plain ```` ```python ````.
"""

from __future__ import annotations

import re
from typing import Any

FENCE_OPTIONS = re.compile(r"^(\s*```python)(?:[ \t]+(?:no-run|needs=\S+))+[ \t]*$", re.MULTILINE)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return FENCE_OPTIONS.sub(r"\1", markdown)
