"""``dpfl submit``: run a dpfl command as a Ray job on a running cluster.

::

    dpfl submit [--address URL] [--working-dir DIR] [--no-wait] [--install-deps] \\
                -- dpfl tune ...

The command after ``--`` (the *entrypoint*) is submitted with Ray's Jobs API
(:class:`ray.job_submission.JobSubmissionClient`) to the cluster's dashboard, its
output is streamed here, and the exit status is 0 when the job SUCCEEDED and 1 when
it FAILED or was STOPPED; Ctrl-C stops the job. ``--no-wait`` prints the job id and
returns at once.

How the project gets onto the cluster. ``--working-dir`` (default: the current
folder, normally the repository root) is uploaded as the job's ``working_dir``
runtime environment, minus :data:`EXCLUDES`. Ray makes it the current directory of
the job's driver and puts it on ``PYTHONPATH`` for the driver and for every task and
actor of the job on every node, so the uploaded ``engine``, ``algorithms`` and
``tuning`` packages are the ones that run, even where an older dpfl is installed.
A ``dpfl ...`` entrypoint is therefore run as ``python -m engine.cli ...``: that
needs no ``dpfl`` executable on the cluster, only the project's dependencies (torch,
dp-accounting, ... — the launcher file in ``cluster/`` installs them). Where the
cluster's image lacks them (a stock ``rayproject/ray`` image on KubeRay),
``--install-deps`` adds a ``pip`` runtime environment with dpfl's dependencies from
the working dir's ``pyproject.toml`` (Ray excluded); Ray builds it once per node.

Checks before anything is sent (each fails with exit status 2 and one line naming
the value): the entrypoint is non-empty and starts with ``dpfl`` or ``python``; a
``dpfl`` entrypoint parses with dpfl's own argument parser and its configuration
(``--config`` file, ``--set`` overrides, ``--algorithms``, ``--epsilons``) is valid;
its results folder (``--out``, or ``out`` of ``run``) is an
absolute path — a relative one would land in the job's temporary copy of the
working dir, which Ray deletes; and the dashboard address answers.

Inside a job Ray sets ``RAY_ADDRESS`` for the driver, and ``run`` / ``compare`` /
``tune`` must attach to that cluster instead of starting their own Ray, so
``--set ray.address=auto`` is appended to their arguments unless the entrypoint
sets ``ray.address`` itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import logging
import os
import re
import shlex
import socket
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

from engine.config import ConfigError

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
#: Paths of the working dir that are not uploaded (Ray also honours .gitignore).
EXCLUDES = [
    ".git",
    ".venv",
    "venv",
    "results",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    "*.pyc",
    ".pytest_cache",
    ".ruff_cache",
    ".mypy_cache",
    ".hypothesis",
    ".benchmarks",
]
CONNECT_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 60.0
POLL_S = 0.5
EXIT_STATUS = {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 1}
#: dpfl commands that start or attach Ray and accept ``--set``.
RAY_COMMANDS = ("run", "compare", "tune")
_PYTHON = re.compile(r"python(3(\.\d+)?)?$")
#: Ray loggers that report each upload and websocket step at INFO; quieted to WARNING.
_CHATTY = (
    "ray._private.runtime_env.packaging",
    "ray.dashboard.modules.dashboard_sdk",
    "ray.dashboard.modules.job.sdk",
)


def _address_source(address: str | None) -> str:
    """Where the address came from, for error messages."""
    return "--address" if address else "RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") else "address"


def resolve_address(address: str | None) -> str:
    """The dashboard URL to submit to: ``address``, else ``$RAY_ADDRESS``, else
    :data:`DEFAULT_ADDRESS`. ``host:port`` without a scheme means ``http://host:port``."""
    flag = _address_source(address)
    value = (address or os.environ.get("RAY_ADDRESS") or DEFAULT_ADDRESS).strip().rstrip("/")
    if "://" not in value:
        value = f"http://{value}"
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"{flag}={value!r}: give the Ray dashboard's HTTP address, e.g. http://HEAD:8265"
        )
    try:
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        raise ConfigError(f"{flag}={value!r}: bad port") from None
    return value


