"""Do the golden cases pass on another CPU? Rerun them under float-kernel settings that
change the bits, and measure how far each output drifts from the frozen one.

    python scripts/golden_portability.py                 # every case, every setting
    python scripts/golden_portability.py --settings aten_default --only recipe_dp_fedavg

The golden test (``tests/golden/test_golden.py``) compares a rerun with the frozen
outputs to stated tolerances (``tests/golden/golden_cases.py``: ``RTOL_WEIGHTS``,
``ATOL_WEIGHTS``, ``RTOL_COLUMNS``, ``RTOL_ACCOUNTING``), because float32 kernels round
differently on another CPU (oneDNN, MKL and ATen choose their code paths by vendor and
instruction set). Without a second CPU, the settings below choose other code paths on
this one; each runs the cases in a fresh interpreter. For each setting the script
prints how many final models differ bit for bit from the frozen weights (their SHA-256
differs: the setting did change the arithmetic), the largest drift of the weights and
of every float column, and whether the tolerance comparison passes. A setting that
changes no hash proves nothing; one that changes hashes while every comparison passes
shows that the test checks numbers, not one machine's bits.

Settings (``SETTINGS``): ATen's generic kernels instead of its AVX2/AVX-512 ones
(``ATEN_CPU_CAPABILITY=default``); MKL's SSE4.2 kernels for matrix products
(``MKL_ENABLE_INSTRUCTIONS=SSE4_2``); oneDNN off (``torch.backends.mkldnn.enabled``
False) with its ISA capped (``DNNL_MAX_CPU_ISA=SSE41``); two torch threads where the
cases ask for one (intra-op sums split differently); ATen's and oneDNN's switches
together (``kernels``, the suite's check); and all of these together.
The Ray case is skipped: it computes what ``recipe_dp_fedavg`` computes in process
(the golden test checks that its record equals that case's, bit for bit).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"

#: name -> (environment variables, in-process switches)
SETTINGS: dict[str, tuple[dict[str, str], dict[str, Any]]] = {
    "aten_default": ({"ATEN_CPU_CAPABILITY": "default"}, {}),
    "mkl_sse42": ({"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}, {}),
    "onednn_off": ({"DNNL_MAX_CPU_ISA": "SSE41"}, {"mkldnn": False}),
    "two_threads": ({}, {"threads": 2}),
    # the suite's check (tests/golden/test_portability.py): the kernel switches that
    # change this CPU's bits without the second thread, which is slow on a busy machine
    "kernels": (
        {"ATEN_CPU_CAPABILITY": "default", "DNNL_MAX_CPU_ISA": "SSE41"},
        {"mkldnn": False},
    ),
    "all": (
        {
            "ATEN_CPU_CAPABILITY": "default",
            "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
            "DNNL_MAX_CPU_ISA": "SSE41",
        },
        {"mkldnn": False, "threads": 2},
    ),
}


def load_cases() -> Any:
    spec = importlib.util.spec_from_file_location("golden_cases", GOLDEN / "golden_cases.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["golden_cases"] = module
    spec.loader.exec_module(module)
    return module


def _sha(weights: Any) -> str:
    import numpy as np

    flat = np.ascontiguousarray(np.asarray(weights).reshape(-1), dtype="<f8")
    return hashlib.sha256(flat.tobytes()).hexdigest()


def _apply_switches(switches: dict[str, Any]) -> None:
    import torch

    if switches.get("mkldnn") is False:
        torch.backends.mkldnn.enabled = False
    threads = switches.get("threads")
    if threads:
        # the engine sets each process's threads from its config (one per worker in
        # the golden cases): force another count whatever it asks for
        original = torch.set_num_threads

        def forced(_n: int) -> None:
            original(int(threads))

        torch.set_num_threads = forced  # type: ignore[assignment]
        original(int(threads))


def worker(setting: str, only: list[str]) -> dict[str, Any]:
    """Run the cases in this interpreter under ``setting``'s in-process switches (its
    environment was set by the parent) and compare each with the frozen outputs."""
    import warnings

    import numpy as np

    warnings.filterwarnings("ignore")
    os.environ["DPFL_CACHE_DIR"] = "off"
    _apply_switches(SETTINGS[setting][1])
    gc = load_cases()
    golden = json.loads((GOLDEN / "golden.json").read_text())["cases"]
    frozen_weights = np.load(GOLDEN / "golden_weights.npz")
    out: dict[str, Any] = {}
    for case in gc.CASES:
        if case.kind == "ray" or (only and case.name not in only):
            continue
        rec, weights = gc.split_weights(gc.run_case(case, golden[case.name]["overrides"]))
        expected = frozen_weights[case.name]
        out[case.name] = {
            "sha_differs": _sha(weights) != _sha(expected),
            "weights": gc.weights_drift(expected, weights),
            "weights_problem": gc.weights_close(expected, weights),
            "columns": {c: v for c, v in gc.column_drift(golden[case.name], rec).items() if v},
            "problems": gc.tolerance_differences(golden[case.name], rec),
        }
    return out


def run_setting(setting: str, only: list[str], timeout: float = 1800) -> dict[str, Any]:
    """:func:`worker` in a fresh interpreter with ``setting``'s environment."""
    env = {**os.environ, **SETTINGS[setting][0], "RAY_USAGE_STATS_ENABLED": "0"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", setting]
    if only:
        cmd += ["--only", ",".join(only)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"setting {setting} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarise(setting: str, result: dict[str, Any]) -> dict[str, Any]:
    columns: dict[str, float] = {}
    for r in result.values():
        for c, v in r["columns"].items():
            columns[c] = max(columns.get(c, 0.0), v)
    return {
        "setting": setting,
        "cases": len(result),
        "hashes_changed": sum(r["sha_differs"] for r in result.values()),
        "weights_max_rel": max((r["weights"]["max_rel"] for r in result.values()), default=0),
        "weights_max_abs": max((r["weights"]["max_abs"] for r in result.values()), default=0),
        "weights_worst_vs_bound": max(
            (r["weights"]["worst_vs_bound"] for r in result.values()), default=0
        ),
        "columns_max_rel": dict(sorted(columns.items())),
        "failures": {
            n: [*r["problems"], *([r["weights_problem"]] if r["weights_problem"] else [])]
            for n, r in result.items()
            if r["problems"] or r["weights_problem"]
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated")
    parser.add_argument("--only", default="", help="comma-separated case names")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help="also write the summaries here")
    args = parser.parse_args(argv)
    only = [n for n in args.only.split(",") if n]
    if args.worker is not None:
        print(json.dumps(worker(args.worker, only)))
        return 0
    summaries, failed = [], False
    for setting in [s for s in args.settings.split(",") if s]:
        if setting not in SETTINGS:
            parser.error(f"--settings: unknown setting {setting!r} (known: {', '.join(SETTINGS)})")
        t0 = time.perf_counter()
        s = summarise(setting, run_setting(setting, only))
        summaries.append(s)
        failed |= bool(s["failures"])
        cols = ", ".join(f"{c} {v:.1e}" for c, v in s["columns_max_rel"].items())
        print(
            f"{setting:13s} {s['hashes_changed']:2d}/{s['cases']} hashes changed; weights max "
            f"rel {s['weights_max_rel']:.1e}, max abs {s['weights_max_abs']:.1e} "
            f"({s['weights_worst_vs_bound']:.3f} of the bound); columns: {cols or 'equal'}; "
            f"{'FAIL ' + json.dumps(s['failures']) if s['failures'] else 'tolerance test passes'}"
            f" ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(summaries, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
