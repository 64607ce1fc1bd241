"""Config validation: every class of invalid input fails early with the key named."""

from __future__ import annotations

import pytest

from engine.config import ConfigError, RunConfig, config_from_dict, load_config
from engine.simulation import prepare


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["nonsense=1"], "nonsense"),
        (["privacy.nonsense=1"], "privacy.nonsense"),
        (["rounds=abc"], "rounds"),
        (["rounds=1.5"], "rounds"),
        (["privacy.clip_norm=true"], "privacy.clip_norm"),
        (["privacy.clip_norm=0"], "privacy.clip_norm"),
        (["privacy.clip_norm=-2"], "privacy.clip_norm"),
        (["sampling.rate=0"], "sampling.rate"),
        (["sampling.rate=1.5"], "sampling.rate"),
        (["privacy.epsilon=0"], "privacy.epsilon"),
        (["privacy.epsilon=-1"], "privacy.epsilon"),
        (["privacy.delta=0"], "privacy.delta"),
        (["privacy.delta=1"], "privacy.delta"),
        (["sampling.mode=fixed", "sampling.cohort_size=5000"], "sampling.cohort_size"),
        (["sampling.max_cohort=5000"], "sampling.max_cohort"),
        (["privacy.epsilon=4", "privacy.noise_multiplier=1"], "privacy.epsilon"),
        (["dataset.partition=natural", "dataset.name=mnist"], "dataset.partition"),
        (["model.name=transformer"], "model.name"),
        (["algorithm=dp_magic"], "algorithm"),
        (["sampling.max_cohort=50", "privacy.accountant=rdp"], "privacy.accountant"),
        (
            ["sampling.mode=fixed", "sampling.cohort_size=10", "privacy.accountant=pld"],
            "privacy.accountant",
        ),
    ],
)
def test_invalid_values_name_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides)
    msg = str(err.value)
    assert msg.startswith(key), msg
    assert "\n" not in msg


def test_unreachable_epsilon_fails_before_work(tmp_path) -> None:
    cfg = load_config(overrides=["privacy.epsilon=0.0001", "rounds=2000", f"out={tmp_path}/r"])
    with pytest.raises(ConfigError, match=r"^privacy\.epsilon=0\.0001 is unreachable"):
        prepare(cfg)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "name", ["mnist", "fashion_mnist", "emnist", "cifar10", "cifar100", "svhn"]
)
def test_missing_torchvision_files_name_path(tmp_path, name: str) -> None:
    cfg = load_config(overrides=[f"dataset.name={name}", f"dataset.root={tmp_path}"])
    with pytest.raises(ConfigError) as err:
        prepare(cfg)
    assert str(tmp_path) in str(err.value) and "dataset.name" in str(err.value)


@pytest.mark.parametrize("name", ["femnist", "shakespeare"])
def test_missing_leaf_files_name_path(tmp_path, name: str) -> None:
    cfg = load_config(overrides=[f"dataset.name={name}", f"dataset.root={tmp_path}/leaf"])
    with pytest.raises(ConfigError) as err:
        prepare(cfg)
    assert f"{tmp_path}/leaf" in str(err.value) and "LEAF JSON" in str(err.value)


def test_model_must_fit_data() -> None:
    cfg = load_config(overrides=["model.name=cnn", "dataset.num_clients=20"])
    with pytest.raises(ConfigError, match=r"^model\.name='cnn' does not fit"):
        prepare(cfg)


