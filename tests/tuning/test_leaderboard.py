"""``dpfl leaderboard`` on tiny synthetic data, in process: the paired draws, the
accounting of the released trial against dp-accounting, selection on the validation set
only, resume equal to an uninterrupted run, the decision rule, the outputs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import dp_accounting
import numpy as np
import pandas as pd
import pytest
from dp_accounting import rdp
from scipy import stats as sps

from engine.cli import main
from tuning.budget import TOLERANCE
from tuning.leaderboard import draws, stats
from tuning.leaderboard.cells import select

TOTAL = 1.0
YAML = f"""
dataset: {{num_clients: 60, synthetic_mean_samples: 16, synthetic_dim: 10, validation_size: 60}}
sampling: {{rate: 0.05}}
eval: {{every: 1}}
ray: {{executor: local}}
local: {{batch_size: 8}}
leaderboard:
  methods: [dp_fedavg, dp_fedsam]
  references: [fedavg]
  personal: [dp2_fedsam]
  total_epsilons: [{TOTAL}]
  trials: 2
  seeds: 2
  rounds: [1, 2]
"""
TIMING = ("wall_time_s_nonprivate",)


class Crash(BaseException):
    """The driver dies (no handler in the engine catches a BaseException)."""


def _write_config(folder: Path, text: str = YAML) -> Path:
    path = folder / "lb.yaml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def board(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("board")
    out = root / "lb"
    config = str(_write_config(root))
    args = ["leaderboard", "-q", "--config", config, "--out", str(out), "--processes", "2"]
    assert main(args) == 0
    return out


def _rows(out: Path) -> pd.DataFrame:
    return pd.read_parquet(out / "leaderboard.parquet")


def _cell(out: Path, name: str) -> dict:
    return json.loads((out / "cells" / f"{name}.json").read_text())


def test_trial_k_of_every_method_draws_the_same_shared_values_and_seeds(board) -> None:
    rows = _rows(board)
    first = rows.sort_values("round").groupby("run_id").head(1)
    shared = ["hp_local_lr", "hp_local_epochs", "hp_rounds", "seed"]
    private = first[first["method"].isin(["dp_fedavg", "dp_fedsam", "dp2_fedsam"])]
    for (phase, k), g in private.groupby(["phase", "index"]):
        assert len(g) == 3
        for col in [*shared, "hp_privacy_clip_norm"] if phase == "trial" else ["seed"]:
            assert g[col].nunique() == 1, (phase, k, col)
    ref = first[first["method"] == "fedavg"].set_index(["phase", "index"])
    for (phase, k), g in private.groupby(["phase", "index"]):
        if phase == "trial":  # the non-private reference: the same shared values but C
            assert (ref.loc[(phase, k), shared] == g.iloc[0][shared]).all()
    trials, seeds = first[first["phase"] == "trial"], first[first["phase"] == "seed"]
    assert trials.groupby("index")["seed"].first().nunique() == 2  # own seed per trial k
    assert not set(trials["seed"]) & set(seeds["seed"])  # seed runs use fresh seeds
    # own keys come from each method's own stream
    fs = first[(first["method"] == "dp_fedsam") & (first["phase"] == "trial")]["hp_algo_rho"]
    p2 = first[(first["method"] == "dp2_fedsam") & (first["phase"] == "trial")]["hp_algo_rho"]
    assert fs.notna().all() and set(fs) != set(p2)
    # the shared draw is a function of (seed, k) alone; the own draw of the method too
    space = {"local.lr": {"type": "loguniform", "low": 0.01, "high": 0.5}}
    assert draws.shared_values(3, 1, space) == draws.shared_values(3, 1, space)
    assert draws.shared_values(3, 1, space) != draws.shared_values(3, 2, space)
    rho = {"algo.rho": {"type": "uniform", "low": 0.0, "high": 1.0}}
    assert draws.own_values(3, "dp_fedsam", 1, rho) != draws.own_values(3, "dp2_fedsam", 1, rho)


def _oracle_run(z: float, q: float, rounds: int) -> dp_accounting.DpEvent:
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds
    )


@pytest.mark.parametrize("name", ["dp_fedavg-eps1", "dp_fedsam-eps1", "dp2_fedsam-eps1"])
def test_the_released_trials_epsilon_is_dp_accountings_composition(board, name) -> None:
    rows, cell = _rows(board), _cell(board, name)
    trials = rows[(rows["run_id"].str.startswith(name)) & (rows["phase"] == "trial")]
    events, delta = [], None
    for _, g in trials.groupby("index"):
        first = g.iloc[0]
        z, q, t = first["noise_multiplier"], first["sampling_rate"], int(first["rounds_planned"])
        delta = first["delta"]
        events.append(_oracle_run(z, q, t))
        own = g.sort_values("round")["epsilon"].iloc[-1]
        acc = rdp.RdpAccountant()
        acc.compose(_oracle_run(z, q, t))
        assert own == pytest.approx(acc.get_epsilon(delta), rel=1e-12)
        assert own <= cell["budget"]["per_trial_epsilon"] * (1 + 1e-12)
    acc = rdp.RdpAccountant()
    acc.compose(dp_accounting.ComposedDpEvent(events))
    assert cell["released_epsilon"] == pytest.approx(acc.get_epsilon(delta), rel=1e-12)
    assert TOTAL * (1 - TOLERANCE) <= cell["released_epsilon"] <= TOTAL
    # the seed runs: the selected trial's σ and rounds
    seeds = rows[(rows["run_id"].str.startswith(name)) & (rows["phase"] == "seed")]
    assert set(seeds["noise_multiplier"]) == {cell["selected"]["noise_multiplier"]}
    assert set(seeds["rounds_planned"]) == {cell["selected"]["rounds"]}


def test_selection_is_the_best_validation_accuracy(board) -> None:
    rows = _rows(board)
    for name, metric in (
        ("dp_fedavg-eps1", "val_accuracy"),
        ("dp2_fedsam-eps1", "personal_accuracy_nonprivate"),
    ):
        trials = rows[(rows["run_id"].str.startswith(name)) & (rows["phase"] == "trial")]
        finals = trials.sort_values("round").groupby("index")[metric].last()
        assert _cell(board, name)["selected"]["index"] == select(finals.to_dict())
    assert select({0: 0.5, 1: 0.7, 2: 0.7, 3: math.nan}) == 1
    assert select({0: math.nan}) is None


def test_selection_never_reads_the_test_set(board, tmp_path, monkeypatch) -> None:
    """The same leaderboard with the test labels scrambled: every trial's validation
    accuracy and the selection are unchanged, the test accuracies are not."""
    import engine.data as data

    real = data.build_dataset

    def scrambled(cfg, rng):
        ds = real(cfg, rng)
        y = np.random.default_rng(0).permutation(ds.y_test)
        return type(ds)(**{**{f: getattr(ds, f) for f in ds.__dataclass_fields__}, "y_test": y})

    monkeypatch.setattr(data, "build_dataset", scrambled)
    text = YAML.replace("[dp_fedavg, dp_fedsam]", "[dp_fedavg]").replace(
        "  references: [fedavg]\n", ""
    )
    text = text.replace("  personal: [dp2_fedsam]\n", "")
    out = tmp_path / "scrambled"
    assert (
        main(
            [
                "leaderboard",
                "-q",
                "--config",
                str(_write_config(tmp_path, text)),
                "--out",
                str(out),
                "--processes",
                "1",  # the patched reader must be this process's
            ]
        )
        == 0
    )
    a, b = _rows(board), _rows(out)
    a = a[a["run_id"].str.startswith("dp_fedavg")].sort_values(
        ["run_id", "round"], ignore_index=True
    )
    b = b.sort_values(["run_id", "round"], ignore_index=True)
    assert a["val_accuracy"].equals(b["val_accuracy"])
    assert not a["test_accuracy"].equals(b["test_accuracy"])
    assert _cell(out, "dp_fedavg-eps1")["selected"] == _cell(board, "dp_fedavg-eps1")["selected"]


def _assert_two_methods_equal_the_boards(out: Path, board: Path) -> None:
    """``out``'s dp_fedavg and dp_fedsam rows, selections and seed results equal the
    board's bit for bit (timing columns aside)."""
    got, want = _rows(out), _rows(board)
    want = want[want["method"].isin(["dp_fedavg", "dp_fedsam"])]
    assert set(got.columns) <= set(want.columns)  # the board's other methods add columns
    cols = [c for c in got.columns if c not in TIMING]
    key = ["run_id", "round"]
    pd.testing.assert_frame_equal(
        got.sort_values(key, ignore_index=True)[cols],
        want.sort_values(key, ignore_index=True)[cols],
        check_exact=True,
    )
    for name in ("dp_fedavg-eps1", "dp_fedsam-eps1"):
        a, b = _cell(out, name), _cell(board, name)
        assert (a["selected"], a["seed_runs"]) == (b["selected"], b["seed_runs"])


