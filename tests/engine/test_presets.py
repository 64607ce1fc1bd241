"""Paper presets (experiments/*.yaml) and dpfl compare over a list of epsilons."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd
import pytest

from engine.cli import main
from engine.config import ConfigError, load_config
from engine.config.presets import read_preset
from engine.privacy.accounting import compute_epsilon

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted((ROOT / "experiments").glob("*.yaml"))


def test_there_is_a_preset_per_seed_table() -> None:
    names = {p.stem for p in PRESETS}
    assert {"dp_fed_ls_mnist_logreg", "dp_fedavg_mnist_cnn", "dp_fedsam_noniid"} <= names


def test_every_paper_has_a_preset_with_a_checkable_verdict() -> None:
    """Every recipe's paper (by its reference key) is the subject of a preset (FedAvg's
    through variants of one recipe: its claim compares local-step settings); every
    verdict rule names rows of its own table and columns that compare writes."""
    from algorithms.catalog import CATALOG, PAPERS
    from engine.simulation.compare import METRICS

    covered: set[str] = set()
    for path in PRESETS:
        preset = read_preset(path)
        assert preset is not None
        rule = preset.meta["verdict"]
        if "better" in rule:
            assert {rule["better"], rule["than"]} <= set(preset.algorithms), path.stem
            for algorithm, column in (rule.get("metric") or {}).items():
                assert algorithm in preset.algorithms and column in METRICS, path.stem
            covered |= set(CATALOG[preset.recipe(rule["better"])].papers)
        else:
            covered |= {p for a in preset.algorithms for p in CATALOG[preset.recipe(a)].papers}
    assert set(PAPERS) - covered == set()


def test_fedavg_preset_rows_are_one_recipe_with_the_papers_local_work(tmp_path) -> None:
    """FedSGD and FedAvg(E = 5, B = 10) are rows of one recipe: each row's config
    differs from the scale's only by its variant's keys, and runs in its own folder."""
    from engine.simulation.compare import plan

    preset = read_preset(ROOT / "experiments" / "fedavg_mnist_cnn.yaml")
    base = load_config(None, [], base=preset.tree("cpu"))
    runs = plan(base, list(preset.algorithms), tmp_path, [0, 1], [], preset.variants)
    assert [r.label for r in runs] == ["fedsgd", "fedavg_e5_b10"] * 2
    by_label = {r.label: r.config for r in runs if r.config.seed == 1}
    sgd, avg = by_label["fedsgd"], by_label["fedavg_e5_b10"]
    assert sgd.algorithm == avg.algorithm == "fedavg"
    # B = inf: one batch holds any client's data (digits: at most ~18 per client)
    assert (sgd.local.epochs, sgd.local.batch_size) == (1, 600)
    assert (avg.local.epochs, avg.local.batch_size) == (5, 10)
    for cfg in (sgd, avg):  # nothing else moved
        same = dataclasses.replace(base, seed=1, out=cfg.out, local=cfg.local)
        assert cfg == same
    assert by_label["fedsgd"].out == str(tmp_path / "seed1" / "fedsgd")


def test_preset_variants_are_checked_and_listed_by_their_row_names(tmp_path) -> None:
    from engine.simulation.compare import parse_algorithms

    head = "preset: {paper: a, table: b, claim: c, epsilons: [], scales: {cpu: {}}, "
    p = tmp_path / "x.yaml"
    p.write_text(head + "algorithms: [sgd], variants: {sgd: {local: {epochs: 1}}}}\n")
    with pytest.raises(ConfigError, match=r"^preset.variants.sgd.algorithm=None"):
        read_preset(p)
    p.write_text(head + "algorithms: [sgd, other], variants: {sgd: {algorithm: fedavg}}}\n")
    with pytest.raises(ConfigError, match=r"^preset.algorithms: \['other'\]"):
        read_preset(p)
    p.write_text(head + "algorithms: [sgd, fedavg], variants: {sgd: {algorithm: fedavg}}}\n")
    preset = read_preset(p)
    assert preset.recipe("sgd") == preset.recipe("fedavg") == "fedavg"
    assert parse_algorithms("sgd,dp_fedavg", preset.variants) == ["sgd", "dp_fedavg"]
    with pytest.raises(ConfigError, match=r"--algorithms='sgd': unknown \['sgd'\]"):
        parse_algorithms("sgd")  # a variant name means nothing outside its preset


def test_fidelity_verdict_reads_the_column_the_claim_is_about() -> None:
    from scripts.fidelity import verdicts as fidelity

    rows = pd.DataFrame(
        {
            "epsilon_target": [1.0] * 4,
            "algorithm": ["dp_fedavg", "dp_fedavg", "dp2_fedsam", "dp2_fedsam"],
            "private": [True] * 4,
            "epsilon": [1.0] * 4,
            "final_accuracy": [0.30, 0.32, 0.10, 0.11],
            "personal_accuracy_nonprivate": [float("nan")] * 2 + [0.50, 0.52],
        }
    )
    preset = read_preset(ROOT / "experiments" / "dp2_fedsam_personal.yaml")
    assert fidelity.verdict(preset, rows) == "reproduced"
    assert "dp2_fedsam ε=1 (personal_accuracy_nonprivate): 0.510" in fidelity.numbers(rows, preset)
    # the same rows judged on the global model's accuracy: the claim fails
    plain = dataclasses.replace(
        preset, meta={"verdict": {"better": "dp2_fedsam", "than": "dp_fedavg"}}
    )
    assert fidelity.verdict(plain, rows) == "not reproduced"


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_every_preset_builds_a_valid_config_at_both_scales(path: Path) -> None:
    preset = read_preset(path)
    assert preset is not None
    for scale in ("paper", "cpu"):
        cfg = load_config(None, [], base=preset.tree(scale))
        assert cfg.dataset.name == ("digits" if scale == "cpu" else cfg.dataset.name)
        assert cfg.dataset.name != "digits" or scale == "cpu"  # paper scale: the paper's data
        from engine.simulation.compare import plan

        runs = plan(cfg, list(preset.algorithms), Path("unused"), None, [], preset.variants)
        assert [r.config.algorithm for r in runs] == [preset.recipe(a) for a in preset.algorithms]
    # the paper scale states the paper's numbers, e.g. DP-Fed-LS's q = 0.05, C = 0.3, T = 30
    if path.stem == "dp_fed_ls_mnist_logreg":
        cfg = load_config(None, [], base=preset.tree("paper"))
        assert (cfg.sampling.rate, cfg.privacy.clip_norm, cfg.rounds) == (0.05, 0.3, 30)
        assert (cfg.local.epochs, cfg.local.batch_size, cfg.model.name) == (5, 10, "logreg")
        assert cfg.dataset.num_clients == 1000 and preset.epsilons == (1.0, 6.0)


def test_a_preset_is_not_a_run_config_and_says_how_to_run_it() -> None:
    with pytest.raises(ConfigError, match="paper preset.*dpfl compare"):
        load_config(PRESETS[0])


def test_bad_preset_sections_name_the_key(tmp_path) -> None:
    p = tmp_path / "x.yaml"
    p.write_text("preset: {paper: a, table: b, claim: c, algorithms: [dp_fedavg], scales: {}}\n")
    with pytest.raises(ConfigError, match=r"^preset.epsilons: missing"):
        read_preset(p)
    p.write_text(
        "preset: {paper: a, table: b, claim: c, algorithms: [dp_fedavg], epsilons: [0],"
        " scales: {cpu: {}}}\n"
    )
    with pytest.raises(ConfigError, match=r"^preset.epsilons="):
        read_preset(p)
    p.write_text(
        "preset: {paper: a, table: b, claim: c, algorithms: [dp_fedavg], epsilons: [1],"
        " scales: {laptop: {}}}\n"
    )
    with pytest.raises(ConfigError, match=r"^preset.scales: unknown"):
        read_preset(p)


@pytest.mark.slow
def test_compare_runs_a_preset_table_over_epsilons_and_seeds(capsys, tmp_path) -> None:
    """A tiny preset: 2 algorithms x 2 epsilons x 2 seeds. Every run lands in its own
    folder, σ is calibrated per ε (ε computed <= target, from the accountant), and the
    printed table has one row per algorithm and one column per ε with mean ± std."""
    preset = tmp_path / "tiny.yaml"
    preset.write_text(
        """