def test_yaml_file_then_overrides(tmp_path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("rounds: 7\nprivacy:\n  clip_norm: 0.3\nlocal:\n  lr: 0.2\n")
    cfg = load_config(f, ["local.lr=0.05", "privacy.delta=1e-5", "ray.address=null"])
    assert cfg.rounds == 7 and cfg.privacy.clip_norm == 0.3
    assert cfg.local.lr == 0.05 and cfg.privacy.delta == 1e-5 and cfg.ray.address is None
    assert cfg.dataset.name == "synthetic"  # untouched default


def test_exactly_one_of_epsilon_and_noise() -> None:
    assert load_config().privacy.epsilon is not None  # default budget
    cfg = load_config(overrides=["privacy.noise_multiplier=1.1"])
    assert cfg.privacy.epsilon is None and cfg.privacy.noise_multiplier == 1.1


def test_round_trip_and_frozen() -> None:
    cfg = load_config(overrides=["seed=3", "sampling.mode=fixed", "sampling.cohort_size=9"])
    assert config_from_dict(cfg.to_dict()) == cfg
    with pytest.raises(AttributeError):
        cfg.seed = 4  # type: ignore[misc]
    assert isinstance(RunConfig(), RunConfig)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algo.rho=-1", "algo.rho=-1.0: must be >= 0"),
        ("algo.beta=2", "algo.beta=2.0: must be in [0, 1]"),
        ("algo.keep_fraction=0", "algo.keep_fraction=0.0: (kept fraction) must be in (0, 1]"),
        ("algo.zero_fraction=1", "algo.zero_fraction=1.0: (zeroed fraction) must be in [0, 1)"),
        ("algo.ls_scope=rows", "algo.ls_scope='rows': must be tensor, model or weights"),
        ("algo.head_steps=0", "algo.head_steps=0: must be >= 1"),
        ("algo.personal_layers=0", "algo.personal_layers=0: must be >= 1"),
        ("algo.noise_site=edge", "algo.noise_site='edge': must be server or client"),
    ],
)
def test_algo_keys_are_checked_by_their_declaration(override: str, message: str) -> None:
    """Each algo.* key's rule and message are declared once, by the piece that reads it
    (algorithms.piece_specs); the config applies that declaration."""
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert str(info.value) == message


def test_every_config_key_has_a_line_of_help() -> None:
    """The generated configuration reference says what every key does."""
    from engine.config.doc import undocumented_keys

    assert undocumented_keys() == []


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("synthetic", None),
        ("digits", "standardize"),
        ("mnist", "unit_interval"),
        ("fashion_mnist", "unit_interval"),
        ("emnist", "unit_interval"),
        ("femnist", "unit_interval"),
        ("cifar10", "standardize"),
    ],
)
def test_null_normalize_is_resolved_to_what_the_loader_applies(name, expected) -> None:
    """``dataset.normalize: null`` is resolved when the config is loaded, so config.json
    records the preprocessing that ran: the same mode each loader applies for null, and
    an explicit choice is kept."""
    from engine.data.torchvision_sources import DEFAULT_NORMALIZE

    cfg = load_config(overrides=[f"dataset.name={name}"])
    assert cfg.dataset.normalize == expected
    assert cfg.to_dict()["dataset"]["normalize"] == expected
    if name in DEFAULT_NORMALIZE:  # the torchvision loader's own default for null
        assert DEFAULT_NORMALIZE[name] == expected
    if name == "digits":  # the digits loader's null is the resolved mode
        from engine.data.digits import load_digits_source

        a, b = load_digits_source(None), load_digits_source(expected)
        assert (a.x_train == b.x_train).all()
    if expected is not None:
        other = "standardize" if expected == "unit_interval" else "unit_interval"
        if name != "femnist":  # femnist's LEAF pixels allow unit_interval only
            explicit = load_config(overrides=[f"dataset.name={name}", f"dataset.normalize={other}"])
            assert explicit.dataset.normalize == other


def test_with_algorithm_resolves_the_held_out_split_for_each_recipe() -> None:
    """A comparison or sweep from a global recipe's config (fraction resolved to 0)
    gives a personalised row its held-out split and back; a chosen fraction is kept."""
    from engine.config import with_algorithm

    base = load_config(overrides=["algorithm=dp_fedavg"])
    assert base.dataset.client_test_fraction == 0.0
    personal = with_algorithm(base, "dp2_fedsam")
    assert personal.dataset.client_test_fraction == 0.2
    assert with_algorithm(personal, "dp_fedavg").dataset.client_test_fraction == 0.0
    chosen = load_config(overrides=["algorithm=dp_fedavg", "dataset.client_test_fraction=0.1"])
    assert with_algorithm(chosen, "dp2_fedsam").dataset.client_test_fraction == 0.1
    assert (
        with_algorithm(
            base, "dp2_fedsam", **{"dataset.client_test_fraction": 0.3}
        ).dataset.client_test_fraction
        == 0.3
    )
