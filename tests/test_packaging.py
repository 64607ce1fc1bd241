"""The built wheel installs into a fresh environment and every package imports from it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_installs_and_imports_every_package(tmp_path) -> None:
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"
    ]
    # Every Python package directory in the source tree must be listed.
    on_disk = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in ROOT.glob("*/**/__init__.py")
        if p.parts[len(ROOT.parts)] in {"engine", "algorithms", "tuning", "cluster"}
    }
    assert on_disk <= set(packages), f"not packaged: {sorted(on_disk - set(packages))}"

    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    wheel = next(dist.glob("dpfl-*.whl"))
    venv = tmp_path / "venv"
    # System site-packages provide the heavy dependencies (torch, ray); the project itself
    # must come from the wheel, which the check below verifies.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], check=True)
    code = (
        "import importlib, sys\n"
        f"names = {packages!r}\n"
        "for n in names:\n"
        "    m = importlib.import_module(n)\n"
        f"    assert m.__file__.startswith({str(venv)!r}), (n, m.__file__)\n"
        "from engine.cli import main\n"
        "print('ok', len(names))\n"
    )
    out = subprocess.run([str(py), "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"ok {len(packages)}"
    assert (venv / "bin" / "dpfl").is_file()
