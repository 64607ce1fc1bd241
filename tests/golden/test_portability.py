"""The golden test checks numbers, not one CPU's bits: rerun a few golden cases in a
fresh interpreter with float kernels switched to other code paths (ATen's generic
kernels instead of AVX2/AVX-512, oneDNN off and capped at SSE4.1:
``scripts/golden_portability.py``'s ``kernels`` setting), which is what another CPU does
to the arithmetic. The final models must differ bit for bit from the frozen weights
(the switch took effect: their SHA-256 changed) while every tolerance comparison of
``test_golden.py`` still passes. The whole sweep of settings and cases is the script's
(README, "Tests")."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CASES = ["recipe_dp_fedavg", "digits_cnn_dp_fedavg", "vectorized_groups_dp_fedsam"]


def _script():
    path = ROOT / "scripts" / "golden_portability.py"
    spec = importlib.util.spec_from_file_location("golden_portability", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("golden_portability", module)
    spec.loader.exec_module(module)
    return module


def _has_avx2() -> bool:
    try:
        return any(
            line.startswith("flags") and " avx2" in line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
        )
    except OSError:
        return False


def test_golden_cases_pass_to_tolerance_under_other_float_kernels() -> None:
    gp = _script()
    result = gp.run_setting("kernels", CASES, timeout=900)
    assert sorted(result) == sorted(CASES)
    for name, r in result.items():
        assert r["problems"] == [] and r["weights_problem"] is None, (name, r)
    if not _has_avx2():
        pytest.skip("this CPU has no AVX2: ATen's generic kernels may be its own path")
    changed = [n for n, r in result.items() if r["sha_differs"]]
    # the switch changed the arithmetic: otherwise passing would prove nothing
    assert sorted(changed) == sorted(CASES), result
