"""The real scale of the paper presets (issue 28 item 4): scripts.fidelity's interval,
decision rule and page splicing (the section labelled untuned, pointing to the
leaderboard), and every ``real:`` tree of experiments/*.yaml."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from engine.config import load_config
from engine.config.presets import SCALES, read_preset
from scripts.fidelity import page as fpage
from scripts.fidelity import runs as fruns
from scripts.fidelity import stats as fstats
from scripts.fidelity.verdicts import cpu_verdicts

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted((ROOT / "experiments").glob("*.yaml"))
REAL = [p for p in PRESETS if "real" in (read_preset(p).scales if read_preset(p) else {})]


@pytest.mark.parametrize("n", [2, 3, 5, 8, 20])
def test_t_interval_matches_scipy(n: int) -> None:
    rng = np.random.default_rng(n)
    for _ in range(5):
        xs = rng.normal(rng.normal(), rng.uniform(0.01, 2.0), size=n)
        mean, lo, hi = fstats.t_interval(xs)
        elo, ehi = stats.t.interval(0.95, n - 1, loc=xs.mean(), scale=stats.sem(xs))
        assert mean == pytest.approx(xs.mean(), abs=1e-12)
        assert (lo, hi) == (pytest.approx(elo, abs=1e-9), pytest.approx(ehi, abs=1e-9))


def test_t_interval_of_one_value_has_no_width() -> None:
    mean, lo, hi = fstats.t_interval([0.3])
    assert mean == 0.3 and math.isnan(lo) and math.isnan(hi)


def test_decision_rule_has_three_outcomes_on_constructed_differences() -> None:
    up = [0.05, 0.06, 0.04, 0.055, 0.045]
    down = [-d for d in up]
    mixed = [0.05, -0.04, 0.01, -0.02, 0.03]
    assert fstats.decide(*fstats.t_interval(up)[1:]) == "reproduced"
    assert fstats.decide(*fstats.t_interval(down)[1:]) == "reversed"
    assert fstats.decide(*fstats.t_interval(mixed)[1:]) == "inconclusive"
    # a positive mean whose interval still reaches 0 decides nothing
    noisy = [0.2, -0.1, 0.15, -0.05, 0.1]
    _, lo, hi = fstats.t_interval(noisy)
    assert np.mean(noisy) > 0 and lo < 0 < hi
    assert fstats.decide(lo, hi) == "inconclusive"


def test_a_claim_over_several_epsilons_needs_every_epsilon() -> None:
    assert fstats.combine(["reproduced", "reproduced"]) == "reproduced"
    assert fstats.combine(["reproduced", "inconclusive"]) == "inconclusive"
    assert fstats.combine(["reversed", "reproduced"]) == "inconclusive"
    assert fstats.combine(["reversed", "reversed"]) == "reversed"
    assert fstats.combine([]) == "inconclusive"


def test_reversal_of_the_cpu_verdict() -> None:
    assert fstats.reverses("reproduced (difference within one std)", "reversed")
    assert fstats.reverses("not reproduced", "reproduced")
    assert not fstats.reverses("not reproduced", "reversed")
    assert not fstats.reverses("reproduced", "inconclusive")
    assert not fstats.reverses("no reference at cpu scale", "reproduced")


def test_paired_differences_pair_by_seed_and_epsilon() -> None:
    preset = read_preset(ROOT / "experiments" / "dp_fed_ls_mnist_logreg.yaml")
    rng = np.random.default_rng(0)
    rows = []
    for e in (1.0, 6.0):
        for s in range(5):
            base = rng.uniform(0.5, 0.8)
            gain = 0.1 if e == 1.0 else -0.1
            for alg, acc in (("dp_fedavg", base), ("dp_fed_ls", base + gain + 0.01 * s)):
                rows.append(
                    {"epsilon_target": e, "algorithm": alg, "seed": s, "final_accuracy": acc}
                )
    frame = pd.DataFrame(rows).sample(frac=1.0, random_state=1)  # order must not matter
    out = fstats.paired(preset, frame)
    assert [o["epsilon_target"] for o in out] == [1.0, 6.0]
    assert out[0]["diffs"] == pytest.approx([0.1 + 0.01 * s for s in range(5)])
    assert out[1]["diffs"] == pytest.approx([-0.1 + 0.01 * s for s in range(5)])
    assert [o["verdict"] for o in out] == ["reproduced", "reversed"]
    assert fstats.combine([o["verdict"] for o in out]) == "inconclusive"


def test_real_section_is_spliced_and_the_rest_of_the_page_survives() -> None:
    page = "\n".join(
        [
            "# Title",
            "",
            "hand-added text",
            "",
            fpage.REAL_HEADING,
            "",
            "old body",
            "",
            "## Ablation",
            "",
            "| kept |",
        ]
    )
    new = fpage.splice_section(page, fpage.REAL_HEADING, [fpage.REAL_HEADING, "", "new"])
    assert "old body" not in new and "new" in new
    assert new.startswith("# Title\n\nhand-added text\n")
    assert new.rstrip().endswith("## Ablation\n\n| kept |")
    assert fpage.section_of(new, fpage.REAL_HEADING) == [fpage.REAL_HEADING, "", "new"]
    # a page without the section gets it appended
    assert fpage.splice_section("# T\n", "## X", ["## X", "", "b"]).endswith("## X\n\nb\n")


def test_cpu_verdicts_are_read_from_the_page() -> None:
    page = (
        "| claim | `a.yaml` | cpu | numbers | reproduced |\n"
        "| (same) | `a.yaml` | paper | — | not yet run |\n"
        "| claim | `b.yaml` | cpu | numbers | not reproduced (difference within one std) |\n"
    )
    assert cpu_verdicts(page) == {
        "a": "reproduced",
        "b": "not reproduced (difference within one std)",
    }


def test_real_is_a_preset_scale_and_some_presets_have_it() -> None:
    assert "real" in SCALES
    assert REAL, "no experiments/*.yaml has a real: scale"


@pytest.mark.parametrize("path", REAL, ids=lambda p: p.stem)
def test_every_real_tree_is_fashion_mnist_at_the_paper_client_count(path: Path) -> None:
    preset = read_preset(path)
    real = load_config(None, [], base=fruns.real_tree(preset))
    paper = load_config(None, [], base=preset.tree("paper"))
    assert real.dataset.name == "fashion_mnist"
    assert real.dataset.num_clients == paper.dataset.num_clients
    if paper.dataset.partition in ("iid", "dirichlet"):
        assert real.dataset.partition == paper.dataset.partition
    if paper.dataset.partition == "dirichlet":
        assert real.dataset.alpha == paper.dataset.alpha
    assert real.ray.executor == "local"
    assert 0 < real.rounds <= paper.rounds
    assert real.sampling.rate == paper.sampling.rate
    # the paper's local settings are kept
    for key in ("epochs", "steps", "batch_size", "lr"):
        assert getattr(real.local, key, None) == getattr(paper.local, key, None), key
    # the rows the real scale runs are the claim's two, and they plan
    rows = fruns.real_rows(preset)
    rule = preset.meta["verdict"]
    assert rows == [rule["than"], rule["better"]]
    from engine.simulation.compare import plan

    runs = plan(real, rows, Path("unused"), [0], [], fruns.real_variants(preset))
    assert [r.config.algorithm for r in runs] == [preset.recipe(a) for a in rows]
    # a variant row keeps the paper's local work (epochs, batch size); only its learning
    # rate may be the real tree's own
    ref = plan(paper, rows, Path("unused"), [0], [], preset.variants)
    for r, p in zip(runs, ref, strict=True):
        assert (r.config.local.epochs, r.config.local.batch_size) == (
            p.config.local.epochs,
            p.config.local.batch_size,
        ), r.label


def test_real_variants_merge_the_real_trees_own_over_the_presets(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        "preset: {paper: a, table: b, claim: c, algorithms: [one, two], epsilons: [],\n"
        "  verdict: {better: two, than: one},\n"
        "  variants: {one: {algorithm: fedavg, local: {epochs: 1, lr: 0.1}},\n"
        "             two: {algorithm: fedavg, local: {epochs: 5, lr: 0.3}}},\n"
        "  scales: {real: {rounds: 3, variants: {two: {local: {lr: 0.05}}}}}}\n"
    )
    preset = read_preset(path)
    assert "variants" not in fruns.real_tree(preset)
    assert fruns.real_variants(preset) == {
        "one": {"algorithm": "fedavg", "local": {"epochs": 1, "lr": 0.1}},
        "two": {"algorithm": "fedavg", "local": {"epochs": 5, "lr": 0.05}},
    }
    assert preset.variants["two"]["local"]["lr"] == 0.3  # the other scales keep theirs


def test_the_real_section_is_labelled_untuned_and_points_to_the_leaderboard() -> None:
    section = fpage.real_section([], [], {}, [])
    assert section[0] == fpage.REAL_HEADING and "untuned" in section[0]
    text = "\n".join(section)
    assert "do not rank the methods" in text and "leaderboard.md" in text
    # a page written under the section's former heading gets the section replaced
    old = "\n".join(["# T", "", fpage.OLD_REAL_HEADINGS[0], "", "old verdicts", "", "## Next", ""])
    new = fpage.splice_section(old, fpage.REAL_HEADING, section, fpage.OLD_REAL_HEADINGS)
    assert "old verdicts" not in new and fpage.REAL_HEADING in new and "## Next" in new
    assert fpage.OLD_REAL_HEADINGS[0] not in new