preset:
  paper: test
  table: tiny
  claim: none
  algorithms: [dp_fedavg, dp_fed_ls]
  epsilons: [2, 8]
  scales:
    cpu:
      dataset: {name: digits, num_clients: 40, client_test_fraction: 0.0}
      ray: {executor: local}
model: {name: logreg}
rounds: 2
sampling: {rate: 0.5}
local: {epochs: 1, batch_size: 16}
eval: {every: 2}
"""
    )
    out = tmp_path / "c"
    args = ["compare", "-q", "--config", str(preset), "--scale", "cpu", "--seeds", "0,1"]
    assert main([*args, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    rows = pd.read_parquet(out / "compare.parquet")
    assert len(rows) == 8
    for e in (2, 8):
        for s in (0, 1):
            for a in ("dp_fedavg", "dp_fed_ls"):
                assert (out / f"eps{e}" / f"seed{s}" / a / "rounds.parquet").is_file()
        sub = rows[rows.epsilon_target == e]
        assert (sub["epsilon"] <= e + 1e-9).all()
        z = float(sub["noise_multiplier"].iloc[0])
        cfg = load_config(None, [], base=read_preset(preset).tree("cpu"))
        from engine.simulation import plan_privacy

        plan = plan_privacy(load_config(None, [f"privacy.epsilon={e}"], base=read_preset(
            preset).tree("cpu")))  # fmt: skip
        recomputed = compute_epsilon(z, plan.sampling, cfg.rounds, plan.delta, plan.accountant)
        assert sub["epsilon"].iloc[0] == pytest.approx(recomputed, rel=1e-9)
    # σ differs by budget: more noise for the smaller ε
    z_by_eps = rows.groupby("epsilon_target")["noise_multiplier"].first()
    assert z_by_eps[2] > z_by_eps[8]
    header = next(line for line in text.splitlines() if "eps=2" in line)
    assert "eps=8" in header
    for a in ("dp_fedavg", "dp_fed_ls"):
        g = rows[(rows.algorithm == a) & (rows.epsilon_target == 8)]["final_accuracy"]
        line = next(x for x in text.splitlines() if x.startswith(a + " "))
        assert f"{g.mean():.4f} ± {g.std(ddof=1):.3f}" in line


def test_dpfl_submit_validates_a_preset_compare_before_submitting(tmp_path) -> None:
    from engine.cli.submit import validate_dpfl_args

    preset = "experiments/dp_fed_ls_mnist_logreg.yaml"
    ns = validate_dpfl_args(
        ["compare", "--config", preset, "--scale", "cpu", "--out", str(tmp_path / "o")], ROOT
    )
    assert ns.scale == "cpu" and ns.algorithms is None
    with pytest.raises(ConfigError, match=r"^model.init="):
        validate_dpfl_args(
            ["compare", "--config", preset, "--out", "/abs/o", "--set", "model.init=ones"], ROOT
        )
    with pytest.raises(ConfigError, match="--algorithms"):
        validate_dpfl_args(["compare", "--config", preset, "--out", "/o", "-a", "nope"], ROOT)


def test_compare_epsilons_plan_clears_sigma_and_nests_folders(tmp_path) -> None:
    from engine.simulation.compare import plan

    cfg = load_config(overrides=["privacy.noise_multiplier=2", "privacy.epsilon=null"])
    configs = [r.config for r in plan(cfg, ["dp_fedavg", "fedavg"], tmp_path, [0, 1], [1.0, 4.0])]
    assert len(configs) == 8
    assert {(c.privacy.epsilon, c.privacy.noise_multiplier) for c in configs} == {
        (1.0, None),
        (4.0, None),
    }
    assert configs[0].out == str(tmp_path / "eps1" / "seed0" / "dp_fedavg")
    assert configs[-1].out == str(tmp_path / "eps4" / "seed1" / "fedavg")


def test_paper_table_cells_are_mean_and_sample_std_per_algorithm_and_epsilon() -> None:
    from engine.simulation.compare import format_paper_table, summarize

    rows = pd.DataFrame(
        {
            "epsilon_target": [1.0, 1.0, 1.0, 1.0, 6.0, 6.0, 6.0, 6.0],
            "algorithm": ["a", "a", "b", "b"] * 2,
            "seed": [0, 1] * 4,
            "private": [True] * 8,
            "epsilon": [0.99, 0.98, 0.99, 0.97, 5.9, 5.95, 5.9, 5.99],
            "noise_multiplier": [3.0] * 4 + [1.0] * 4,
            "final_accuracy": [0.5, 0.7, 0.6, 0.6, 0.8, 0.9, 0.95, 0.85],
            "best_accuracy": [0.5, 0.7, 0.6, 0.6, 0.8, 0.9, 0.95, 0.85],
            "wall_time_s": [1.0] * 8,
        }
    )
    summary = summarize(rows)
    assert len(summary) == 4  # one row per (epsilon, algorithm)
    text = format_paper_table(summary)
    line_a = next(x for x in text.splitlines() if x.startswith("a "))
    line_b = next(x for x in text.splitlines() if x.startswith("b "))
    # a: eps=1 -> mean 0.6, std sqrt(0.02) = 0.141; eps=6 -> 0.85 ± 0.071
    assert "0.6000 ± 0.141" in line_a and "0.8500 ± 0.071" in line_a
    assert "0.6000 ± 0.000" in line_b and "0.9000 ± 0.071" in line_b
    assert line_a.index("0.6000") < line_a.index("0.8500")  # columns in ε order
    # the accountant's ε per column: mean over seeds, largest over the algorithms
    assert "eps=1: 0.985, eps=6: 5.945" in text


def test_paper_table_shows_the_canary_audit_beside_the_accountants_epsilon() -> None:
    from engine.simulation.compare import format_paper_table, summarize

    rows = pd.DataFrame(
        {
            "epsilon_target": [1.0, 1.0, 4.0, 4.0],
            "algorithm": ["a", "a", "a", "a"],
            "seed": [0, 1, 0, 1],
            "private": [True] * 4,
            "epsilon": [0.99, 0.99, 3.99, 3.99],
            "final_accuracy": [0.5, 0.7, 0.8, 0.9],
            "best_accuracy": [0.5, 0.7, 0.8, 0.9],
            "audit_epsilon_estimate_nonprivate": [0.2, 0.4, 1.0, 2.0],
            "audit_epsilon_lower_nonprivate": [0.0, 0.0, 0.5, 0.7],
        }
    )
    text = format_paper_table(summarize(rows))
    audit = text[text.index("canary audit") :]
    line = next(x for x in audit.splitlines() if x.startswith("a "))
    # means over seeds: eps=1 -> 0.3 / 0; eps=4 -> 1.5 / 0.6, in ε order
    assert "0.3 / 0" in line and "1.5 / 0.6" in line
    assert line.index("0.3 / 0") < line.index("1.5 / 0.6")
    # without audit columns the section is absent
    assert "canary audit" not in format_paper_table(
        summarize(rows.drop(columns=["audit_epsilon_estimate_nonprivate"]))
    )


def test_compare_runs_preset_variants_as_their_own_rows(capsys, tmp_path) -> None:
    """Two rows of one recipe: compare.parquet names each by its row and its recipe,
    each run's saved config carries its variant's keys, and the printed table has a
    line per row."""
    preset = tmp_path / "v.yaml"
    preset.write_text(
        """
