"""Write ``tests/golden/golden.json``: the exact outputs of the golden cases.

How ``golden.json`` was generated: first from a pristine checkout of commit 1f4e86f (the
code before the refactor of issue 27 and the performance work of issue 26); then, once,
on purpose, from a pristine checkout of the code that moved the mechanism's noise to
block streams (``engine.privacy.rng.SeededStream``, docs/architecture.md "Noise
streams"): commit 3d6e454, whose tree is the commit that holds this file's version of
``golden.json`` except for that file. That change altered only the noise-dependent
columns of the 25 private cases (accuracies, losses, update norms, clip counts, C_t
under adaptive clipping, the audit's estimate); the two non-private cases and every
ε stayed equal. Never from a working tree that others were editing; on the CPU, in
the project's virtual environment (``golden.json``'s ``environment`` records the
versions), on a 2-core x86-64 machine::

    git worktree add /tmp/golden_base 3d6e454
    cd /tmp/golden_base
    PYTHONPATH=/tmp/golden_base python /work/main/tests/golden/generate.py \\
        --out /work/main/tests/golden/golden.json --expect-base /tmp/golden_base
    git worktree remove /tmp/golden_base

The script prints ``engine.__file__`` (and checks it lies under ``--expect-base``, also
in the Ray workers), so the code measured is the checkout's. It was run twice; the two
files were identical byte for byte. ``--check-pins`` also runs every case without its
pinned keys and checks the record is the same, proving that the pins are the defaults of
the code that generated the file; it passed at 1f4e86f, and fails by design since
issue 28 changed two defaults (the pins keep the cases on their 1f4e86f settings).

``golden_weights.npz`` (every case's final weights, float32, which the test compares to
tolerance) and ``golden_weights.json`` (its provenance: commit, CPU, this machine's
hashes next to ``golden.json``'s, the columns' drift) were written with
``--weights-only`` from the same pristine checkout of 3d6e454, on a 2-core AMD EPYC
(AVX2): its records differ from ``golden.json``'s (frozen on another CPU) only within the
test's tolerances, which that option checks before writing::

    PYTHONPATH=/tmp/golden_base python /work/main/tests/golden/generate.py \\
        --out /work/main/tests/golden/golden.json --expect-base /tmp/golden_base \\
        --weights-only

Regenerate only when a change is *meant* to alter results (a new default, a bug fix that
changes the numbers), from the commit that makes that change, and say so in its commit
message; a refactor or a performance change must pass ``test_golden.py`` unchanged.
The case list is :mod:`golden_cases` (beside this file).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def load_cases() -> Any:
    spec = importlib.util.spec_from_file_location("golden_cases", HERE / "golden_cases.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["golden_cases"] = module
    spec.loader.exec_module(module)
    return module


def _start_ray(expect_base: str | None) -> Any:
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=2,
            num_gpus=0,
            include_dashboard=False,
            object_store_memory=100 * 2**20,
            configure_logging=False,
            log_to_driver=False,
        )

    @ray.remote(num_cpus=1)
    def where() -> str:
        import engine

        return str(engine.__file__)

    path = ray.get(where.remote())
    print(f"engine in a Ray worker: {path}", flush=True)
    if expect_base is not None and not path.startswith(expect_base):
        raise SystemExit(f"a Ray worker imports {path}, not the code under {expect_base}")
    return ray


def _commit(path: Path) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(path), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def dump(obj: Any, depth: int = 0) -> str:
    """JSON with one key per line down to a column, each value list on one line."""
    if not isinstance(obj, dict) or depth >= 4 or not obj:
        return json.dumps(obj, sort_keys=True)
    pad = " " * (depth + 1)
    items = [f"{pad}{json.dumps(k)}: {dump(obj[k], depth + 1)}" for k in sorted(obj)]
    return "{\n" + ",\n".join(items) + "\n" + " " * depth + "}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "golden.json"))
    parser.add_argument("--only", default="", help="comma-separated case names (debugging)")
    parser.add_argument(
        "--check-pins",
        action="store_true",
        help="also run each case without its pinned keys and require the same record",
    )
    parser.add_argument(
        "--weights-only",
        action="store_true",
        help="write only golden_weights.npz and golden_weights.json beside --out, after "
        "checking every case's record against --out's to tolerance",
    )
    parser.add_argument(
        "--expect-base",
        default=None,
        help="fail unless engine (and Ray workers' engine) is imported from under this path",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ["DPFL_CACHE_DIR"] = "off"  # calibrate from scratch, remember nothing
    import numpy
    import pandas
    import torch

    import engine

    print(f"engine: {engine.__file__}", flush=True)
    if args.expect_base is not None and not engine.__file__.startswith(args.expect_base):
        raise SystemExit(f"engine is imported from {engine.__file__}, not {args.expect_base}")
    gc = load_cases()
    only = {n for n in args.only.split(",") if n}
    cases = [c for c in gc.CASES if not only or c.name in only]
    ray = None
    records: dict[str, Any] = {}
    weights_by_case: dict[str, Any] = {}
    t_all = time.perf_counter()
    try:
        for case in cases:
            if case.kind == "ray" and ray is None:
                ray = _start_ray(args.expect_base)
            t0, c0 = time.perf_counter(), time.process_time()
            rec, weights = gc.split_weights(gc.run_case(case))
            weights_by_case[case.name] = weights
            took, cpu = time.perf_counter() - t0, time.process_time() - c0
            if args.check_pins:
                unpinned, _ = gc.split_weights(
                    gc.run_case(case, [f"algorithm={case.algorithm}", *case.settings])
                )
                diff = gc.first_difference(rec, unpinned)
                if diff is not None:
                    raise SystemExit(f"{case.name}: a pin is not today's default: {diff}")
            records[case.name] = {
                "algorithm": case.algorithm,
                "kind": case.kind,
                "interrupt_after": case.interrupt_after,
                "marks": list(case.marks),
                "pins": list(case.pins),
                "settings": list(case.settings),
                "overrides": case.overrides,
                **rec,
            }
            print(
                f"{case.name:36s} {took:6.2f} s (cpu {cpu:5.2f} s)  "
                f"sha256 {rec['params_sha256'][:16]}  eps {rec['final_epsilon']}  "
                f"load {os.getloadavg()[0]:.2f}",
                flush=True,
            )
    finally:
        if ray is not None:
            ray.shutdown()
    base = Path(engine.__file__).resolve().parent.parent
    if args.weights_only:
        return _write_weights(gc, Path(args.out), records, weights_by_case, _commit(base))
    payload = {
        "generated_from_commit": _commit(base),
        "generated_by": "tests/golden/generate.py",
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numpy": numpy.__version__,
            "pandas": pandas.__version__,
            "machine": platform.machine(),
        },
        "excluded_columns": list(gc.EXCLUDED_COLUMNS),
        "params_hash": "sha256 of SimulationResult.weights flattened, as little-endian float64",
        "cases": records,
    }
    text = dump(payload) + "\n"
    Path(args.out).write_text(text)
    print(
        f"wrote {args.out}: {len(records)} cases in {time.perf_counter() - t_all:.1f} s, "
        f"load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    return 0


def _cpu() -> dict[str, Any]:
    """The CPU's model name and the vector extensions its float kernels can use."""
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = sorted(f for f in flags if f.startswith(("avx", "fma", "amx")))
    return {"model": model, "isa": isa}


