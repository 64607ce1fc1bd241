"""Every output column says whether it is private.

The column reference (``docs/reference/columns.md``) is the contract: each column is
listed with "public?" yes/no, and a column is non-public exactly when its name ends in
``_nonprivate``. Runs of several recipes and options must produce only documented
columns.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.config import load_config
from engine.simulation import simulate
from engine.telemetry.metrics import round_metrics

COLUMNS = Path(__file__).resolve().parents[2] / "docs" / "reference" / "columns.md"
HEADER = "| column | meaning | public? |"


def documented_columns(section: str | None = None) -> dict[str, bool]:
    """``{column: public}`` from the column reference's three-column tables: all of
    them, or those under the ``## `` heading starting with ``section``."""
    text = COLUMNS.read_text(encoding="utf-8")
    out: dict[str, bool] = {}
    heading = ""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("## "):
            heading = line[3:]
        if line != HEADER or (section is not None and not heading.startswith(section)):
            continue
        for row in lines[i + 2 :]:
            if not row.startswith("|"):
                break
            cells = [c.strip() for c in row.strip("|").split("|")]
            assert cells[-1].startswith(("yes", "no")), row
            for name in re.findall(r"`([a-z0-9_]+)`", cells[0]):
                assert out.get(name, cells[-1].startswith("yes")) == cells[-1].startswith("yes")
                out[name] = cells[-1].startswith("yes")
    return out


def test_documented_columns_follow_the_suffix_rule() -> None:
    cols = documented_columns()
    assert len(cols) > 30
    for name, public in cols.items():
        assert public != name.endswith("_nonprivate"), name
    # Computed from clients' data or private computation.
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
    cols = documented_columns("One row per round")
    undocumented = set(res.rounds.columns) - set(cols)
    assert not undocumented, f"columns missing from docs/reference/columns.md: {undocumented}"


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
