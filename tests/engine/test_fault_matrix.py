"""A damaged run folder: ``dpfl run --resume`` either continues to the uninterrupted
run bit for bit or refuses with one line, never exit 0 with rows missing.

A 4-round run (in-process executor, tiny data) is stopped at chosen points by raising
from the round hooks of ``simulate`` (the state a killed driver leaves: checkpoint
written before its row). Each file of the folder is then truncated, deleted or
replaced with garbage (and a few subtler damages: a row dropped, an older checkpoint)
and the folder is resumed through ``dpfl run --resume``. The oracle is an uninterrupted
run of the same config, computed independently. The checkpoint before the last is kept
beside it (``checkpoint.previous.pkl``): a damaged last checkpoint resumes from it, to
the oracle bit for bit; with both damaged, the resume is refused.
"""

from __future__ import annotations

import json
import math
import pickle
import shutil
from pathlib import Path

import pandas as pd
import pytest

from engine.cli import main
from engine.config import load_config
from engine.simulation import simulate

ROUNDS = 4
RUN = [
    "dataset.num_clients=30",
    "dataset.synthetic_mean_samples=16",
    "dataset.synthetic_dim=10",
    "sampling.rate=0.3",
    f"rounds={ROUNDS}",
    "eval.every=1",
    "ray.executor=local",
    "local.epochs=1",
    "local.batch_size=8",
    "privacy.noise_multiplier=1.0",
]
FILES = ("config.json", "checkpoint.pkl", "rounds.parquet")
PREVIOUS = "checkpoint.previous.pkl"
DAMAGES = ("truncate", "delete", "garbage")
#: Columns that differ between two runs of one config (timing).
TIMING = ("wall_time_s_nonprivate",)


class Crash(BaseException):
    """A driver that dies (BaseException: no handler in the engine catches it)."""


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _crashed(out: Path, *, after_row: int | None = None, before_row: int | None = None) -> None:
    """A run stopped after round ``after_row``'s row was released, or after round
    ``before_row``'s checkpoint but before its row."""

    def on_round(row: dict, _executor) -> None:
        if after_row is not None and int(row["round"]) == after_row:
            raise Crash

    def on_checkpoint(_state: dict, row: dict) -> None:
        if before_row is not None and int(row["round"]) == before_row:
            raise Crash

    with pytest.raises(Crash):
        simulate(
            load_config(overrides=[*RUN, f"out={out}"]),
            on_round=on_round,
            on_checkpoint=on_checkpoint,
        )


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """The uninterrupted run (the oracle) and the stopped runs, each built once."""
    root = tmp_path_factory.mktemp("faults")
    checkpoints: dict[int, bytes] = {}

    def keep(state: dict, row: dict) -> None:
        checkpoints[int(row["round"])] = pickle.dumps(state)

    simulate(load_config(overrides=[*RUN, f"out={root / 'full'}"]), on_checkpoint=keep)
    (root / "checkpoints.pkl").write_bytes(pickle.dumps(checkpoints))
    _crashed(root / "after_row", after_row=2)
    _crashed(root / "before_row", before_row=3)
    _crashed(root / "first_before_row", before_row=1)
    (root / "older_checkpoint").mkdir()  # not a state a crash leaves: tests the check
    shutil.copytree(root / "after_row", root / "older_checkpoint", dirs_exist_ok=True)
    (root / "older_checkpoint" / "checkpoint.pkl").write_bytes(checkpoints[1])
    return {p.name: p for p in root.iterdir()}


def _damage(path: Path, how: str) -> None:
    if how == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif how == "delete":
        path.unlink()
    elif how == "garbage":
        path.write_bytes(b"\x00garbage\xff" * 37)
    elif how == "drop_first_row":
        pd.read_parquet(path).iloc[1:].to_parquet(path, index=False)
    else:  # pragma: no cover
        raise AssertionError(how)


def _resume(folder: Path, capsys) -> tuple[int, list[str], str]:
    capsys.readouterr()
    rc = main(["run", "-q", "--resume", str(folder)])
    captured = capsys.readouterr()
    return rc, captured.err.strip().splitlines(), captured.out