preset:
  paper: test
  table: tiny
  claim: none
  algorithms: [one_step, two_epochs]
  variants:
    one_step: {algorithm: fedavg, local: {epochs: 1, batch_size: 600}}
    two_epochs: {algorithm: fedavg, local: {epochs: 2, batch_size: 4}}
  epsilons: []
  scales:
    cpu:
      dataset: {name: digits, num_clients: 40, client_test_fraction: 0.0}
      ray: {executor: local}
algorithm: fedavg
model: {name: logreg}
rounds: 1
sampling: {rate: 0.5}
eval: {every: 1}
"""
    )
    out = tmp_path / "c"
    args = ["compare", "-q", "--config", str(preset), "--scale", "cpu", "--out", str(out)]
    assert main(args) == 0
    rows = pd.read_parquet(out / "compare.parquet")
    assert sorted(rows["algorithm"]) == ["one_step", "two_epochs"]
    assert set(rows["recipe"]) == {"fedavg"} and not rows["private"].any()
    import json

    for row, (epochs, batch) in {"one_step": (1, 600), "two_epochs": (2, 4)}.items():
        saved = json.loads((out / row / "config.json").read_text())["config"]
        assert (saved["local"]["epochs"], saved["local"]["batch_size"]) == (epochs, batch)
    text = capsys.readouterr().out
    firsts = [x.split()[0] for x in text.splitlines() if x.strip()]
    assert "one_step" in firsts and "two_epochs" in firsts
