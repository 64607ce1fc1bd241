"""Bad inputs, as a new user types them: every one is refused by the real CLI
(``engine.cli.main`` in process; the read-only mount through ``python -m engine.cli``)
with the four properties of issue 47:

1. exit status 2;
2. exactly one line on stderr, ``dpfl: error: ...``, naming the bad key, flag or value
   (and no traceback);
3. nothing written: the MD5 of every file under the working folder is the same before
   and after, and no file or folder was added (nor was Ray started);
4. within :data:`LIMIT_S` seconds (generous: the machine is shared), the engine's
   heavy modules imported beforehand (the whole-process times of the slow refusals are
   measured in ``test_read_only_mount`` and reported in the closing note). Refusals
   come before Ray starts and, where no torch is needed, before torch is imported.

The table covers ``run``, ``compare``, ``tune``, ``privacy``, ``report`` and ``config``:
the cases issue 47 lists (tracebacks, hangs, silent surprises and the eight refusals
that took 14-16 s), then a user's typos in keys, flags, values and files. Generated
families add, for every config key, a misspelling of its name and, for every key of
its type, an empty string or a non-finite number. With ``DPFL_BAD_INPUT_TIMES=FILE``
the measured time of each case is written to FILE (JSON).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from engine.cli import main

ROOT = Path(__file__).resolve().parents[2]
#: A refusal's time bound (seconds), generous for a shared machine.
LIMIT_S = 30.0
SMALL = ["--set", "dataset.num_clients=40", "--set", "rounds=2"]
WARM = ["dataset.num_clients=40", "rounds=2"]
TIMES: dict[str, float] = {}


def _hashes(root: Path) -> dict[str, str]:
    """Every path under ``root``: the MD5 of a file, ``dir`` for a folder."""
    return {
        str(p.relative_to(root)): hashlib.md5(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture(scope="module", autouse=True)
def _write_times():
    """The engine's heavy modules imported first (untimed: the bound is on the command,
    not on a first import under whatever load the machine has); the times written at
    the end when asked."""
    from engine.config import load_config
    from engine.simulation import prepare

    prepare(load_config(overrides=[*WARM, "ray.executor=local"]))  # torch, dp-accounting, data
    yield
    target = os.environ.get("DPFL_BAD_INPUT_TIMES")
    if target:
        Path(target).write_text(json.dumps(TIMES, indent=1, sort_keys=True))


@pytest.fixture
def bare(tmp_path: Path, monkeypatch) -> Path:
    """An empty current folder: whatever a refused command wrote would show."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch) -> Path:
    """The current folder, holding the inputs the cases name; results would land here."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "latin1.yaml").write_bytes(b"rounds: 3  # caf\xe9\n")
    (tmp_path / "folder.yaml").mkdir()
    (tmp_path / "typo.yaml").write_text("dataset:\n  num_client: 40\n")
    (tmp_path / "typo_section.yaml").write_text("privcy:\n  epsilon: 2\n")
    space = "tune:\n  space:\n    all:\n"
    (tmp_path / "null_space.yaml").write_text(
        space
        + "".join(f"      {k}: null\n" for k in ("privacy.clip_norm", "local.lr", "local.epochs"))
    )
    (tmp_path / "space_typo.yaml").write_text(
        space + "      local.lrr: {type: uniform, low: 0.1, high: 0.2}\n"
    )
    (tmp_path / "tune_typo.yaml").write_text("tune:\n  spce: {}\n")
    cifar = tmp_path / "cifar" / "cifar-10-batches-py"
    cifar.mkdir(parents=True)
    pickled = tmp_path / "cifar_body" / "cifar-10-batches-py"
    pickled.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (cifar / name).write_bytes(b"garbage, not a pickle\n" * 4)
        (pickled / name).write_bytes(b"\x80\x04garbage" * 4)  # a pickle's header, no body
    mnist = tmp_path / "mnist" / "MNIST" / "raw"
    mnist.mkdir(parents=True)
    gz = tmp_path / "mnist_gz" / "MNIST" / "raw"
    gz.mkdir(parents=True)
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"):
        for split in ("", "t10k"):
            fname = name.replace("train", split) if split else name
            (mnist / fname).write_bytes(b"\x00\x00\x09\x03" + b"\x00" * 12)  # not uint8 IDX
            (gz / f"{fname}.gz").write_bytes(b"not gzip")
    (tmp_path / "svhn").mkdir()
    for name in ("train_32x32.mat", "test_32x32.mat"):
        (tmp_path / "svhn" / name).write_bytes(b"<html>not found</html>")
    for split in ("train", "test"):
        (tmp_path / "leaf" / split).mkdir(parents=True)
        (tmp_path / "leaf" / split / "all_data_0.json").write_text("users: [a]\n")
    (tmp_path / "emptyroot").mkdir()
    (tmp_path / "afile").write_text("a file, not a folder")
    old = tmp_path / "old"
    old.mkdir()
    (old / "rounds.parquet").write_bytes(b"precious")
    cmp_dir = tmp_path / "cmp"
    cmp_dir.mkdir()
    pd.DataFrame({"algorithm": ["dp_fedavg"]}).to_parquet(cmp_dir / "compare.parquet")
    exp = tmp_path / "exp"
    (exp / "rounds").mkdir(parents=True)
    (exp / "tune").mkdir()
    pd.DataFrame(
        {"trial_id": ["a"], "final_test_accuracy": [0.5], "best_test_accuracy": [0.5]}
    ).to_parquet(exp / "trials.parquet")
    (tmp_path / "badexp" / "rounds").mkdir(parents=True)
    (tmp_path / "badexp" / "trials.parquet").write_bytes(b"PAR1 truncated")
    return tmp_path


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


#: name -> (argv, words the one line must hold). ``@slow`` marks the eight refusals that
#: took 14-16 s (Ray started before the check) in issue 47.
CASES: dict[str, tuple[list[str], list[str]]] = {
    # ---- run: issue 47's tracebacks, hangs and silent surprises
    "run char_lstm on features": (
        ["run", *SMALL, "--set", "model.name=char_lstm"],
        ["model.name='char_lstm'", "dataset.name='synthetic'"],
    ),
    "run char_lstm on images": (
        ["run", *SMALL, "--set", "model.name=char_lstm", "--set", "dataset.name=digits"],
        ["model.name", "char_lstm", "digits"],
    ),
    "run cifar10 files that are no pickles": (
        ["run", *SMALL, "--set", "dataset.name=cifar10", "--set", "dataset.root=cifar"],
        ["dataset.name=cifar10", "data_batch_1", "CIFAR python pickle"],
    ),
    "run cifar10 pickles cut short": (
        ["run", *SMALL, "--set", "dataset.name=cifar10", "--set", "dataset.root=cifar_body"],
        ["dataset.name=cifar10", "cannot read", "cifar_body"],
    ),
    "run mnist files that are no IDX": (
        ["run", *SMALL, "--set", "dataset.name=mnist", "--set", "dataset.root=mnist"],
        ["dataset.name=mnist", "train-images-idx3-ubyte", "IDX"],
    ),
    "run mnist .gz that is no gzip": (
        ["run", *SMALL, "--set", "dataset.name=mnist", "--set", "dataset.root=mnist_gz"],
        ["train-images-idx3-ubyte.gz", "gzip"],
    ),
    "run svhn files that are no .mat": (
        ["run", *SMALL, "--set", "dataset.name=svhn", "--set", "dataset.root=svhn"],
        ["dataset.name=svhn", "train_32x32.mat", "MATLAB"],
    ),
    "run femnist files that are no JSON": (
        ["run", *SMALL, "--set", "dataset.name=femnist", "--set", "dataset.root=leaf"]
        + ["--set", "dataset.partition=natural"],
        ["dataset.name=femnist", "all_data_0.json", "JSON"],
    ),
    "run worker_device=cuda without a GPU": (
        ["run", *SMALL, "--set", "ray.worker_device=cuda"],
        ["ray.worker_device=cuda", "torch.cuda.is_available() is False"],
    ),
    "run ray.address nothing listens at": (
        ["run", *SMALL, "--set", "ray.address=127.0.0.1:1"],
        ["ray.address='127.0.0.1:1'", "no Ray cluster answers"],
    ),
    "run ray.address not host:port": (
        ["run", *SMALL, "--set", "ray.address=my-cluster"],
        ["ray.address='my-cluster'", "host:port"],
    ),
    "run object store below Ray's minimum": (
        ["run", *SMALL, "--set", "ray.object_store_memory_mb=1"],
        ["ray.object_store_memory_mb=1", "78,643,200 bytes"],
    ),
    "run object store beside an address": (
        ["run", *SMALL, "--set", "ray.object_store_memory_mb=100"]
        + ["--set", "ray.address=127.0.0.1:1"],
        ["ray.object_store_memory_mb=100", "ray.address"],
    ),
    "run config not UTF-8": (["run", "--config", "latin1.yaml"], ["latin1.yaml", "UTF-8"]),
    "run config is a folder": (["run", "--config", "folder.yaml"], ["folder.yaml", "folder"]),
    "run config empty name": (["run", "--config", ""], ["--config=''"]),
    "run --out empty": (["run", *SMALL, "--out", ""], ["--out=''", "empty"]),
    "run --out and --set out": (
        ["run", *SMALL, "--out", "A", "--set", "out=B"],
        ["--out='A'", "out='B'"],
    ),
    "run --seeds empty item": (["run", *SMALL, "--seeds", "1,,2"], ["--seeds='1,,2'", "empty"]),
    "run --seeds empty": (["run", *SMALL, "--seeds", ""], ["--seeds=''", "empty"]),
    "run --seeds with seed": (
        ["run", *SMALL, "--seeds", "1,2", "--set", "seed=3"],
        ["--seeds='1,2'", "seed=3"],
    ),
    "run --executor against ray.executor": (
        ["run", *SMALL, "--executor", "local", "--set", "ray.executor=ray"],
        ["--executor=local", "ray.executor='ray'"],
    ),
    "run personal head is the whole model": (
        ["run", *SMALL, "--set", "algorithm=dp2_fedsam", "--set", "model.name=logreg"],
        ["algorithm=dp2_fedsam", "model.name=logreg"],
    ),
    # ---- run: the eight refusals that waited for Ray (issue 47: 14-16 s each)
    "@slow run unreachable epsilon": (
        ["run", *SMALL, "--set", "privacy.epsilon=1e-9"],
        ["privacy.epsilon=1e-09", "unreachable"],
    ),
    "@slow run dp_ftrl with secure noise": (
        ["run", *SMALL, "--set", "algorithm=dp_ftrl", "--set", "privacy.secure_noise=true"],
        ["privacy.secure_noise=True", "dp_ftrl"],
    ),
    "@slow run mnist root without files": (
        ["run", *SMALL, "--set", "dataset.name=mnist", "--set", "dataset.root=nothere"],
        ["dataset.name=mnist", "missing", "nothere"],
    ),
    "@slow run cifar10 root empty": (
        ["run", *SMALL, "--set", "dataset.name=cifar10", "--set", "dataset.root=emptyroot"],
        ["dataset.name=cifar10", "missing", "emptyroot"],
    ),
    "@slow run mnist root unset": (
        ["run", *SMALL, "--set", "dataset.name=mnist"],
        ["dataset.name=mnist", "dataset.root is not set"],
    ),
    "@slow run top-k with a public mask": (
        ["run", *SMALL, "--set", "algorithm=custom", "--set", "recipe.client_transforms=topk"]
        + ["--set", "recipe.noise_support=public_mask"],
        ["noise", "not public"],
    ),
    "@slow run --out under a file": (["run", *SMALL, "--out", "afile/run"], ["afile", "a file"]),
    # (the eighth, --out on a read-only mount: test_read_only_mount below)
    # ---- run: typos in keys, flags, values and files
    "run key typo": (
        ["run", "--set", "privacy.epsilom=2"],
        ["privacy.epsilom", "did you mean privacy.epsilon?"],
    ),
    "run section typo": (["run", "--set", "privcy.epsilon=2"], ["privcy", "did you mean privacy?"]),
    "run key typo in file": (
        ["run", "--config", "typo.yaml"],
        ["dataset.num_client", "did you mean dataset.num_clients?"],
    ),
    "run section typo in file": (["run", "--config", "typo_section.yaml"], ["privcy"]),
    "run flag typo": (["run", "--ovewrite"], ["--ovewrite", "did you mean --overwrite?"]),
    "run value typo model": (["run", "--set", "model.name=cnnn"], ["model.name='cnnn'"]),
    "run value typo algorithm": (
        ["run", "--set", "algorithm=dp_fedavgg"],
        ["algorithm='dp_fedavgg'"],
    ),
    "run value typo dataset": (["run", "--set", "dataset.name=mnits"], ["dataset.name='mnits'"]),
    "run value typo executor": (["run", "--executor", "rey"], ["--executor", "'rey'"]),
    "run value typo number": (["run", "--set", "rounds=1O"], ["rounds='1O'"]),
    "run --set without =": (["run", "--set", "rounds"], ["--set 'rounds'", "key=value"]),
    "run --set empty key": (["run", "--set", "=3"], ["--set", "empty"]),
    "run --set empty part": (["run", "--set", "privacy..epsilon=2"], ["privacy..epsilon"]),
    "run empty string value": (["run", "--set", "dataset.root="], ["dataset.root=''", "empty"]),
    "run empty list item": (
        ["run", "--set", "algorithm=custom", "--set", "recipe.client_transforms=randk,,topk"],
        ["recipe.client_transforms", "empty item"],
    ),
    "run NaN learning rate": (["run", "--set", "local.lr=nan"], ["local.lr", "nan"]),
    "run NaN clip": (["run", "--set", "privacy.clip_norm=nan"], ["privacy.clip_norm"]),
    "run infinite clip with noise": (
        ["run", "--set", "privacy.clip_norm=inf"],
        ["privacy.clip_norm=inf", "noise_multiplier=0"],
    ),
    "run negative synthetic alpha": (
        ["run", "--set", "dataset.synthetic_alpha=-1"],
        ["dataset.synthetic_alpha=-1.0"],
    ),
    "run zero rounds": (["run", "--set", "rounds=0"], ["rounds=0"]),
    "run sampling rate above 1": (["run", "--set", "sampling.rate=1.5"], ["sampling.rate=1.5"]),
    "run resume nothing": (["run", "--resume", "nothere"], ["--resume nothere"]),
    "run resume empty": (["run", "--resume", ""], ["--resume=''"]),
    "run resume with --set": (
        ["run", "--resume", "old", "--set", "rounds=3"],
        ["--resume old", "--config/--set"],
    ),
    "run overwrite without out": (["run", *SMALL, "--overwrite"], ["--overwrite", "--out"]),
    # ---- compare
    "compare --algorithms empty": (["compare", "--algorithms", ""], ["--algorithms=''"]),
    "compare --algorithms empty item": (
        ["compare", "-a", "dp_fedavg,,fedavg"],
        ["--algorithms='dp_fedavg,,fedavg'", "empty item"],
    ),
    "compare --algorithms typo": (["compare", "-a", "dp_fedav"], ["dp_fedav"]),
    "compare --epsilons empty": (
        ["compare", "-a", "dp_fedavg", "--epsilons", ""],
        ["--epsilons=''", "empty"],
    ),
    "compare --epsilons empty item": (
        ["compare", "-a", "dp_fedavg", "--epsilons", "1,,2"],
        ["--epsilons='1,,2'"],
    ),
    "compare --epsilons not numbers": (
        ["compare", "-a", "dp_fedavg", "--epsilons", "one"],
        ["--epsilons='one'"],
    ),
    "compare --seeds empty": (["compare", "--seeds", ""], ["--seeds=''"]),
    "compare --out empty": (["compare", "--out", ""], ["--out=''"]),
    "compare --set out": (["compare", "-a", "dp_fedavg", "--set", "out=B"], ["out='B'", "--out"]),
    "compare algorithm key not compared": (
        ["compare", "-a", "dp_fedavg", "--set", "algorithm=fedavg"],
        ["algorithm='fedavg'", "--algorithms"],
    ),
    "compare --epsilons with a budget key": (
        ["compare", "-a", "dp_fedavg", "--epsilons", "1", "--set", "privacy.epsilon=2"],
        ["privacy.epsilon=2", "--epsilons"],
    ),
    "compare --executor against ray.executor": (
        ["compare", "--executor", "ray", "--set", "ray.executor=local"],
        ["--executor=ray", "ray.executor='local'"],
    ),
    "compare model the data cannot take": (
        ["compare", "-a", "dp_fedavg", *SMALL, "--set", "model.name=char_lstm"],
        ["model.name='char_lstm'"],
    ),
    "compare personal head is the whole model": (
        ["compare", "-a", "dp2_fedsam", *SMALL, "--set", "model.name=logreg"],
        ["algorithm=dp2_fedsam", "model.name=logreg"],
    ),
    "compare unreachable address": (
        ["compare", "-a", "dp_fedavg", *SMALL, "--set", "ray.address=127.0.0.1:1"],
        ["ray.address='127.0.0.1:1'"],
    ),
    "compare config not UTF-8": (["compare", "--config", "latin1.yaml"], ["latin1.yaml", "UTF-8"]),
    "compare flag typo": (["compare", "--algoritms", "all"], ["--algoritms", "--algorithms"]),
    # ---- tune
    "tune empty search space": (
        ["tune", "--config", "null_space.yaml", "--num-samples", "2", "--out", "T", *SMALL],
        ["tune.space", "empty", "--num-samples 1"],
    ),
    "tune --epsilons empty": (["tune", "--epsilons", ""], ["--epsilons=''"]),
    "tune --epsilons empty item": (["tune", "--epsilons", "1,,4"], ["--epsilons='1,,4'"]),
    "tune --algorithms empty": (["tune", "--algorithms", ""], ["--algorithms=''"]),
    "tune --out empty": (["tune", "--out", ""], ["--out=''"]),
    "tune budget key": (
        ["tune", "--out", "T", "--set", "privacy.epsilon=2"],
        ["privacy.epsilon=2", "--epsilons"],
    ),
    "tune noise key": (
        ["tune", "--out", "T", "--set", "privacy.noise_multiplier=1"],
        ["privacy.noise_multiplier=1", "--epsilons"],
    ),
    "tune out key": (["tune", "--set", "out=T"], ["out='T'", "--out"]),
    "tune algorithm key not tuned": (
        ["tune", "--out", "T", "--set", "algorithm=fedsam"],
        ["algorithm='fedsam'", "--algorithms"],
    ),
    "tune no samples": (["tune", "--out", "T", "--num-samples", "0"], ["--num-samples=0"]),
    "tune space key typo": (
        ["tune", "--out", "T", "--config", "space_typo.yaml", *SMALL],
        ["local.lrr"],
    ),
    "tune section key typo": (["tune", "--out", "T", "--config", "tune_typo.yaml"], ["tune.spce"]),
    "tune unreachable address": (
        ["tune", "--out", "T", *SMALL, "--set", "ray.address=127.0.0.1:1"],
        ["ray.address='127.0.0.1:1'"],
    ),
    "tune config not UTF-8": (["tune", "--out", "T", "--config", "latin1.yaml"], ["UTF-8"]),
    "tune metric typo": (["tune", "--metric", "test_acuracy"], ["--metric", "test_acuracy"]),
    # ---- privacy
    "privacy epsilon NaN": (
        ["privacy", "--epsilon", "nan", "--sampling-rate", "0.1", "--rounds", "10"],
        ["--epsilon=nan", "finite"],
    ),
    "privacy epsilon infinite": (
        ["privacy", "--epsilon", "inf", "--sampling-rate", "0.1", "--rounds", "10"],
        ["--epsilon=inf"],
    ),
    "privacy negative noise": (
        ["privacy", "--noise-multiplier=-1", "--sampling-rate", "0.1", "--rounds", "10"],
        ["--noise-multiplier=-1"],
    ),
    "privacy cohort and sampling rate": (
        ["privacy", "--epsilon", "4", "--cohort-size", "10", "--num-clients", "100"]
        + ["--sampling-rate", "0.1", "--rounds", "10"],
        ["--cohort-size=10", "--sampling-rate=0.1"],
    ),
    "privacy cohort and max cohort": (
        ["privacy", "--epsilon", "4", "--cohort-size", "10", "--num-clients", "100"]
        + ["--max-cohort", "20", "--rounds", "10"],
        ["--max-cohort=20", "--cohort-size"],
    ),
    "privacy sampling rate zero": (
        ["privacy", "--epsilon", "4", "--sampling-rate", "0", "--rounds", "10"],
        ["--sampling-rate=0"],
    ),
    "privacy sampling rate NaN": (
        ["privacy", "--epsilon", "4", "--sampling-rate", "nan", "--rounds", "10"],
        ["--sampling-rate=nan"],
    ),
    "privacy cohort above population": (
        ["privacy", "--epsilon", "4", "--cohort-size", "500", "--num-clients", "100"]
        + ["--rounds", "10"],
        ["--cohort-size=500", "--num-clients=100"],
    ),
    "privacy delta zero": (
        ["privacy", "--epsilon", "4", "--sampling-rate", "0.1", "--rounds", "10"]
        + ["--delta", "0"],
        ["--delta=0"],
    ),
    "privacy rounds zero": (
        ["privacy", "--epsilon", "4", "--sampling-rate", "0.1", "--rounds", "0"],
        ["--rounds=0"],
    ),
    "privacy pld with fixed cohorts": (
        ["privacy", "--epsilon", "4", "--cohort-size", "10", "--num-clients", "100"]
        + ["--rounds", "10", "--accountant", "pld"],
        ["--accountant=pld"],
    ),
    "privacy flag typo": (
        ["privacy", "--epsilon", "4", "--sampling_rate", "0.1", "--rounds", "10"],
        ["--sampling_rate", "did you mean --sampling-rate?"],
    ),
    "privacy value typo": (
        ["privacy", "--epsilon", "4O", "--sampling-rate", "0.1", "--rounds", "10"],
        ["--epsilon", "'4O'"],
    ),
    # ---- report
    "report empty folder name": (["report", ""], ["DIR=''"]),
    "report no folder": (["report", "nothere"], ["nothere"]),
    "report a compare folder": (["report", "cmp"], ["cmp", "compare"]),
    "report metric typo": (["report", "exp", "--metric", "test_acuracy"], ["test_acuracy"]),
    "report damaged table": (["report", "badexp"], ["badexp/trials.parquet", "damaged"]),
    "report watch interval zero": (
        ["report", "exp", "--watch", "--interval", "0"],
        ["--interval=0"],
    ),
    "report watch interval NaN": (
        ["report", "exp", "--watch", "--interval", "nan"],
        ["--interval=nan"],
    ),
    "report watch iterations zero": (
        ["report", "exp", "--watch", "--iterations", "0"],
        ["--iterations=0"],
    ),
    "report flag typo": (["report", "exp", "--metrc", "x"], ["--metrc", "did you mean --metric?"]),
    # ---- config
    "config key typo": (["config", "--set", "local.epoch=3"], ["local.epoch", "local.epochs"]),
    "config not UTF-8": (["config", "--config", "latin1.yaml"], ["latin1.yaml", "UTF-8"]),
    "config missing file": (["config", "--config", "nope.yaml"], ["nope.yaml"]),
    "config folder": (["config", "--config", "folder.yaml"], ["folder.yaml"]),
    "config bad value": (["config", "--set", "eval.every=0"], ["eval.every=0"]),
    "config flag typo": (["config", "--sett", "rounds=3"], ["--sett", "did you mean --set?"]),
}


def _check_refusal(name: str, argv: list[str], needles: list[str], root: Path, capsys) -> None:
    """Run ``argv`` through ``main``; assert the four properties; record the time."""
    ray = sys.modules.get("ray")
    ray_before = bool(ray is not None and ray.is_initialized())
    before = _hashes(root)
    capsys.readouterr()
    t0 = time.perf_counter()
    try:
        status = main(argv)
    except SystemExit as e:  # argparse refuses a flag or its value this way
        status = e.code
    elapsed = time.perf_counter() - t0
    TIMES[name] = round(elapsed, 3)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert status == 2, (status, captured.err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("dpfl: error: "), captured.err
    assert "Traceback" not in captured.err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert _hashes(root) == before  # nothing created, changed or removed
    ray = sys.modules.get("ray")
    assert bool(ray is not None and ray.is_initialized()) == ray_before  # no Ray started
    assert elapsed < LIMIT_S, elapsed


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_exit_2_nothing_written(name, workdir, capsys) -> None:
    argv, needles = CASES[name]
    if "cuda" in name and _cuda():
        pytest.skip("this machine has a CUDA device: ray.worker_device=cuda is valid here")
    _check_refusal(name, argv, needles, workdir, capsys)


def test_read_only_mount(workdir: Path) -> None:
    """The eighth slow refusal: ``--out`` on a read-only file system (a tmpfs mounted
    read-only in a private mount namespace, so root is refused too), through the
    ``dpfl`` entry point: status 2, one line, nothing written, no Ray, in time."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs unshare and root to mount a read-only file system")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("no mount namespace here")
    (workdir / "ro").mkdir()
    before = _hashes(workdir)
    script = 'mount -t tmpfs -o ro tmpfs ro && exec "$@"'
    cmd = ["unshare", "-m", "sh", "-c", script, "sh", sys.executable, "-m", "engine.cli"]
    cmd += ["run", *SMALL, "--out", "ro/run"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, env=env, timeout=120)
    elapsed = time.perf_counter() - t0
    TIMES["@slow run --out on a read-only mount (process)"] = round(elapsed, 3)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith("dpfl: error: --out='ro/run'"), lines
    assert "read-only file system" in lines[0] and "Traceback" not in done.stderr
    assert done.stdout == ""
    assert _hashes(workdir) == before
    assert elapsed < LIMIT_S, elapsed


