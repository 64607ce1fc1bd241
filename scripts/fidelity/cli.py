"""``python -m scripts.fidelity``: the command line (the CPU scale and its ablations,
or ``--scale real``), which runs or reuses the presets and rewrites docs/fidelity.md."""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import pandas as pd

from engine.config.presets import read_preset
from scripts.fidelity import ROOT
from scripts.fidelity.ablation import ABLATIONS, ablation
from scripts.fidelity.page import (
    OLD_REAL_HEADINGS,
    REAL_HEADING,
    real_row,
    real_section,
    render,
    section_of,
    splice_section,
)
from scripts.fidelity.runs import REAL_OUT_NAME, run_preset, run_real
from scripts.fidelity.text import mapping
from scripts.fidelity.verdicts import cpu_verdicts, numbers, verdict


def main_real(args: argparse.Namespace) -> int:
    """``--scale real``: run (or reuse) each preset's real scale, rewrite its section."""
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out) if args.out != "results/fidelity" else ROOT.joinpath(*REAL_OUT_NAME)
    doc = Path(args.doc)
    page = doc.read_text() if doc.is_file() else ""
    cpu = cpu_verdicts(page)
    only = args.only.split(",") if args.only else None
    done, skipped = [], []
    for path in sorted((ROOT / "experiments").glob("*.yaml")):
        preset = read_preset(path)
        if preset is None:
            continue
        if "better" not in (preset.meta.get("verdict") or {}):
            skipped.append((preset, "no better/than claim to test (a reference number)"))
            continue
        if "real" not in preset.scales:
            why = mapping("no_real").get(path.stem, "no real: tree")
            skipped.append((preset, f"not run: {why}"))
            continue
        folder = out / path.stem
        saved = (folder / "claim.json").is_file()
        if only is not None and path.stem not in only:
            if saved:
                rows, meta = run_real(preset, seeds, folder)
                done.append((preset, rows, meta))
            else:
                skipped.append((preset, "not run this stop (time)"))
            continue
        print(f"{path.name}: real scale, seeds {seeds}", flush=True)
        rows, meta = run_real(preset, seeds, folder)
        done.append((preset, rows, meta))
        print(f"  {real_row(preset, rows, meta, cpu.get(path.stem, '—'))[0]}", flush=True)
    section = real_section(done, skipped, cpu, seeds)
    doc.write_text(splice_section(page, REAL_HEADING, section, OLD_REAL_HEADINGS))
    print(f"wrote {doc}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m scripts.fidelity", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", default="results/fidelity", help="run folders (replaced)")
    ap.add_argument("--doc", default=str(ROOT / "docs" / "fidelity.md"))
    ap.add_argument("--ablation", action="store_true", help="also run the DP-Fed-LS ablation")
    ap.add_argument("--ablation-epsilons", default="1,6")
    ap.add_argument("--only", help="comma-separated preset file stems (default: all)")
    ap.add_argument(
        "--scale",
        choices=("cpu", "real"),
        default="cpu",
        help="real: Fashion-MNIST at the papers' client counts (issue 28 item 4); rewrites "
        "only the page's real-scale section, reusing saved claims (--out default "
        "results/fidelity_real)",
    )
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="re-render from the runs already in --out (compare.parquet, ablation.parquet)",
    )
    args = ap.parse_args(argv)
    if args.scale == "real":
        return main_real(args)
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    if out.exists() and not args.reuse:
        shutil.rmtree(out)
    t0 = time.perf_counter()
    results = []
    for path in sorted((ROOT / "experiments").glob("*.yaml")):
        if args.only and path.stem not in args.only.split(","):
            continue
        preset = read_preset(path)
        if preset is None:
            continue
        print(f"{path.name}: cpu scale, seeds {seeds}", flush=True)
        saved = out / path.stem / "compare.parquet"
        if args.reuse and saved.is_file():
            rows = pd.read_parquet(saved)
        else:
            rows = run_preset(preset, "cpu", seeds, out / path.stem)
        results.append((preset, numbers(rows, preset), verdict(preset, rows)))
        print(f"  {results[-1][1]} -> {results[-1][2]}", flush=True)
    abl: dict[str, pd.DataFrame] = {}
    if args.ablation:
        for which in ABLATIONS:
            eps = [float(e) for e in args.ablation_epsilons.split(",")]
            eps_or_none = eps if which == "dp_fed_ls" else None
            folder = out / "ablation" if which == "dp_fed_ls" else out / f"ablation_{which}"
            saved = folder / "ablation.parquet"
            done = pd.read_parquet(saved) if args.reuse and saved.is_file() else None
            abl[which] = ablation(which, seeds, eps_or_none, folder, done)
    minutes = (time.perf_counter() - t0) / 60
    meta = f"Seeds {args.seeds}; this regeneration took {minutes:.1f} min on the CPU."
    if args.reuse:
        meta = f"Seeds {args.seeds}; saved runs reused, missing ones run (`--reuse`)."
    Path(args.doc).parent.mkdir(parents=True, exist_ok=True)
    page = render(results, abl, meta)
    old = Path(args.doc).read_text() if Path(args.doc).is_file() else ""
    kept = section_of(old, REAL_HEADING, OLD_REAL_HEADINGS)  # --scale real's section
    if kept is not None:
        page = splice_section(page, REAL_HEADING, kept)
    Path(args.doc).write_text(page)
    print(f"wrote {args.doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