def test_resume_continues_to_the_uninterrupted_result(board, tmp_path, capsys) -> None:
    import engine.simulation as sim

    root = tmp_path
    out = root / "lb"
    text = YAML.replace("  references: [fedavg]\n", "").replace("  personal: [dp2_fedsam]\n", "")
    config = _write_config(root, text)
    real = sim.simulate

    def dying(config, **kw):  # dp_fedsam's second trial dies after its first round
        on_round = kw.pop("on_round")
        name = kw.get("run_name")

        def wrapped(row, executor):
            on_round(row, executor)
            if name == "dp_fedsam-eps1-trial1" and int(row["round"]) == 1:
                raise Crash

        return real(config, on_round=wrapped, **kw)

    sim.simulate = dying
    try:
        with pytest.raises(Crash):
            main(
                ["leaderboard", "-q", "--config", str(config), "--out", str(out)]
                + ["--processes", "1"]
            )  # fmt: skip - the patched simulate is this process's
    finally:
        sim.simulate = real
    kept = (out / "runs" / "dp_fedavg-eps1-trial0" / "rows.parquet").read_bytes()
    capsys.readouterr()
    # a fresh start into the folder is refused; so is a resume with other settings
    assert main(["leaderboard", "--config", str(config), "--out", str(out)]) == 2
    assert "never overwritten" in capsys.readouterr().err
    assert main(["leaderboard", "--resume", str(out), "--trials", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "leaderboard.trials=3" in err
    # --resume DIR alone: the folder's settings; finished runs kept, the stopped one continues
    assert main(["leaderboard", "-q", "--resume", str(out)]) == 0
    assert (out / "runs" / "dp_fedavg-eps1-trial0" / "rows.parquet").read_bytes() == kept
    _assert_two_methods_equal_the_boards(out, board)
    for name in ("dp_fedavg-eps1", "dp_fedsam-eps1"):
        sittings = _cell(out, name)["sittings"]
        assert len(sittings) == (2 if name == "dp_fedsam-eps1" else 1)
        assert all(s["code"] == _code_that_ran() for s in sittings)


def _code_that_ran() -> str:
    """The commit of this checkout (with ``+dirty`` if tracked files changed), asked of git
    here, or the installed package's version where the tests do not run from a checkout."""
    import subprocess
    from importlib.metadata import version

    root = Path(__file__).resolve().parents[2]
    head = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    if head.returncode != 0:
        return f"dpfl {version('dpfl')}"
    diff = subprocess.run(["git", "-C", str(root), "diff", "HEAD", "--quiet"], capture_output=True)
    return head.stdout.strip()[:12] + ("+dirty" if diff.returncode != 0 else "")


def test_a_resumed_leaderboard_adds_a_method_against_the_same_baseline_runs(
    board, tmp_path, capsys
) -> None:
    """Started with the baseline alone, then resumed with a second method: the baseline's
    runs are not run again (their files untouched), the added method's rows, selection
    and seed results equal those of the board that listed both from the start, and a
    plain --resume afterwards keeps both. Dropping a method is refused."""
    out = tmp_path / "lb"
    text = YAML.replace("  references: [fedavg]\n", "").replace("  personal: [dp2_fedsam]\n", "")
    config = str(_write_config(tmp_path, text.replace("[dp_fedavg, dp_fedsam]", "[dp_fedavg]")))
    assert main(["leaderboard", "-q", "--config", config, "--out", str(out)]) == 0
    first = {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("rows.parquet")}
    assert first and all("dp_fedavg-" in str(p) for p in first)
    assert (
        main(["leaderboard", "-q", "--resume", str(out), "--methods", "dp_fedavg,dp_fedsam"]) == 0
    )
    assert all(p.stat().st_mtime_ns == t for p, t in first.items())
    _assert_two_methods_equal_the_boards(out, board)
    record = json.loads((out / "leaderboard.json").read_text())
    assert record["settings"]["methods"] == ["dp_fedavg", "dp_fedsam"]
    table = (out / "leaderboard.md").read_text()
    assert "dp_fedsam" in table
    capsys.readouterr()
    assert main(["leaderboard", "--resume", str(out), "--methods", "dp_fedavg"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "leaves out dp_fedsam" in err
    before = {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("rows.parquet")}
    assert main(["leaderboard", "-q", "--resume", str(out)]) == 0  # both cells are done
    assert {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("rows.parquet")} == before


def test_runs_in_a_pool_equal_runs_one_after_another(board, tmp_path) -> None:
    """The board ran two runs at a time in a pool of processes: the same leaderboard run
    one run after another in this process gives the same rows, selections and seed
    results bit for bit (every draw, seed and σ is fixed before any run)."""
    out = tmp_path / "sequential"
    config = str(_write_config(tmp_path))
    assert (
        main(["leaderboard", "-q", "--config", config, "--out", str(out), "--processes", "1"]) == 0
    )
    got, want = _rows(out), _rows(board)
    cols = [c for c in want.columns if c not in TIMING]
    key = ["run_id", "round"]
    pd.testing.assert_frame_equal(
        got.sort_values(key, ignore_index=True)[cols],
        want.sort_values(key, ignore_index=True)[cols],
        check_exact=True,
    )
    for path in sorted((board / "cells").glob("*.json")):
        a, b = _cell(out, path.stem), _cell(board, path.stem)
        assert (a["selected"], a["seed_runs"]) == (b["selected"], b["seed_runs"])
        assert a.get("released_epsilon") == b.get("released_epsilon")


def test_processes_other_than_local_runs_are_refused(tmp_path, capsys) -> None:
    config = str(_write_config(tmp_path, YAML.replace("executor: local", "executor: processes")))
    args = ["leaderboard", "--config", config, "--out", str(tmp_path / "x"), "--processes", "2"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--processes=2 with ray.executor=processes" in err
    assert not (tmp_path / "x").exists()


def test_outputs_state_the_threat_model_once_and_the_rule(board) -> None:
    text = (board / "leaderboard.md").read_text()
    assert text.count("Threat model") == 1 and "seeded simulation" in text
    assert "lower bound > 0" in text and "not a release" in text
    assert "## Total ε = 1" in text and "## Personalised" in text and "## Non-private" in text
    assert "personal_accuracy_nonprivate" in text
    assert (board / "leaderboard.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cells = pd.read_parquet(board / "cells.parquet")
    assert set(cells["method"]) == {"dp_fedavg", "dp_fedsam", "dp2_fedsam", "fedavg"}
    assert (cells["status"] == "done").all() and (cells["wall_time_s"] > 0).all()
    assert cells.set_index("method").loc["dp_fedavg", "verdict"] == "baseline"
    assert (cells["code"] == _code_that_ran()).all()  # one sitting, this checkout
    assert f"Code that ran (commits of the sittings): {_code_that_ran()}." in text


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_t_interval_is_scipys(n: int) -> None:
    xs = np.random.default_rng(n).normal(0.7, 0.05, size=n)
    ci = stats.t_interval(xs)
    lo, hi = sps.t.interval(0.95, n - 1, loc=xs.mean(), scale=sps.sem(xs))
    assert (ci.mean, ci.lo, ci.hi) == pytest.approx((xs.mean(), lo, hi), rel=1e-12)


def test_the_decision_rule_on_constructed_differences() -> None:
    base = {0: 0.70, 1: 0.72, 2: 0.69, 3: 0.71, 4: 0.70}

    def shifted(d: list[float]) -> dict[int, float]:
        return {j: base[j] + d[j] for j in base}

    up = stats.paired_difference(shifted([0.05, 0.06, 0.04, 0.055, 0.045]), base)
    down = stats.paired_difference(shifted([-0.05, -0.06, -0.04, -0.055, -0.045]), base)
    noisy = stats.paired_difference(shifted([0.2, -0.1, 0.15, -0.05, 0.1]), base)
    assert up.lo > 0 and stats.verdict(up) == stats.BETTER
    assert down.hi < 0 and stats.verdict(down) == stats.WORSE
    assert noisy.mean > 0 and noisy.lo < 0 < noisy.hi and stats.verdict(noisy) == stats.INCONCLUSIVE
    # only the seeds both ran are paired; one common seed decides nothing
    one = stats.paired_difference({0: 0.9, 7: 0.1}, {0: 0.5, 8: 0.1})
    assert one.n == 1 and stats.verdict(one) == stats.INCONCLUSIVE


PRESETS = sorted(
    (Path(__file__).resolve().parents[2] / "experiments" / "leaderboard").glob("*.yaml")
)
#: what may differ between the CPU-sized grid and its personalised companion: which
#: recipes each ranks, and nothing of the protocol
RECIPE_KEYS = ("methods", "personal", "references")


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_every_leaderboard_preset_loads_and_passes_the_checks(path: Path) -> None:
    from engine.config import load_config, read_yaml_mapping
    from tuning.leaderboard.command import check_config
    from tuning.leaderboard.settings import settings_from

    tree = read_yaml_mapping(str(path))
    settings = settings_from(tree.pop("leaderboard"), {})
    check_config(load_config(base=tree))
    assert settings.baseline in settings.methods


def test_the_personalised_companion_runs_the_cpu_grids_protocol() -> None:
    from engine.config import read_yaml_mapping

    root = Path(__file__).resolve().parents[2] / "experiments" / "leaderboard"
    grid = read_yaml_mapping(str(root / "fashion_mnist_cpu.yaml"))
    companion = read_yaml_mapping(str(root / "fashion_mnist_cpu_personal.yaml"))
    a, b = grid.pop("leaderboard"), companion.pop("leaderboard")
    assert grid == companion  # the same data, model, sampling, evaluation, execution
    for key in RECIPE_KEYS:
        a.pop(key, None), b.pop(key, None)
    assert a == b  # the same baseline, budget, trials, seeds, rounds and shared ranges


def test_a_pool_takes_the_longest_runs_first() -> None:
    """The pool's order (tuning.run_order, tested there): costliest (rounds × local
    passes) first, ties as planned."""
    from types import SimpleNamespace

    from tuning.leaderboard.parallel import longest_first, run_cost

    def run(name: str, rounds: int, epochs: int = 1, steps: int | None = None):
        local = SimpleNamespace(epochs=epochs, steps=steps)
        return SimpleNamespace(run_id=name, config=SimpleNamespace(rounds=rounds, local=local))

    planned = [run(f"t{k}", t) for k, t in enumerate([100, 400, 50, 200, 50, 400, 400, 400])]
    ordered = longest_first(planned)
    assert [r.run_id for r in ordered] == ["t1", "t5", "t6", "t7", "t3", "t0", "t2", "t4"]
    # two passes a round cost twice one; a steps budget replaces the passes
    assert [r.run_id for r in longest_first([run("a", 100), run("b", 60, epochs=2)])] == ["b", "a"]
    assert run_cost(run("s", 10, epochs=2, steps=5)) == 50.0