# ---------------------------------------------------------------- generated families


def _config_keys() -> dict[str, str]:
    """Every config key with the name of its type (``float``, ``str``, ...)."""
    import typing

    from engine.config import RunConfig
    from engine.config.algo import algo_config_class
    from engine.config.doc import config_keys
    from engine.config.loading import _section_types

    out = {}
    for key in config_keys():
        cls: typing.Any = RunConfig
        parts = key.split(".")
        for part in parts[:-1]:
            cls = algo_config_class() if part == "algo" else _section_types(cls)[part]
        tp = _section_types(cls)[parts[-1]]
        args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        out[key] = getattr(args[0], "__name__", str(args[0]))
    return out


KEYS = _config_keys()


def _misspelled(key: str) -> str:
    """The key with its last part's first two letters after its first swapped
    (``local.epochs`` -> ``local.eopchs``), or a letter doubled where that is no change."""
    head, _, last = key.rpartition(".")
    typo = last[0] + last[2] + last[1] + last[3:] if len(last) > 3 else last + last[-1]
    if typo == last:
        typo = last + last[-1]
    return f"{head}.{typo}" if head else typo


@pytest.mark.parametrize("key", sorted(KEYS))
def test_every_key_misspelled_is_refused_naming_it(key, bare, capsys) -> None:
    """A user's typo in any key: refused naming the misspelled key (and, for keys of
    four letters or more, suggesting the intended one)."""
    typo = _misspelled(key)
    needles = [typo]
    if len(key.rpartition(".")[2]) > 3:
        needles.append(f"did you mean {key}?")
    _check_refusal(f"typo {key}", ["config", "--set", f"{typo}=1"], needles, bare, capsys)