def check_reachable(url: str, timeout: float = CONNECT_TIMEOUT_S, flag: str = "--address") -> None:
    """Fail fast (ConfigError naming ``url``) when nothing listens at the address."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname, port), timeout=timeout):
            pass
    except OSError as e:
        raise ConfigError(
            f"{flag}={url!r}: cannot reach a Ray dashboard there ({e.strerror or e}); "
            "is the cluster up and the port forwarded?"
        ) from None


def _parse_dpfl(args: list[str]) -> argparse.Namespace:
    """Parse ``dpfl ARGS`` with dpfl's own parser; its error becomes one ConfigError line."""
    from engine.cli.parser import build_parser

    text = shlex.join(["dpfl", *args])
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return build_parser().parse_args(args)
    except SystemExit as e:
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        reason = lines[-1] if lines and e.code else "asks only for help; run it locally"
        raise ConfigError(f"entrypoint {text!r}: {reason}") from None


def _config_path(path: str | None, working_dir: Path) -> str | None:
    """A ``--config`` file as the job will see it (relative to the working dir)."""
    if path is None or Path(path).is_absolute():
        return path  # an absolute path must exist on the cluster; it cannot be checked here
    local = working_dir / path
    if not local.is_file():
        raise ConfigError(
            f"--config={path!r}: no such file in --working-dir={str(working_dir)!r} "
            "(the job reads it from the uploaded working dir)"
        )
    return str(local)


def _require_absolute(flag: str, value: str | None) -> None:
    if value is None or not Path(value).is_absolute():
        raise ConfigError(
            f"{flag}={value!r}: give an absolute path on storage every node shares; a "
            "relative path would resolve inside the job's temporary copy of the working "
            "dir, which Ray deletes"
        )


def validate_dpfl_args(args: list[str], working_dir: Path) -> argparse.Namespace:
    """Check a ``dpfl`` entrypoint (its arguments without ``dpfl``) before submitting.

    Parses with :func:`engine.cli.parser.build_parser`, builds the configuration the command
    would build (so unknown keys and bad values fail here, naming the key), and checks
    that results go to an absolute path.
    """
    ns = _parse_dpfl(args)
    if ns.command == "submit":
        raise ConfigError("entrypoint 'dpfl submit ...': a job cannot submit a job")
    if ns.command not in RAY_COMMANDS:
        return ns
    from engine.config import load_config
    from engine.simulation.compare import parse_algorithms

    config_path = _config_path(ns.config, working_dir)
    local_config = config_path is None or Path(config_path).is_file()
    if ns.command == "tune":
        from engine.cli.parser import parse_floats as _floats
        from engine.config import set_path
        from tuning.plan import SMOKE, read_tune_file

        if isinstance(ns.resume, str):  # dpfl tune --resume DIR: the folder is DIR
            _require_absolute("--resume", ns.resume)
        else:
            _require_absolute("--out", ns.out)
        parse_algorithms(ns.algorithms or "dp_fedavg")  # None: the default, or a resume's
        _floats(ns.epsilons or "4", "--epsilons")
        _floats(ns.total_epsilon or "4", "--total-epsilon")
        tree, _ = read_tune_file(config_path) if local_config else ({}, {})
        if ns.smoke_test:
            for key, value in SMOKE.items():
                set_path(tree, key, value)
        load_config(base=tree, overrides=ns.set)
    elif ns.command == "compare":
        from engine.config.presets import read_preset

        _require_absolute("--out", ns.out)
        preset = read_preset(config_path) if config_path and local_config else None
        if preset is not None:  # a paper preset (experiments/*.yaml)
            parse_algorithms(ns.algorithms or ",".join(preset.algorithms), preset.variants)
            load_config(base=preset.tree(ns.scale or "paper"), overrides=ns.set)
        else:
            parse_algorithms(ns.algorithms or "all")
            load_config(config_path if local_config else None, ns.set)
    else:
        config = load_config(config_path if local_config else None, ns.set)
        if ns.out:
            _require_absolute("--out", ns.out)
        elif local_config:  # a config file only the cluster has may set out itself
            _require_absolute("--set out", config.out)
    return ns