def _assert_equals_oracle(folder: Path, oracle: Path) -> None:
    got = pd.read_parquet(folder / "rounds.parquet")
    want = pd.read_parquet(oracle / "rounds.parquet")
    cols = [c for c in want.columns if c not in TIMING]
    assert list(got["round"]) == list(range(1, ROUNDS + 1))  # none lost, none duplicated
    pd.testing.assert_frame_equal(got[cols], want[cols], check_exact=True)
    got_cfg = json.loads((folder / "config.json").read_text())
    want_cfg = json.loads((oracle / "config.json").read_text())
    assert got_cfg["config"].pop("out") == str(folder)
    want_cfg["config"].pop("out")
    assert got_cfg == want_cfg  # the final ε included
    g = pickle.loads((folder / "checkpoint.pkl").read_bytes())["server"]["weights"]
    w = pickle.loads((oracle / "checkpoint.pkl").read_bytes())["server"]["weights"]
    assert (g == w).all()


def _assert_refused(rc: int, err: list[str], names: str, before: dict, folder: Path) -> None:
    assert rc == 2, err
    assert len(err) == 1 and err[0].startswith("dpfl: error: --resume "), err
    assert names in err[0] and "--overwrite" in err[0], err
    assert "nothing was changed" in err[0]
    assert _tree(folder) == before  # no byte written


STATES = ("after_row", "before_row", "full")


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("how", DAMAGES)
def test_damaged_file_is_refused_naming_it(folders, tmp_path, capsys, state, name, how) -> None:
    """Every damage of a stopped or finished run's files that loses information a
    resume needs (the config, released rows, or the state after them: the last
    checkpoint together with the previous one) is one line naming the file and
    --overwrite, exit 2, nothing written."""
    folder = tmp_path / state
    shutil.copytree(folders[state], folder)
    _damage(folder / name, how)
    if name == "checkpoint.pkl":
        _damage(folder / PREVIOUS, how)
    before = _tree(folder)
    rc, err, _ = _resume(folder, capsys)
    _assert_refused(rc, err, str(folder / name), before, folder)


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("how", DAMAGES)
def test_damaged_last_checkpoint_resumes_from_the_previous(
    folders, tmp_path, capsys, state, how
) -> None:
    """The last checkpoint truncated, deleted or garbage: the resume continues from the
    previous one (one warning line naming both files) and equals the uninterrupted run
    bit for bit, a released round computed again included (after_row, full: the last
    checkpoint's round was released; the seeded run gives it back exactly)."""
    folder = tmp_path / state
    shutil.copytree(folders[state], folder)
    _damage(folder / "checkpoint.pkl", how)
    rc, err, _ = _resume(folder, capsys)
    assert rc == 0 and len(err) == 1, err
    assert err[0].startswith("dpfl: warning: ") and PREVIOUS in err[0], err
    assert str(folder / "checkpoint.pkl") in err[0]
    _assert_equals_oracle(folder, folders["full"])


def test_the_previous_checkpoint_is_the_round_before(folders) -> None:
    """``checkpoint.previous.pkl`` holds exactly the state the round before the last
    handed to its checkpoint (the same bytes), and the last checkpoint the last round's."""
    checkpoints = pickle.loads((folders["checkpoints.pkl"]).read_bytes())
    full = folders["full"]
    assert (full / PREVIOUS).read_bytes() == checkpoints[ROUNDS - 1]
    assert (full / "checkpoint.pkl").read_bytes() == checkpoints[ROUNDS]
    stopped = pickle.loads((folders["after_row"] / PREVIOUS).read_bytes())  # after row 2
    want = pickle.loads(checkpoints[1])  # another run of the config: timing differs
    assert stopped["server"]["rounds_done"] == 1
    assert (stopped["server"]["weights"] == want["server"]["weights"]).all()
    assert not (folders["first_before_row"] / PREVIOUS).exists()  # no round before


def test_release_mode_refuses_to_compute_a_released_round_again(tmp_path, capsys) -> None:
    """Under privacy.secure_noise a round computed again would draw fresh noise (a
    second release the accountant never composed): a damaged last checkpoint whose
    round was released is refused, naming both checkpoints and secure_noise."""
    folder = tmp_path / "secure"
    with pytest.raises(Crash):
        simulate(
            load_config(overrides=[*RUN, "privacy.secure_noise=true", f"out={folder}"]),
            on_round=lambda row, _executor: _raise_at(row, 2),
        )
    _damage(folder / "checkpoint.pkl", "garbage")
    before = _tree(folder)
    rc, err, _ = _resume(folder, capsys)
    _assert_refused(rc, err, str(folder / "checkpoint.pkl"), before, folder)
    assert PREVIOUS in err[0] and "secure_noise" in err[0]


def _raise_at(row: dict, rnd: int) -> None:
    if int(row["round"]) == rnd:
        raise Crash


