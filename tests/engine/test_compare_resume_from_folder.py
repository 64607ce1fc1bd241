"""``dpfl compare --resume DIR`` takes its settings from ``DIR/compare.json`` (issue 48
item 3): no flag needed, the result equals an uninterrupted comparison, and a flag given
again that differs is refused naming it."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from engine.cli import main

SETTINGS = [
    "dataset.num_clients=30",
    "dataset.synthetic_mean_samples=16",
    "dataset.synthetic_dim=10",
    "sampling.rate=0.3",
    "rounds=3",
    "eval.every=1",
    "ray.executor=local",
    "local.epochs=1",
    "local.batch_size=8",
    "privacy.noise_multiplier=1.0",
]
COMPARE = ["compare", "-q", "-a", "dp_fedavg,fedavg", "--seeds", "0,1"]
for _s in SETTINGS:
    COMPARE += ["--set", _s]


class Crash(BaseException):
    """The driver dies (no handler in the engine catches a BaseException)."""


def test_compare_resumes_from_its_folder_alone(tmp_path, capsys) -> None:
    import engine.simulation as sim

    full, stopped = tmp_path / "full", tmp_path / "stopped"
    assert main([*COMPARE, "--out", str(full)]) == 0
    record = json.loads((full / "compare.json").read_text())
    assert record["algorithms"] == ["dp_fedavg", "fedavg"] and record["seeds"] == [0, 1]
    real = sim.simulate

    def dying(config, **kw):  # seed 1's fedavg dies after its second round
        if config.algorithm != "fedavg" or config.seed != 1:
            return real(config, **kw)

        def on_round(row: dict, _executor) -> None:
            if int(row["round"]) == 2:
                raise Crash

        return real(config, on_round=on_round, **kw)

    sim.simulate = dying
    try:
        with pytest.raises(Crash):
            main([*COMPARE, "--out", str(stopped)])
    finally:
        sim.simulate = real
    capsys.readouterr()
    # a flag that differs from the folder's is refused, naming it; nothing is written
    assert main(["compare", "--resume", str(stopped), "--seeds", "0,1,2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--seeds=[0, 1, 2]" in err and "[0, 1]" in err
    assert main(["compare", "--resume", str(stopped), "-a", "dp_fedavg"]) == 2
    assert "--algorithms='dp_fedavg'" in capsys.readouterr().err
    # no other flag: the folder's settings; finished runs kept, the stopped one continues
    assert main(["compare", "-q", "--resume", str(stopped)]) == 0
    got = pd.read_parquet(stopped / "compare.parquet")
    want = pd.read_parquet(full / "compare.parquet")
    cols = [c for c in want.columns if c != "wall_time_s_nonprivate"]
    pd.testing.assert_frame_equal(got[cols], want[cols], check_exact=True)
    # the same flags again are accepted
    assert main([*COMPARE, "--resume", str(stopped)]) == 0
