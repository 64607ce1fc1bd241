"""The page's prose, kept as files in ``text/`` (Markdown, or YAML for the per-preset
notes) rather than in Python constants; ``$name`` fields are filled by
:func:`string.Template`."""

from __future__ import annotations

import functools
from pathlib import Path
from string import Template
from typing import Any

import yaml

TEXT = Path(__file__).resolve().parent / "text"


def lines(name: str, **fields: Any) -> list[str]:
    """The lines of ``text/<name>.md`` (trailing newline dropped), fields filled."""
    body = (TEXT / f"{name}.md").read_text(encoding="utf-8")
    if fields:
        body = Template(body).substitute(fields)
    return body.rstrip("\n").split("\n")


@functools.cache
def mapping(name: str) -> dict[str, str]:
    """``text/<name>.yaml``: preset stem → text."""
    return dict(yaml.safe_load((TEXT / f"{name}.yaml").read_text(encoding="utf-8")) or {})