@pytest.mark.parametrize(
    ("state", "name", "how", "names"),
    [
        # rows 1..2 released, round 1 dropped: the file no longer starts at round 1
        ("after_row", "rounds.parquet", "drop_first_row", "rounds.parquet"),
        # rows 1..2 released but the checkpoint is round 1's: round 2 would be recomputed
        ("older_checkpoint", "rounds.parquet", None, "checkpoint.pkl"),
    ],
)
def test_rows_that_disagree_with_the_checkpoint_are_refused(
    folders, tmp_path, capsys, state, name, how, names
) -> None:
    folder = tmp_path / state
    shutil.copytree(folders[state], folder)
    if how is not None:
        _damage(folder / name, how)
    before = _tree(folder)
    rc, err, _ = _resume(folder, capsys)
    _assert_refused(rc, err, names, before, folder)


@pytest.mark.parametrize("state", ["after_row", "before_row", "first_before_row"])
def test_intact_stopped_run_resumes_bit_identical(folders, tmp_path, capsys, state) -> None:
    """The three points a crash can leave (after a row; between a checkpoint and its
    row; before the first row ever existed), with a stale temporary file beside them:
    the resumed run equals the uninterrupted one in every column but timing."""
    folder = tmp_path / state
    shutil.copytree(folders[state], folder)
    (folder / ".checkpoint.pkl.tmp").write_bytes(b"half a pickle")  # a write cut short
    if state == "first_before_row":
        assert not (folder / "rounds.parquet").exists()
    rc, err, _ = _resume(folder, capsys)
    assert rc == 0 and err == []
    _assert_equals_oracle(folder, folders["full"])


def test_run_that_died_before_its_first_checkpoint_starts_again(folders, tmp_path, capsys) -> None:
    """Only config.json exists (no round ended): the resume starts the run in its folder,
    equal to the uninterrupted run."""
    folder = tmp_path / "no_round"
    folder.mkdir()
    shutil.copy(folders["after_row"] / "config.json", folder / "config.json")
    rc, err, _ = _resume(folder, capsys)
    assert rc == 0 and err == []
    _assert_equals_oracle(folder, folders["full"])


def test_finished_run_is_already_complete_and_untouched(folders, tmp_path, capsys) -> None:
    folder = tmp_path / "full"
    shutil.copytree(folders["full"], folder)
    before = _tree(folder)
    rc, err, out = _resume(folder, capsys)
    assert rc == 0 and err == []
    assert "already complete" in out and "nothing was changed" in out
    rows = pd.read_parquet(folder / "rounds.parquet")
    assert f"final test_accuracy={rows['test_accuracy'].iloc[-1]:.4f}" in out
    assert _tree(folder) == before  # config.json and ray.log not rewritten either


def test_a_folder_of_seeds_names_each_run(folders, tmp_path, capsys) -> None:
    folder = tmp_path / "seeds"
    for s in (0, 1):
        shutil.copytree(folders["after_row"], folder / f"seed{s}")
    rc, err, _ = _resume(folder, capsys)
    assert rc == 2 and len(err) == 1
    assert str(folder / "seed0") in err[0] and str(folder / "seed1") in err[0]


def test_oracle_is_not_trivial(folders) -> None:
    """The stopped runs really lack rounds (so a resume that wrote nothing would fail
    the equality above), and the oracle's ε is finite and grows."""
    assert len(pd.read_parquet(folders["after_row"] / "rounds.parquet")) == 2
    assert len(pd.read_parquet(folders["before_row"] / "rounds.parquet")) == 2
    eps = list(pd.read_parquet(folders["full"] / "rounds.parquet")["epsilon"])
    assert all(math.isfinite(e) for e in eps) and eps == sorted(eps) and eps[0] < eps[-1]


# ------------------------------------------------------------- dpfl compare --resume

COMPARE = ["compare", "-q", "-a", "dp_fedavg,fedavg"]
for _o in RUN:
    COMPARE += ["--set", _o]


@pytest.fixture(scope="module")
def comparisons(tmp_path_factory) -> dict[str, Path]:
    """An uninterrupted comparison, and one whose second run died after round 2."""
    import engine.simulation as sim

    root = tmp_path_factory.mktemp("compare")
    assert main([*COMPARE, "--out", str(root / "full")]) == 0
    real = sim.simulate

    def dying(config, **kw):
        if config.algorithm != "fedavg":
            return real(config, **kw)

        def on_round(row: dict, _executor) -> None:
            if int(row["round"]) == 2:
                raise Crash

        return real(config, on_round=on_round, **kw)

    sim.simulate = dying
    try:
        with pytest.raises(Crash):
            main([*COMPARE, "--out", str(root / "stopped")])
    finally:
        sim.simulate = real
    return {"full": root / "full", "stopped": root / "stopped"}


