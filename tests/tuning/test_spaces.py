"""Search spaces: defaults per recipe, YAML overrides, clear errors for unknown names."""

from __future__ import annotations

import pytest

from algorithms import RECIPES
from engine.config import ConfigError
from tuning.spaces import space_for, to_tune


@pytest.mark.parametrize("name", list(RECIPES))
def test_default_space_is_valid_and_uses_the_recipes_keys(name: str) -> None:
    space = space_for(name)
    algo_keys = {k.split(".", 1)[1] for k in space if k.startswith("algo.")}
    assert algo_keys <= set(RECIPES[name].hyperparameters)
    assert ("privacy.clip_norm" in space) == RECIPES[name].private
    assert set(to_tune(space)) == set(space)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            {"all": {"local.nonsense": {"type": "uniform", "low": 0, "high": 1}}},
            r"^tune\.space\.local\.nonsense: unknown hyperparameter",
        ),
        (
            {"dp_fedavg": {"algo.rho": {"type": "uniform", "low": 0, "high": 1}}},
            r"^tune\.space\.algo\.rho: unknown hyperparameter for algorithm=dp_fedavg",
        ),
        (
            {"all": {"privacy.epsilon": {"type": "choice", "values": [1, 2]}}},
            r"^tune\.space\.privacy\.epsilon: not searchable",
        ),
        (
            {"all": {"local.lr": {"type": "loguniform", "low": 0, "high": 1}}},
            r"^tune\.space\.local\.lr=.*loguniform needs low > 0",
        ),
        ({"all": {"local.lr": {"type": "gaussian"}}}, r"^tune\.space\.local\.lr=.*type must be"),
        ({"dp_magic": {}}, r"^tune\.space: unknown section"),
        (
            {"all": {"privacy.clip_norm": {"type": "choice", "values": [-1]}}},
            r"^tune\.space\.privacy\.clip_norm: privacy\.clip_norm=-1",
        ),
    ],
)
def test_bad_spaces_are_rejected_with_the_key(override: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        space_for("dp_fedavg", override)


def test_overrides_add_replace_and_remove() -> None:
    space = space_for(
        "dp_fedsam",
        {
            "all": {"local.epochs": None, "local.momentum": {"type": "choice", "values": [0, 0.5]}},
            "dp_fedsam": {"algo.rho": {"type": "choice", "values": [0.05, 0.5]}},
        },
    )
    assert "local.epochs" not in space
    assert space["local.momentum"]["values"] == [0, 0.5]
    assert space["algo.rho"] == {"type": "choice", "values": [0.05, 0.5]}


def test_tune_file_splits_config_and_tune_section(tmp_path) -> None:
    from tuning.plan import read_tune_file

    f = tmp_path / "exp.yaml"
    f.write_text("rounds: 9\ntune:\n  space:\n    all:\n      local.epochs: null\n")
    tree, section = read_tune_file(str(f))
    assert tree == {"rounds": 9} and section == {"space": {"all": {"local.epochs": None}}}
    f.write_text("tune:\n  spaces: {}\n")
    with pytest.raises(ConfigError, match=r"^tune\.spaces: unknown key"):
        read_tune_file(str(f))


@pytest.mark.ray
def test_a_trial_that_cannot_fit_the_local_ray_is_an_error_not_a_hang(ray_session) -> None:
    """The test Ray has 2 CPUs: a trial of 2 one-CPU workers plus its 0.5-CPU head would
    stay PENDING forever; run_tune refuses it before writing anything."""
    from engine.config import RayConfig
    from tuning.plan import check_trial_fits

    with pytest.raises(ConfigError, match=r"one trial needs 2.5 CPUs .* has 2"):
        check_trial_fits(RayConfig(num_workers=2, num_cpus_per_worker=1.0), 0.5)
    check_trial_fits(RayConfig(num_workers=2, num_cpus_per_worker=0.5), 0.5)  # fits: 1.5


def test_a_trial_row_keeps_the_engines_per_round_clip_norm() -> None:
    """Under adaptive clipping the engine's ``clip_norm`` is C_t; the sampled
    ``privacy.clip_norm`` (column ``clip_norm``) is only C_0 and must not overwrite it."""
    from tuning.trial import round_record

    row = {"round": 2, "clip_norm": 0.123, "test_accuracy": 0.5}
    out = round_record(row, {"trial_seed": 7}, "t0", {"clip_norm": 0.137, "lr": 0.1})
    assert out["clip_norm"] == 0.123 and out["lr"] == 0.1
    assert out["trial_id"] == "t0" and out["trial_seed"] == 7 and out["round"] == 2
