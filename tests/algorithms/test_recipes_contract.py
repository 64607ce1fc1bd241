"""Contract tests over every recipe, plus the recipe-specific properties of issue 3."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from algorithms import RECIPES, build_pipeline
from algorithms.dp_bandmf import MinSeparation
from algorithms.dp_ftrl import EpochPasses
from algorithms.pipeline import LUS, GaussianPrivatizer, Pipeline, RandK, TopK
from engine.config import AlgoConfig, load_config
from engine.privacy.accounting import SamplingSpec, make_accountant
from engine.privacy.tree_aggregation import rounds_event
from engine.simulation import simulate
from tests.conftest import TINY

ALL = list(RECIPES)
PRIVATE = [n for n, r in RECIPES.items() if r.private]


def run(*extra: str, write: bool = False):
    return simulate(load_config(overrides=[*TINY, *extra]), write=write)


@pytest.mark.parametrize("name", ALL)
def test_every_recipe_obeys_the_contract(name: str) -> None:
    z = "privacy.noise_multiplier=1.0"
    a = run(f"algorithm={name}", z)
    b = run(f"algorithm={name}", z)
    # Same seed, identical result.
    assert np.array_equal(a.weights, b.weights)
    assert a.rounds.drop(columns="wall_time_s_nonprivate").equals(
        b.rounds.drop(columns="wall_time_s_nonprivate")
    )
    assert np.isfinite(a.weights).all()
    if RECIPES[name].private:
        # Every update is clipped to C before any noise.
        assert (a.rounds["max_clipped_norm_nonprivate"] <= 0.5 * (1 + 1e-12)).all()
        # The recipe's event is accepted by the accountant and gives the recorded epsilon.
        pipe = build_pipeline(name, AlgoConfig(), 0.5, 1.0)
        spec = SamplingSpec("poisson", 30, rate=0.3)
        if RECIPES[name].participation == "epoch_passes":  # dp_ftrl: 3 disjoint cohorts of 9
            spec = EpochPasses(30, cohort_size=9)
        if RECIPES[name].participation == "b_min_separation":  # dp_bandmf: 3 groups (b = 3)
            spec = MinSeparation(30, cohort_size=9, bands=3, horizon=2)
            pipe = build_pipeline(name, AlgoConfig(bands=3), 0.5, 1.0)
        acc = make_accountant("rdp", spec)
        event = pipe.privatizer.dp_event(spec)
        assert acc.supports(event)
        if spec.mode == "epochs":  # 2 rounds: a partial tree of 2 steps
            acc.compose(rounds_event(event, spec.rounds_per_epoch, 2))
        elif spec.mode == "bands":  # the whole run is one Gaussian mechanism
            acc.compose(event)
        else:
            acc.compose(event, 2)
        assert acc.get_epsilon(a.privacy["delta"]) == pytest.approx(a.final_epsilon, rel=1e-9)
    else:
        assert math.isinf(a.final_epsilon)


@pytest.mark.parametrize("name", PRIVATE)
def test_one_round_without_noise_runs(name: str) -> None:
    res = run(f"algorithm={name}", "privacy.noise_multiplier=0", "rounds=1")
    assert np.isfinite(res.weights).all() and math.isinf(res.final_epsilon)


@pytest.mark.parametrize("name", ALL)
def test_personal_parameters_never_reach_the_server(name: str, monkeypatch) -> None:
    from engine.federated import server as server_mod
    from engine.federated.worker_model import personal_mask

    seen: list[np.ndarray] = []
    original = server_mod.Server.finish_round

    def spy(self, rnd, *partials, **kwargs):
        seen.extend(p.update_sum.copy() for p in partials)
        return original(self, rnd, *partials, **kwargs)

    monkeypatch.setattr(server_mod.Server, "finish_round", spy)
    res = run(f"algorithm={name}", "privacy.noise_multiplier=1.0", "rounds=3")
    pipe = build_pipeline(name, AlgoConfig(), 0.5, 1.0)
    if pipe.personal is None:
        return
    from engine.models import build_model
    from engine.privacy import rng as rngs

    model = build_model("mlp", (10,), 10, rngs.torch_gen(0, rngs.MODEL_INIT))
    head = personal_mask(model, pipe.personal.layers).numpy()
    init = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    assert head.sum() == 200 * 10 + 10  # the last Linear of the MLP
    assert seen and all((s[head] == 0).all() for s in seen)  # nothing of a head is sent
    assert np.array_equal(res.weights[head], init[head])  # and no noise lands there
    assert not np.array_equal(res.weights[~head], init[~head])
    assert res.rounds["personal_accuracy_nonprivate"].notna().all()


def test_noise_only_on_the_public_randk_mask() -> None:
    from engine.privacy import rng as rngs

    res = run(
        "algorithm=fedsmp_randk",
        "privacy.noise_multiplier=1.0",
        "rounds=1",
        "algo.keep_fraction=0.25",
        "sampling.rate=0.01",
    )  # empty cohort: pure noise
    assert res.rounds["realised_cohort_size_nonprivate"].iloc[0] == 0
    from engine.models import build_model

    model = build_model("mlp", (10,), 10, rngs.torch_gen(0, rngs.MODEL_INIT))
    init = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    moved = res.weights != init
    mask = RandK(0.25).mask(len(init), rngs.torch_gen(0, rngs.SERVER_PUBLIC, 0)).numpy()
    assert np.array_equal(moved, mask)  # every masked coordinate noised, nothing else
    assert mask.sum() == round(0.25 * len(init))


def test_data_dependent_mask_may_not_decide_where_noise_goes() -> None:
    for mask in (TopK(0.5), LUS(0.5)):
        with pytest.raises(ValueError, match="not public"):
            Pipeline(
                client_transforms=(mask,),
                privatizer=GaussianPrivatizer(1.0, 1.0, noise_support="public_mask"),
            )
    Pipeline(
        client_transforms=(RandK(0.5),),
        privatizer=GaussianPrivatizer(1.0, 1.0, noise_support="public_mask"),
    )


def test_pgn_with_beta_one_rho_zero_is_dp_fedavg() -> None:
    common = ("privacy.noise_multiplier=0.7", "rounds=3", "local.steps=3", "privacy.clip_norm=0.3")
    pgn = run("algorithm=dp_fedpgn", "algo.beta=1", "algo.rho=0", *common)
    fedavg = run("algorithm=dp_fedavg", *common)
    np.testing.assert_allclose(pgn.weights, fedavg.weights, rtol=0, atol=1e-6)
    assert not np.array_equal(pgn.weights, run("algorithm=dp_fedpgn", *common).weights)


def test_pgn_drift_is_removed_before_clipping_and_restored_after_noise() -> None:
    from algorithms.dp_fedpgn import PGNDriftRemoval, PGNDriftRestore

    g = torch.randn(50, dtype=torch.float64)
    delta = torch.randn(50, dtype=torch.float64)
    ctx = {"g_tilde": g, "steps": 7, "lr": 0.05}
    removed = PGNDriftRemoval(0.3).apply(delta, ctx)
    assert torch.allclose(removed - delta, 0.7 * 7 * 0.05 * g, rtol=0, atol=1e-15)
    restored = PGNDriftRestore(0.3).apply(removed, ctx)
    assert torch.allclose(restored, delta, rtol=0, atol=1e-15)


def test_hyperparameters_are_columns(tmp_path) -> None:
    run("algorithm=dp_fedpgn_ls", "privacy.noise_multiplier=1", f"out={tmp_path}/p", write=True)
    df = pd.read_parquet(tmp_path / "p" / "rounds.parquet")
    assert {"beta", "rho", "sigma_ls", "ls_scope", "local_steps"} <= set(df.columns)
    assert df["beta"].iloc[0] == 0.3 and df["rho"].iloc[0] == 0.2
    assert df["sigma_ls"].iloc[0] == 0.01
    run(
        "algorithm=dp_fedsam",
        "algo.rho=0.07",
        "algo.asam=false",
        "privacy.noise_multiplier=1",
        f"out={tmp_path}/s",
        write=True,
    )
    df = pd.read_parquet(tmp_path / "s" / "rounds.parquet")
    assert df["rho"].iloc[0] == 0.07 and not df["asam"].iloc[0]


def test_sam_defaults_follow_the_papers() -> None:
    assert build_pipeline("dp_fedsam", AlgoConfig(), 1, 1).step.rho == 0.5
    assert build_pipeline("dp_fedsam", AlgoConfig(), 1, 1).step.asam is True
    assert build_pipeline("dp_fedsam", AlgoConfig(asam=False), 1, 1).step.rho == 0.05
    assert build_pipeline("dp_fedsam_topk", AlgoConfig(), 1, 1).server_transforms[0].fraction == 0.4


def test_client_state_persists_and_disk_equals_memory(tmp_path) -> None:
    base = ("algorithm=dp2_fedsam", "privacy.noise_multiplier=1.0", "rounds=3")
    mem = run(*base)
    disk = run(*base, "algo.client_state=disk", f"out={tmp_path}/d", write=True)
    assert np.array_equal(mem.weights, disk.weights)
    assert mem.rounds["personal_accuracy_nonprivate"].equals(
        disk.rounds["personal_accuracy_nonprivate"]
    )
    files = list((tmp_path / "d" / "client_state").glob("client-*.npy"))
    assert files and all(np.load(f).shape == (2010,) for f in files)


def test_client_state_snapshot_round_trips() -> None:
    from engine.federated.client_state import ClientStateStore

    store = ClientStateStore()
    store.put(3, torch.arange(4.0))
    copy = ClientStateStore()
    copy.restore(store.snapshot())
    assert torch.equal(copy.get(3), torch.arange(4.0)) and copy.get(4) is None


def test_invalid_recipe_hyperparameters_fail_early() -> None:
    from engine.config import ConfigError

    with pytest.raises(ConfigError, match=r"^algo\.zero_fraction=1\.0"):
        run("algorithm=dp_fedavg_blur_lus", "algo.zero_fraction=1.0")
    # The old ambiguous key is refused with what to write instead.
    with pytest.raises(ConfigError, match=r"^algo\.sparsity: renamed; .*algo\.keep_fraction"):
        run("algorithm=fedsmp_topk", "algo.sparsity=0.5")
    with pytest.raises(ConfigError, match=r"^algo\.personal_layers=9"):
        run("algorithm=dp2_fedsam", "algo.personal_layers=9")
    with pytest.raises(ConfigError, match=r"^algo\.beta"):
        load_config(overrides=["algo.beta=1.5"])
    with pytest.raises(ConfigError, match=r"^algo\.noise_site"):
        load_config(overrides=["algo.noise_site=client"])  # Poisson: m unknown


def test_client_side_noise_has_the_central_distribution() -> None:
    common = (
        "sampling.mode=fixed",
        "sampling.cohort_size=6",
        "privacy.noise_multiplier=2.0",
        "rounds=1",
        "privacy.clip_norm=0.5",
    )
    central = run(*common)
    local = run(*common, "algo.noise_site=client")
    free = run(*common, "privacy.noise_multiplier=0")
    n_central = central.weights - free.weights
    n_local = local.weights - free.weights
    target = 2.0 * 0.5 / 6  # zC / m on the mean
    assert np.std(n_central) == pytest.approx(target, rel=0.05)
    assert np.std(n_local) == pytest.approx(target, rel=0.05)
    assert central.final_epsilon == local.final_epsilon


def test_dp_fed_ls_sigma_default_follows_the_model_kind() -> None:
    from algorithms.piece_specs import FED_LS_SIGMA_OTHER

    def sigma(model: str | None, **algo) -> float:
        pipe = build_pipeline("dp_fed_ls", AlgoConfig(**algo), 1.0, 1.0, model)
        return pipe.server_transforms[0].sigma_ls

    # the paper's models (weights over image pixels): σ_ls = 1
    assert sigma("logreg") == 1.0 and sigma("cnn") == 1.0 and sigma(None) == 1.0
    # models the paper does not cover get the measured default
    assert FED_LS_SIGMA_OTHER != 1.0
    for model in ("mlp", "resnet10_gn", "char_lstm"):
        assert sigma(model) == FED_LS_SIGMA_OTHER
    assert sigma("mlp", sigma_ls=0.3) == 0.3  # an explicit value always wins
    # DP-FedPGN-LS keeps its own paper default whatever the model
    pgn = build_pipeline("dp_fedpgn_ls", AlgoConfig(), 1.0, 1.0, "logreg")
    assert pgn.server_step.smoothing.sigma_ls == 0.01


def test_dp_fed_ls_model_kind_default_is_the_sigma_the_server_smooths_with(tmp_path) -> None:
    from algorithms.piece_specs import FED_LS_SIGMA_OTHER

    z = "privacy.noise_multiplier=1"
    default = run("algorithm=dp_fed_ls", z, "model.name=mlp", f"out={tmp_path}/d", write=True)
    explicit = run(
        "algorithm=dp_fed_ls", z, "model.name=mlp", f"algo.sigma_ls={FED_LS_SIGMA_OTHER}"
    )
    paper = run("algorithm=dp_fed_ls", z, "model.name=mlp", "algo.sigma_ls=1.0")
    # the recorded σ_ls is the one the server used: same model as the explicit value,
    # not the paper's
    assert np.array_equal(default.weights, explicit.weights)
    assert not np.allclose(default.weights, paper.weights)
    rows = pd.read_parquet(tmp_path / "d" / "rounds.parquet")
    assert (rows["sigma_ls"] == FED_LS_SIGMA_OTHER).all()
