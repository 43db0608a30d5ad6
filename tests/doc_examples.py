"""The Python examples of README.md and docs/*.md, so tests can run them as written."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def python_example(doc: str, containing: str) -> str:
    """The one ```python block of ``doc`` (a path from the repository root) that contains
    ``containing``."""
    blocks = [b for b in PYTHON_BLOCK.findall((ROOT / doc).read_text()) if containing in b]
    assert len(blocks) == 1, f"{doc}: {len(blocks)} python blocks contain {containing!r}"
    return blocks[0]