BAD_BY_TYPE = {"float": ["nan", "inf"], "str": [""], "int": ["x"], "bool": ["maybe"]}


@pytest.mark.parametrize(
    ("key", "value"),
    [
        (k, v)
        for k, t in sorted(KEYS.items())
        for v in BAD_BY_TYPE.get(t, [])
        if not (k in ("privacy.epsilon", "privacy.clip_norm") and v == "inf")  # cases above
    ],
)
def test_every_key_refuses_a_value_of_no_meaning(key, value, bare, capsys) -> None:
    """Every float key refuses NaN and infinity (but privacy.epsilon and
    privacy.clip_norm, whose infinity the cases above cover), every string key the empty
    string, every integer key a word, every boolean key a non-boolean: one line naming
    it."""
    argv = ["config", "--set", f"{key}={value}"]
    _check_refusal(f"value {key}={value!r}", argv, [key], bare, capsys)


@pytest.mark.parametrize("out", [None, "named"])
def test_a_run_refused_after_its_folder_was_claimed_leaves_no_folder(
    out, bare: Path, capsys, monkeypatch
) -> None:
    """A refusal that comes only once the folder is claimed (here: the executor's start,
    e.g. a cluster gone between the check and the start) removes the folder the command
    created, with its config.json and ray.log: a refused run leaves nothing."""
    import engine.simulation.runner as runner
    from engine.config import ConfigError

    def refuse(*args, **kwargs):
        raise ConfigError("ray.address='x:1': no Ray cluster answers (simulated)")

    monkeypatch.setattr(runner, "make_executor", refuse)
    argv = ["run", "-q", "--executor", "local", *SMALL] + (["--out", out] if out else [])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["dpfl: error: ray.address='x:1': no Ray cluster answers (simulated)"]
    assert list(bare.iterdir()) == []  # no results/ (nor its parent), no named folder