def _write_weights(
    gc: Any, out: Path, records: dict[str, Any], weights: dict[str, Any], commit: str
) -> int:
    """Write the cases' final weights (``golden_weights.npz``, float32) and where they
    came from (``golden_weights.json``), after checking each case's record against the
    frozen one in ``out`` to the test's tolerances: the weights are frozen only beside
    columns that agree with ``golden.json``."""
    import numpy
    import torch

    frozen = json.loads(out.read_text())["cases"]
    bad = {n: gc.tolerance_differences(frozen[n], r) for n, r in records.items()}
    bad = {n: d for n, d in bad.items() if d}
    if bad:
        raise SystemExit(f"records differ from {out} beyond tolerance: {bad}")
    drift: dict[str, float] = {}
    for n, r in records.items():
        for c, v in gc.column_drift(frozen[n], r).items():
            drift[c] = max(drift.get(c, 0.0), v)
    npz = out.with_name("golden_weights.npz")
    numpy.savez_compressed(npz, **weights)
    manifest = {
        "generated_from_commit": commit,
        "generated_by": "tests/golden/generate.py --weights-only",
        "cpu": _cpu(),
        "torch": torch.__version__,
        "sha256_here": {n: r["params_sha256"] for n, r in sorted(records.items())},
        "sha256_in_golden_json": {n: frozen[n]["params_sha256"] for n in sorted(records)},
        "column_drift_vs_golden_json": {c: v for c, v in sorted(drift.items()) if v > 0},
    }
    npz.with_suffix(".json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(f"wrote {npz} and its manifest: {len(weights)} cases", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
