"""The documentation site builds with ``mkdocs build --strict`` (a broken link, a
missing page or an unresolvable API reference fails), and its generated reference
pages cover every command and every configuration key of the code."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def _text(html: Path) -> str:
    return re.sub(r"<[^>]+>", " ", html.read_text(encoding="utf-8"))


def test_cli_reference_has_every_command(site: Path) -> None:
    from engine.cli.parser import COMMANDS

    page = _text(site / "reference" / "cli" / "index.html")
    for command in COMMANDS:
        assert f"dpfl {command}" in page, command


def test_config_reference_has_every_key(site: Path) -> None:
    from engine.config.doc import config_keys

    page = _text(site / "reference" / "config" / "index.html")
    missing = [k for k in config_keys() if k not in page]
    assert missing == []


def test_api_reference_renders_the_docstrings(site: Path) -> None:
    page = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    for anchor in ("engine.simulate", "engine.load_config", "engine.calibrate_noise"):
        assert f'id="{anchor}"' in page, anchor
    # the docstring's text, not only the heading
    assert "smallest noise multiplier" in _text(site / "reference" / "api" / "index.html")