def test_compare_resume_equals_uninterrupted(comparisons, tmp_path, capsys) -> None:
    folder = tmp_path / "stopped"
    shutil.copytree(comparisons["stopped"], folder)
    finished = _tree(folder / "dp_fedavg")
    assert len(pd.read_parquet(folder / "fedavg" / "rounds.parquet")) == 2
    assert main([*COMPARE, "--out", str(folder), "--resume"]) == 0
    assert _tree(folder / "dp_fedavg") == finished  # read from disk, not run again
    for label in ("dp_fedavg", "fedavg"):
        got = pd.read_parquet(folder / label / "rounds.parquet")
        want = pd.read_parquet(comparisons["full"] / label / "rounds.parquet")
        cols = [c for c in want.columns if c not in TIMING]
        pd.testing.assert_frame_equal(got[cols], want[cols], check_exact=True)
    got = pd.read_parquet(folder / "compare.parquet")
    want = pd.read_parquet(comparisons["full"] / "compare.parquet")
    cols = [c for c in want.columns if c not in TIMING]
    pd.testing.assert_frame_equal(got[cols], want[cols], check_exact=True)


@pytest.mark.parametrize(
    ("extra", "damaged", "needles"),
    [
        ([], "fedavg/rounds.parquet", ["fedavg/rounds.parquet", "damaged", "--overwrite"]),
        ([], "fedavg/checkpoint.pkl", ["fedavg/checkpoint.pkl", "compare --out"]),
        (["--set", "local.lr=0.5"], None, ["local.lr=0.5", "config.json"]),
    ],
)
def test_compare_resume_refuses_in_one_line(
    comparisons, tmp_path, capsys, extra, damaged, needles
) -> None:
    folder = tmp_path / "stopped"
    shutil.copytree(comparisons["stopped"], folder)
    if damaged is not None:
        _damage(folder / damaged, "truncate")
        if damaged.endswith("checkpoint.pkl"):  # and the one before it
            _damage(folder / damaged.replace("checkpoint.pkl", PREVIOUS), "truncate")
    before = _tree(folder)
    capsys.readouterr()
    assert main([*COMPARE, *extra, "--out", str(folder), "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dpfl: error: "), err
    assert all(n in err[0] for n in needles), err
    assert _tree(folder) == before


# ----------------------------------------------------------------- on Ray


@pytest.mark.ray
def test_stopped_run_resumes_on_ray_equal_to_uninterrupted(
    ray_session, folders, tmp_path, capsys
) -> None:
    """The in-process and Ray executors are bit-identical, so a run stopped under one
    continues under the other (``--executor ray``) to the uninterrupted rows."""
    folder = tmp_path / "before_row"
    shutil.copytree(folders["before_row"], folder)
    capsys.readouterr()
    assert main(["run", "-q", "--resume", str(folder), "--executor", "ray"]) == 0
    got = pd.read_parquet(folder / "rounds.parquet")
    want = pd.read_parquet(folders["full"] / "rounds.parquet")
    cols = [c for c in want.columns if c not in TIMING]
    pd.testing.assert_frame_equal(got[cols], want[cols], check_exact=True)
    assert json.loads((folder / "config.json").read_text())["config"]["ray"]["executor"] == "ray"


@pytest.mark.ray
def test_damaged_run_is_refused_before_ray_starts(folders, tmp_path, capsys) -> None:
    import ray

    was_up = ray.is_initialized()
    folder = tmp_path / "after_row"
    shutil.copytree(folders["after_row"], folder)
    _damage(folder / "checkpoint.pkl", "garbage")
    _damage(folder / PREVIOUS, "garbage")
    before = _tree(folder)
    rc, err, _ = _resume_with(folder, capsys, "--executor", "ray")
    _assert_refused(rc, err, str(folder / "checkpoint.pkl"), before, folder)
    assert ray.is_initialized() == was_up  # no Ray was started for a refusal


def _resume_with(folder: Path, capsys, *extra: str) -> tuple[int, list[str], str]:
    capsys.readouterr()
    rc = main(["run", "-q", "--resume", str(folder), *extra])
    captured = capsys.readouterr()
    return rc, captured.err.strip().splitlines(), captured.out
