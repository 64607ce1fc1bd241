"""Issue 13 items 3 and 8: every output column says whether it is private.

The README's Results table is the contract: each column is listed with "public?"
yes/no, and a column is non-public exactly when its name ends in ``_nonprivate``.
Runs of several recipes and options must produce only documented columns.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.config import load_config
from engine.simulation import simulate
from engine.telemetry.metrics import round_metrics

README = Path(__file__).resolve().parents[2] / "README.md"


def documented_columns() -> dict[str, bool]:
    """``{column: public}`` from the README's three-column Results table."""
    text = README.read_text(encoding="utf-8")
    start = text.index("| column | meaning | public? |")
    out: dict[str, bool] = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        public = cells[-1].startswith("yes")
        assert cells[-1].startswith(("yes", "no")), line
        for name in re.findall(r"`([a-z0-9_]+)`", cells[0]):
            out[name] = public
    return out


def test_documented_columns_follow_the_suffix_rule() -> None:
    cols = documented_columns()
    assert len(cols) > 30
    for name, public in cols.items():
        assert public != name.endswith("_nonprivate"), name
    # The columns issue 13 names: computed from clients' data or private computation.
    for name in (
        "personal_accuracy_nonprivate",
        "mia_auc_nonprivate",
        "wall_time_s_nonprivate",
        "realised_cohort_size_nonprivate",
    ):
        assert cols[name] is False
    assert cols["test_accuracy"] is True  # measured on the public evaluation set


SMALL = [
    "dataset.num_clients=30",
    "dataset.synthetic_mean_samples=12",
    "dataset.synthetic_dim=8",
    "sampling.rate=0.3",
    "rounds=2",
    "eval.every=1",
    "ray.executor=local",
    "local.epochs=1",
    "local.batch_size=8",
]


@pytest.mark.parametrize(
    "extra",
    [
        ["algorithm=dp2_fedsam", "eval.membership_inference=true"],
        ["privacy.clip_mode=adaptive"],
        ["eval.audit_canaries=4"],
        ["algorithm=dp_fedpgn_ls", "local.steps=2"],
        ["algorithm=dp_fedsam_topk"],
    ],
)
def test_every_round_column_is_documented_with_its_privacy(extra) -> None:
    res = simulate(load_config(overrides=[*SMALL, *extra]), write=False)
    cols = documented_columns()
    undocumented = set(res.rounds.columns) - set(cols)
    assert not undocumented, f"columns missing from the README's Results table: {undocumented}"


def test_live_metrics_label_side_channels() -> None:
    """Updates/s carries the realised (private) cohort size; timings carry the timing
    of private computation: both gauges are named ``*_nonprivate``."""
    row = {"epsilon": 1.0, "test_accuracy": 0.5, "realised_cohort_size_nonprivate": 7}
    names = set(round_metrics({**row, "clipped_fraction_nonprivate": 0.1}, 2.0))
    assert names == {
        "epsilon_spent",
        "test_accuracy",
        "client_updates_per_second_nonprivate",
        "seconds_per_round_nonprivate",
        "clipped_fraction_nonprivate",
    }
