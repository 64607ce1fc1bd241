"""Running the presets with ``dpfl compare``'s code: the CPU scale of every preset, and
the real scale (Fashion-MNIST at the papers' client counts, rounds cut for the CPU;
each YAML's ``real:`` tree), whose saved claims are reused and interrupted ones
continued."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pandas as pd

from engine.config import load_config, merge_trees
from engine.config.presets import Preset
from engine.simulation import compare as cmp

#: Where ``--scale real`` keeps its run folders (never deleted; saved claims are reused).
REAL_OUT_NAME = ("results", "fidelity_real")


def run_preset(preset: Preset, scale: str, seeds: list[int], out: Path) -> pd.DataFrame:
    config = load_config(None, [], base=preset.tree(scale))
    runs = cmp.plan(
        config,
        list(preset.algorithms),
        out,
        seeds,
        list(preset.scale_epsilons(scale)),
        preset.variants,
    )
    cmp.validate(runs)
    out.mkdir(parents=True, exist_ok=True)
    return cmp.run(runs, out, progress=False)


def real_tree(preset: Preset) -> dict[str, Any]:
    """The real scale's config diff, without its own ``variants`` (see
    :func:`real_variants`)."""
    tree = preset.tree("real")
    tree.pop("variants", None)
    return tree


def real_variants(preset: Preset) -> dict[str, dict[str, Any]]:
    """The preset's variants with the real tree's ``variants`` merged over them: a
    row's setting that only the real scale changes (e.g. ``fedavg_mnist_cnn``'s
    learning rates, chosen again on Fashion-MNIST) stays inside the ``real:`` tree."""
    own = preset.scales.get("real", {}).get("variants") or {}
    unknown = [row for row in own if row not in preset.variants]
    if unknown:
        raise ValueError(f"{preset.path}: real.variants {unknown} are not preset.variants")
    return {
        row: merge_trees(json.loads(json.dumps(diff)), own.get(row, {}))
        for row, diff in preset.variants.items()
    }


def setting_summary(preset: Preset) -> str:
    """The real scale's setting in one line, read from the loaded config."""
    c = load_config(None, [], base=real_tree(preset))
    d = c.dataset
    part = f"Dirichlet({d.alpha:g})" if d.partition == "dirichlet" else d.partition.upper()

    def local(loc: Any) -> str:
        work = f"{loc.steps} steps" if getattr(loc, "steps", None) else f"E = {loc.epochs}"
        return f"{work}, B = {loc.batch_size}, lr {loc.lr:g}"

    planned = cmp.plan(c, real_rows(preset), Path("unused"), None, [], real_variants(preset))
    works = {label: local(rc.local) for label, rc in planned}
    if len(set(works.values())) == 1:
        work = next(iter(works.values()))
    else:  # rows with their own local settings (variants, e.g. FedSGD against FedAvg)
        work = "; ".join(f"{label}: {w}" for label, w in works.items())
    eps = preset.scale_epsilons("real")
    if eps:
        budget = "ε targets " + ", ".join(f"{e:g}" for e in eps)
    elif c.privacy.noise_multiplier:
        budget = f"σ = {c.privacy.noise_multiplier:g}"
    else:
        budget = "rows not private"
    return (
        f"{d.name}, {d.num_clients} {part} clients, q = {c.sampling.rate:g}, {c.model.name}, "
        f"{work}, T = {c.rounds}, {budget}"
    )


def real_rows(preset: Preset) -> list[str]:
    """The rows the real scale runs: only the claim's two (baseline, claimed-better);
    a table's other rows (e.g. fedsmp_topk beside fedsmp_randk) cost time and decide
    nothing."""
    rule = preset.meta.get("verdict") or {}
    if "better" in rule:
        return [str(rule["than"]), str(rule["better"])]
    return list(preset.algorithms)


def randomness_of(folder: Path) -> list[str]:
    """The ``privacy.randomness`` labels that the run folders' config.json record."""
    found = set()
    for cfg in folder.rglob("config.json"):
        found.add(str(json.loads(cfg.read_text()).get("privacy", {}).get("randomness")))
    return sorted(found)


def run_real(preset: Preset, seeds: list[int], out: Path) -> tuple[pd.DataFrame, dict[str, Any]]:
    """The real scale of ``preset`` for ``seeds``; a claim saved in ``out`` with all the
    seeds is read back, an interrupted one continues (finished run folders are kept)."""
    saved, meta_path = out / "compare.parquet", out / "claim.json"
    if saved.is_file() and meta_path.is_file():
        rows, meta = pd.read_parquet(saved), json.loads(meta_path.read_text())
        if set(seeds) <= set(int(s) for s in rows["seed"]):
            meta["randomness"] = randomness_of(out)  # what the run folders record
            return rows[rows["seed"].isin(seeds)], meta
    config = load_config(None, [], base=real_tree(preset))
    runs = cmp.plan(
        config,
        real_rows(preset),
        out,
        seeds,
        list(preset.scale_epsilons("real")),
        real_variants(preset),
    )
    cmp.validate(runs)
    out.mkdir(parents=True, exist_ok=True)
    started = any(Path(str(c.out)).exists() for _, c in runs)
    done = cmp.check_resume(runs, out) if started else None
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    rows = cmp.run(runs, out, progress=False, done=done)
    wall = time.perf_counter() - t0
    meta = {
        "seeds": seeds,
        "runs": len(runs),
        "wall_s": wall,
        "resumed": bool(done),
        "load_start": load0,
        "load_end": os.getloadavg()[0],
        "finished_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "randomness": randomness_of(out),
    }
    meta_path.write_text(json.dumps(meta, indent=1))
    return rows, meta
