"""Shared fixtures: small configs and one local Ray instance per session (per xdist
worker), and the rule that timed runs (``-m benchmark``, ``-m gpu``) run serially."""

from __future__ import annotations

import os

import pytest
from _pytest.mark.expression import Expression  # pytest's -m parser (pytest 8 and 9)

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

#: Marks of tests that time themselves or hold the one GPU.
_TIMED_MARKS = ("benchmark", "gpu")


def selects_timed_tests(markexpr: str) -> bool:
    """True when ``-m markexpr`` selects benchmark or GPU tests: they measure time or
    hold one GPU, so two workers running them at once would skew each other.

    The expression is read by pytest's own parser and evaluated for a test that carries
    one timed mark and no other, so ``not (gpu)`` or ``not gpu`` (which keep the
    benchmarks) count as timed, ``not gpu and not benchmark`` does not. No ``-m`` at all
    is not a timed selection: a developer's ``pytest tests/x.py`` keeps two workers. A
    malformed expression is left to pytest, which names it in its usage error.
    """
    if not markexpr.strip():
        return False
    try:
        expression = Expression.compile(markexpr)
    except Exception:  # pytest 9: SyntaxError, pytest 8: ParseError
        return False  # pytest itself then reports the bad expression as a usage error
    return any(
        expression.evaluate(lambda name, mark=mark, **_: name == mark) for mark in _TIMED_MARKS
    )


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """``addopts`` runs the suite in two xdist workers; a timed selection runs in one
    process instead (before xdist reads ``-n``)."""
    if selects_timed_tests(config.option.markexpr or "") and hasattr(config.option, "numprocesses"):
        config.option.numprocesses = 0


SMALL = [
    "dataset.num_clients=40",
    "dataset.synthetic_mean_samples=20",
    "dataset.synthetic_dim=12",
    "sampling.rate=0.25",
    "rounds=3",
    "eval.every=1",
    "ray.executor=local",
    "local.epochs=1",
    "local.batch_size=8",
]

#: Smaller still, for tests that run every recipe (two rounds, C = 0.5).
TINY = [
    "dataset.num_clients=30",
    "dataset.synthetic_mean_samples=16",
    "dataset.synthetic_dim=10",
    "sampling.rate=0.3",
    "rounds=2",
    "eval.every=1",
    "ray.executor=local",
    "local.epochs=1",
    "local.batch_size=8",
    "privacy.clip_norm=0.5",
]


@pytest.fixture(scope="session", autouse=True)
def calibration_store_in_tmp(tmp_path_factory):
    """Noise calibrations remembered by the suite go to a temporary folder, not the
    user's ~/.cache (subprocesses and Ray workers inherit the variable)."""
    before = os.environ.get("DPFL_CACHE_DIR")
    os.environ["DPFL_CACHE_DIR"] = str(tmp_path_factory.mktemp("dpfl-cache"))
    yield
    if before is None:
        os.environ.pop("DPFL_CACHE_DIR", None)
    else:
        os.environ["DPFL_CACHE_DIR"] = before


@pytest.fixture
def small_overrides() -> list[str]:
    return list(SMALL)


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray with explicit small resources (2 CPUs, 1 fake GPU), shut down after."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=2,
            num_gpus=1,
            include_dashboard=False,
            object_store_memory=100 * 2**20,
            configure_logging=False,
            log_to_driver=False,
        )
    yield ray
    ray.shutdown()