def prepare_entrypoint(argv: list[str], working_dir: Path) -> str:
    """Validate the command after ``--`` and return the shell command the job runs."""
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv or not argv[0].strip():
        raise ConfigError(
            "no entrypoint: give the command after --, e.g. "
            "dpfl submit -- dpfl tune --out /shared/exp"
        )
    head = argv[0]
    if head == "dpfl":
        args = list(argv[1:])
        ns = validate_dpfl_args(args, working_dir)
        if ns.command in RAY_COMMANDS and not any(s.startswith("ray.address=") for s in ns.set):
            args += ["--set", "ray.address=auto"]
        return shlex.join(["python", "-m", "engine.cli", *args])
    if _PYTHON.match(Path(head).name):
        return shlex.join(argv)
    raise ConfigError(f"entrypoint {shlex.join(argv)!r}: must start with dpfl or python")


def project_dependencies(working_dir: Path) -> list[str]:
    """dpfl's declared dependencies (``pyproject.toml`` of the working dir), minus Ray:
    the cluster's own Ray must stay the one that runs the job."""
    path = working_dir / "pyproject.toml"
    if not path.is_file():
        raise ConfigError(
            f"--install-deps: no pyproject.toml in --working-dir={str(working_dir)!r}"
        )
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the installed dpfl's metadata
        from importlib.metadata import requires

        deps = [r for r in requires("dpfl") or [] if "extra ==" not in r]
    else:
        deps = list(tomllib.loads(path.read_text())["project"]["dependencies"])
    return [d for d in deps if re.split(r"[\s\[<>=!~;@]", d, maxsplit=1)[0].lower() != "ray"]


def runtime_env(working_dir: Path, install_deps: bool = False) -> dict[str, Any]:
    """The job's runtime environment: the working dir, unbuffered Python output so the
    logs stream as the job prints, and with ``install_deps`` a ``pip`` environment of
    dpfl's dependencies (Ray builds it once per node and reuses it while the list is
    unchanged; it inherits the packages the cluster already has)."""
    env: dict[str, Any] = {
        "working_dir": str(working_dir),
        "excludes": list(EXCLUDES),
        "env_vars": {"PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0"},
    }
    if install_deps:
        env["pip"] = {"packages": project_dependencies(working_dir), "pip_check": False}
    return env


@contextlib.contextmanager
def _without_address_env() -> Iterator[None]:
    """Ray's client lets ``RAY_ADDRESS`` / ``RAY_API_SERVER_ADDRESS`` override the address
    it is given; hide them so the resolved address is the one used."""
    saved = {
        k: os.environ.pop(k) for k in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS") if k in os.environ
    }
    try:
        yield
    finally:
        os.environ.update(saved)


def connect(url: str, flag: str = "--address") -> Any:
    """A JobSubmissionClient for ``url``; ConfigError naming it when that fails."""
    check_reachable(url, flag=flag)
    from ray.job_submission import JobSubmissionClient

    try:
        with _without_address_env():
            return JobSubmissionClient(url)
    except Exception as e:  # ConnectionError, RuntimeError, AuthenticationError, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if type(e).__name__ == "AuthenticationError":
            first += (
                " (a cluster with token authentication needs RAY_AUTH_MODE=token and its "
                "token in RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"
            )
        raise ConfigError(f"{flag}={url!r}: {first}") from None


