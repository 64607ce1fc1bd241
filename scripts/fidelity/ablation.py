"""The two ablations of issue 14 (CPU scale): one of dpfl's choices changed at a time
towards an independent loop's, for DP-Fed-LS and for the DP-FedAvg CNN."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from engine.config import load_config, replace
from engine.config.presets import read_preset
from scripts.fidelity import ROOT
from scripts.fidelity.text import lines
from scripts.fidelity.verdicts import mean_std

Variants = tuple[tuple[str, dict[str, Any]], ...]

#: DP-Fed-LS departures (digits, CPU scale of the DP-Fed-LS preset): each variant
#: changes one key from dpfl's default; "all four" is the plain loop's choices.
ABLATION: Variants = (
    ("dp_fed_ls (dpfl defaults)", {}),
    ("normalize=unit_interval", {"dataset.normalize": "unit_interval"}),
    ("init=zeros", {"model.init": "zeros"}),
    ("ls_local=clip_once", {"algo.ls_local": "clip_once"}),
    ("ls_scope=weights", {"algo.ls_scope": "weights"}),
    ("init=zeros + ls_local=clip_once", {"model.init": "zeros", "algo.ls_local": "clip_once"}),
    (
        "all four (plain loop's choices)",
        {
            "dataset.normalize": "unit_interval",
            "model.init": "zeros",
            "algo.ls_local": "clip_once",
            "algo.ls_scope": "weights",
        },
    ),
    ("dp_fedavg (dpfl defaults)", {"algorithm": "dp_fedavg"}),
    ("dp_fedavg, init=zeros", {"algorithm": "dp_fedavg", "model.init": "zeros"}),
    (
        "dp_fedavg, unit_interval + zeros",
        {"algorithm": "dp_fedavg", "dataset.normalize": "unit_interval", "model.init": "zeros"},
    ),
)

#: The MNIST CNN gap (dp_fedavg, z = 1): dpfl's per-channel standardisation and Poisson
#: cohorts against the plain loop's [0, 1] inputs and fixed cohorts. Fixed cohorts are
#: accounted under replace-one adjacency (a larger ε at the same z; shown).
CNN_ABLATION: Variants = (
    ("dp_fedavg (dpfl defaults)", {}),
    ("normalize=unit_interval", {"dataset.normalize": "unit_interval"}),
    ("fixed cohorts of 40", {"sampling.mode": "fixed", "sampling.cohort_size": 40}),
    (
        "unit_interval + fixed cohorts",
        {
            "dataset.normalize": "unit_interval",
            "sampling.mode": "fixed",
            "sampling.cohort_size": 40,
        },
    ),
)

#: name -> (preset stem, variants); each section's title is ``text/ablation_<name>.md``.
ABLATIONS: dict[str, tuple[str, Variants]] = {
    "dp_fed_ls": ("dp_fed_ls_mnist_logreg", ABLATION),
    "cnn": ("dp_fedavg_mnist_cnn", CNN_ABLATION),
}


def title(which: str) -> list[str]:
    return lines(f"ablation_{which}")


def ablation(
    which: str,
    seeds: list[int],
    epsilons: list[float] | None,
    out: Path,
    done: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """Run the variants of ``ABLATIONS[which]`` for every seed (and target ε, when the
    preset states its budget by ε; otherwise at the preset's own noise multiplier);
    runs already in ``done`` (same variant, ε and seed) are kept, not rerun."""
    from engine.simulation import simulate

    stem, variants = ABLATIONS[which]
    preset = read_preset(ROOT / "experiments" / f"{stem}.yaml")
    assert preset is not None
    algorithm = "dp_fed_ls" if which == "dp_fed_ls" else "dp_fedavg"
    base = load_config(None, [f"algorithm={algorithm}"], base=preset.tree("cpu"))
    rows = [] if done is None else done.to_dict("records")
    have = {(r["variant"], float(r["epsilon_target"]), int(r["seed"])) for r in rows}
    for e in epsilons or [None]:
        for name, change in variants:
            for s in seeds:
                if (name, float(e) if e else -1.0, s) in have:
                    continue
                budget = {"privacy.epsilon": e, "privacy.noise_multiplier": None} if e else {}
                cfg = replace(base, **{**budget, "seed": s, "out": None, **change})
                res = simulate(cfg, write=False, progress=False)
                rows.append(
                    {
                        "variant": name,
                        "epsilon_target": e if e else -1.0,
                        "seed": s,
                        "epsilon": res.final_epsilon,
                        "final_accuracy": res.final_accuracy,
                    }
                )
                print(f"  {which} ε={e} {name} seed={s}: {res.final_accuracy:.4f}", flush=True)
    frame = pd.DataFrame(rows)
    out.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(out / "ablation.parquet", index=False)
    return frame


def ablation_table(frame: pd.DataFrame, variants: Variants) -> list[str]:
    eps = sorted(frame["epsilon_target"].unique())
    base = variants[0][0]

    def label(e: float) -> str:
        return f"ε = {e:g}" if e > 0 else "at the preset's σ"

    head = (
        "| variant | "
        + " | ".join(label(e) for e in eps)
        + " | "
        + " | ".join(f"Δ vs defaults, {label(e)}" for e in eps)
        + " | accountant ε |"
    )
    out = [head, "|" + " --- |" * (2 * len(eps) + 2)]
    for name, _ in variants:
        cells, deltas = [], []
        for e in eps:
            col = frame[frame.epsilon_target == e]
            g = col[col.variant == name]["final_accuracy"]
            ref = col[col.variant == base]["final_accuracy"]
            cells.append(mean_std(g) if len(g) else "")
            deltas.append(f"{g.mean() - ref.mean():+.3f}" if len(g) and len(ref) else "")
        cells += deltas
        spent = frame[frame.variant == name].groupby("epsilon_target")["epsilon"].max()
        cells.append(", ".join(f"{spent[e]:.4g}" for e in eps if e in spent))
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out
