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


# --- the hand-written pages -------------------------------------------------------------

DOCS = ROOT / "docs"
README = ROOT / "README.md"


def _pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if "results" not in p.parts)


def _notebook_sources(kind: str) -> list[str]:
    import json

    out = []
    for path in sorted(DOCS.rglob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        out += ["".join(c["source"]) for c in cells if c["cell_type"] == kind]
    return out


def documented_commands() -> list[tuple[str, str]]:
    """(page, command) for every ``dpfl`` command line in the pages' ``bash`` blocks and
    the notebooks' ``!dpfl`` lines, line continuations joined, environment prefixes and
    redirections dropped."""
    found = []
    blocks = [
        (str(p.relative_to(ROOT)), m.group(1))
        for p in [README, *_pages()]
        for m in re.finditer(r"```bash\n(.*?)```", p.read_text(encoding="utf-8"), re.S)
    ]
    blocks += [("notebook", src) for src in _notebook_sources("code")]
    for page, block in blocks:
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.strip().lstrip("!")
            words = line.split()
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words.pop(0)  # RAY_AUTH_MODE=token dpfl ...
            if words[:1] == ["dpfl"]:
                found.append((page, " ".join(words)))
    return found


def _check_command(command: str) -> None:
    """Parse ``command`` with dpfl's parser and, for commands that run, build the
    configuration it would run (unknown keys, bad values and bad algorithm names fail).
    A ``--config`` file that is not in the repository is the reader's own: parsed only."""
    import contextlib
    import io
    import shlex

    from engine.cli.parser import build_parser
    from engine.config import load_config
    from engine.simulation.compare import parse_algorithms

    argv = shlex.split(command, comments=True)
    argv = argv[: next((i for i, a in enumerate(argv) if a in (">", "|", "&&")), len(argv))]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            ns = build_parser().parse_args(argv[1:])
    except SystemExit:
        raise AssertionError(f"{command}: {err.getvalue().strip()}") from None
    if ns.command == "submit":
        from engine.cli.submit import prepare_entrypoint

        prepare_entrypoint(ns.entrypoint, ROOT)
        return
    config = getattr(ns, "config", None)
    if config is not None and not (ROOT / config).is_file():
        return
    path = str(ROOT / config) if config else None
    if ns.command in ("run", "config") and not getattr(ns, "resume", False):
        load_config(path, ns.set)
    elif ns.command == "compare":
        from engine.config.presets import read_preset

        preset = read_preset(path) if path else None
        if preset is not None:
            parse_algorithms(ns.algorithms or ",".join(preset.algorithms), preset.variants)
            load_config(base=preset.tree(ns.scale or "paper"), overrides=ns.set)
        else:
            parse_algorithms(ns.algorithms or "all")
            load_config(path, ns.set)
    elif ns.command == "tune":
        from tuning.plan import read_tune_file

        parse_algorithms(ns.algorithms)
        tree, _ = read_tune_file(path)
        load_config(base=tree, overrides=ns.set)


def test_every_documented_command_is_valid() -> None:
    """Each ``dpfl`` command the pages show is accepted by the parser and its
    configuration builds: a renamed flag or key fails here, not in a reader's shell."""
    commands = documented_commands()
    assert len(commands) >= 30, len(commands)
    for page, command in commands:
        try:
            _check_command(command)
        except Exception as e:  # noqa: BLE001 - name the page and the command
            raise AssertionError(f"{page}: {command}: {e}") from e


def test_a_bad_documented_command_would_fail() -> None:
    """The check above can fail: a misspelt key and an unknown flag are caught."""
    for bad in ("dpfl run --set privacy.epsilonn=4", "dpfl compare --budgets 4"):
        with pytest.raises(Exception):  # noqa: B017 - ConfigError or AssertionError
            _check_command(bad)


def test_user_pages_carry_no_development_history() -> None:
    """The pages a user reads name no issue numbers and no "before/after" history."""
    pattern = re.compile(r"\bissues? \d+|#\d{2,}\b|\bmeasured before\b|\bsince issue\b", re.I)
    texts = [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8")) for p in [README, *_pages()]]
    texts += [("notebook", src) for src in _notebook_sources("markdown")]
    hits = [(page, m.group(0)) for page, text in texts for m in pattern.finditer(text)]
    assert hits == []


def test_the_notebook_renders_with_its_figures(site: Path) -> None:
    page = (site / "tutorials" / "tune-and-analyse" / "index.html").read_text(encoding="utf-8")
    assert page.count("data:image/png;base64,") >= 3
    assert "epsilon_with_tuning" in page  # the outputs, not only the code


def test_the_column_reference_is_on_the_site(site: Path) -> None:
    page = _text(site / "reference" / "columns" / "index.html")
    for column in ("test_accuracy", "epsilon", "realised_cohort_size_nonprivate"):
        assert column in page


def test_readme_is_a_short_manual() -> None:
    """The README stays the user's manual in brief (at most 300 lines) and links into
    the site for the rest; every page it links to exists."""
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert len(links) >= 20
    assert [link for link in links if not (ROOT / link).exists()] == []