@contextlib.contextmanager
def _quiet_ray() -> Iterator[None]:
    """Hide Ray's per-step INFO logs and its aiohttp deprecation noise."""
    import ray.job_submission  # noqa: F401 - its modules set their levels on import

    loggers = [logging.getLogger(name) for name in _CHATTY]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


async def _tail(client: Any, job_id: str, out: TextIO, printed: list[int]) -> None:
    async for chunk in client.tail_job_logs(job_id):
        out.write(chunk)
        out.flush()
        printed[0] += len(chunk)


def _poll_logs(client: Any, job_id: str, out: TextIO, printed: int) -> None:
    """Fallback when the log websocket fails: print new log text until the job ends."""
    while True:
        done = client.get_job_status(job_id).is_terminal()
        logs = client.get_job_logs(job_id)
        out.write(logs[printed:])
        out.flush()
        printed = len(logs)
        if done:
            return
        time.sleep(2 * POLL_S)


def wait_terminal(client: Any, job_id: str, timeout: float | None = None) -> str:
    """Poll until the job is in a terminal state; return its name (or the last one)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        status = client.get_job_status(job_id)
        if status.is_terminal() or (deadline is not None and time.monotonic() > deadline):
            return str(status.value)
        time.sleep(POLL_S)


def follow(client: Any, job_id: str, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Stream the job's logs to ``out`` until it ends; 0 if it SUCCEEDED, else 1.

    Ctrl-C stops the job (and waits up to :data:`STOP_TIMEOUT_S` for it to stop).
    """
    printed = [0]  # characters of the log already written
    try:
        try:
            asyncio.run(_tail(client, job_id, out, printed))
        except Exception as e:  # websocket refused or dropped (aiohttp, proxies)
            print(f"dpfl submit: log stream failed ({e}); polling instead", file=err)
            _poll_logs(client, job_id, out, printed[0])
        status = wait_terminal(client, job_id)
    except KeyboardInterrupt:
        print(f"\ndpfl submit: interrupted; stopping job {job_id}", file=err, flush=True)
        client.stop_job(job_id)
        status = wait_terminal(client, job_id, STOP_TIMEOUT_S)
    info = client.get_job_info(job_id)
    message = f": {info.message}" if status != "SUCCEEDED" and info.message else ""
    print(f"dpfl submit: job {job_id} {status}{message}", file=err, flush=True)
    return EXIT_STATUS.get(status, 1)


def submit(
    entrypoint: list[str],
    *,
    address: str | None = None,
    working_dir: str | Path = ".",
    wait: bool = True,
    install_deps: bool = False,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
) -> int:
    """Submit ``entrypoint`` (argv after ``--``) as a Ray job; see the module docstring.

    Returns the exit status: 0 SUCCEEDED (or submitted, with ``wait=False``), 1 FAILED
    or STOPPED. Invalid input or an unreachable address raises ConfigError (exit 2).
    """
    wd = Path(working_dir).expanduser().resolve()
    if not wd.is_dir():
        raise ConfigError(f"--working-dir={str(working_dir)!r}: not a directory")
    command = prepare_entrypoint(list(entrypoint), wd)
    env = runtime_env(wd, install_deps)
    url = resolve_address(address)
    with _quiet_ray():
        client = connect(url, _address_source(address))
        try:
            job_id = client.submit_job(entrypoint=command, runtime_env=env)
        except Exception as e:  # upload or server error: not the user's input
            print(f"dpfl: error: submitting to {url} failed: {e}", file=err)
            return 1
    print(
        f"dpfl submit: job {job_id} on {url} (dashboard: {url}/#/jobs/{job_id})\n"
        f"dpfl submit: entrypoint: {command}",
        file=err,
        flush=True,
    )
    if not wait:
        print(job_id, file=out, flush=True)
        print(
            f"dpfl submit: follow with: ray job logs --follow --address {url} {job_id}",
            file=err,
        )
        return 0
    with _quiet_ray():
        return follow(client, job_id, out, err)
