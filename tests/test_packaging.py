"""Packaging: the built wheel, and the README's install command run verbatim, both give a
fresh environment where every package imports; ``.ci/run`` runs the README's commands."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (supported): the same parser, from the dev extra
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]


def _readme_block(section: str) -> list[str]:
    """The command lines of the first ```bash block under the README heading ``section``."""
    text = (ROOT / "README.md").read_text()
    start = text.index(f"\n## {section}\n")
    block = re.search(r"```bash\n(.*?)```", text[start:], re.S)
    assert block, f"no bash block under ## {section}"
    return [ln.strip() for ln in block.group(1).splitlines() if ln.strip()]


def _fresh_venv(venv: Path) -> Path:
    """A venv made by the interpreter running this test, seeing that interpreter's
    site-packages (torch, ray, ...) through a .pth file. (A --system-site-packages venv
    made from inside a venv would see the *base* Python's packages instead, which may
    lack torch.) Its own seeded setuptools is removed so the outer, tested one is used."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    new_site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    visible = [
        p
        for p in sys.path
        if p
        and Path(p).is_dir()
        and Path(p).name in ("site-packages", "dist-packages")
        and Path(p).resolve() != ROOT
    ]
    assert visible, sys.path
    (Path(new_site) / "outer_site.pth").write_text("\n".join(visible) + "\n")
    subprocess.run(
        [str(py), "-m", "pip", "uninstall", "-q", "-y", "setuptools"], capture_output=True
    )
    return py


def _import_every_package(py: Path, cwd: Path, prefix: Path) -> None:
    code = (
        "import importlib, sys\n"
        f"names = {PACKAGES!r}\n"
        "for n in names:\n"
        "    m = importlib.import_module(n)\n"
        f"    assert m.__file__.startswith({str(prefix)!r}), (n, m.__file__)\n"
        "from engine.cli import main\n"
        "print('ok', len(names))\n"
    )
    out = subprocess.run([str(py), "-c", code], cwd=cwd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"ok {len(PACKAGES)}"


@pytest.mark.slow
def test_wheel_installs_and_imports_every_package(tmp_path) -> None:
    # Every Python package directory in the source tree must be listed.
    on_disk = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in ROOT.glob("*/**/__init__.py")
        if p.parts[len(ROOT.parts)] in {"engine", "algorithms", "tuning", "cluster"}
    }
    assert on_disk <= set(PACKAGES), f"not packaged: {sorted(on_disk - set(PACKAGES))}"

    dist = tmp_path / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, (built.stdout + built.stderr)[-2000:]
    wheel = next(dist.glob("dpfl-*.whl"))
    venv = tmp_path / "venv"
    py = _fresh_venv(venv)
    subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], check=True)
    # The project itself must come from the wheel, not from the source tree.
    _import_every_package(py, tmp_path, venv)
    assert (venv / "bin" / "dpfl").is_file()


@pytest.mark.slow
def test_readme_install_command_in_fresh_venv(tmp_path) -> None:
    """The README's install line, verbatim, offline (PIP_NO_INDEX: every dependency and
    dev tool must already satisfy pyproject's bounds), then every package imports."""
    lines = _readme_block("Install")
    installs = [ln for ln in lines if " pip install " in f" {ln} "]
    assert len(installs) == 1, lines
    venv = tmp_path / "venv"
    py = _fresh_venv(venv)
    env = {
        **os.environ,
        "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "VIRTUAL_ENV": str(venv),
        "PIP_NO_INDEX": "1",
        "PIP_NO_BUILD_ISOLATION": "0",  # pip's spelling of "no isolation" (offline build)
    }
    argv = shlex.split(installs[0])
    assert argv[0] == "python"
    done = subprocess.run([str(py), *argv[1:]], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    _import_every_package(py, tmp_path, ROOT)  # editable: the packages are the source tree
    assert (venv / "bin" / "dpfl").is_file()


def test_ci_runs_the_readme_commands_in_a_fresh_venv() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [ln.strip() for ln in ci.splitlines() if ln.strip() and not ln.lstrip()[0] == "#"]
    setup = [ln for ln in _readme_block("Install") if "venv" not in ln]
    tests = _readme_block("Tests")
    assert setup and tests
    for line in setup:
        assert line in commands, f"README setup line not run by .ci/run: {line}"
    assert any(c.startswith(tests[0]) for c in commands), tests[0]
    # the fresh environment: removed, created, activated before the first README command
    first = min(commands.index(line) for line in setup)
    assert commands.index("rm -rf .ci-venv") < first
    assert any("-m venv .ci-venv" in c for c in commands[:first])
    assert ". .ci-venv/bin/activate" in commands[:first]
    assert ".ci-venv/" in (ROOT / ".gitignore").read_text().split()
