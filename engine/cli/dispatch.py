"""``dpfl``'s entry point: parse the arguments, run the command's handler, and turn
a user's error (a bad value, invalid YAML, a file-system error naming a path) into one
line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import errno
import os
import sys
import warnings
from pathlib import Path

from engine.base.errors import RunFailed
from engine.cli.common import check_flag_conflicts
from engine.cli.compare import compare_command
from engine.cli.info import algorithms_command, config_command
from engine.cli.parser import COMMANDS, build_parser, parse_args
from engine.cli.privacy import privacy_command
from engine.cli.run import run_command
from engine.cli.tune import leaderboard_command, report_command, tune_command
from engine.config import ConfigError
from engine.runtime.switches import QUIET_ENV


def _submit(args: argparse.Namespace) -> int:
    """``dpfl submit`` (:mod:`engine.cli.submit`, imported only for it)."""
    from engine.cli.submit import submit

    return submit(
        args.entrypoint,
        address=args.address,
        working_dir=args.working_dir,
        wait=not args.no_wait,
        install_deps=args.install_deps,
    )


#: ``dpfl <command>`` -> the function that runs it (the parser lives in engine.cli.parser).
HANDLERS = {
    "run": run_command,
    "privacy": privacy_command,
    "compare": compare_command,
    "tune": tune_command,
    "report": report_command,
    "leaderboard": leaderboard_command,
    "submit": _submit,
    "algorithms": algorithms_command,
    "config": config_command,
}
if tuple(HANDLERS) != COMMANDS:  # every command the parser accepts has a handler
    raise RuntimeError(f"handlers {tuple(HANDLERS)} != commands {COMMANDS}")


def _format_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    line: str | None = None,
) -> str:
    """dpfl's own warnings (raised from a file under the repository's root: engine,
    algorithms, tuning) as one line; others in Python's usual form."""
    root = str(Path(__file__).resolve().parents[2])  # engine/cli/dispatch.py -> the repository
    if str(filename).startswith(root):
        return f"dpfl: warning: {message}\n"
    return warnings._formatwarning_orig(message, category, filename, lineno, line)  # type: ignore[attr-defined]


def _yaml_error(e: Exception, args: argparse.Namespace) -> str:
    """A YAML syntax error as one line naming the file, line and column."""
    mark = getattr(e, "problem_mark", None)
    where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    source = getattr(args, "config", None)
    return f"--config={source!r}: invalid YAML at{where}: {problem}"


#: OSErrors of the file system that are the user's to fix (not dpfl's bugs).
_FS_ERRORS = frozenset(
    getattr(errno, name)
    for name in ("EACCES", "EPERM", "EROFS", "ENOSPC", "EDQUOT", "EFBIG", "ENOTDIR", "EISDIR")
    if hasattr(errno, name)
)


def _os_error(e: OSError, args: argparse.Namespace) -> str | None:
    """One line for a file-system error naming the path (read-only, permission, full
    disk); None for any other OSError (raised as it is). A run stopped by a full disk
    keeps its last checkpoint and rows (writes go through a temporary file), so the
    line says how to continue it."""
    if e.errno is None or e.errno not in _FS_ERRORS or not e.filename:
        return None
    path = Path(str(e.filename))
    line = f"{path}: {e.strerror or os.strerror(e.errno)}"
    folder = next(
        (
            p
            for p in (path, *path.parents)
            if (p / "checkpoint.pkl").is_file() or (p / "config.json").is_file()
        ),
        None,
    )
    if e.errno in (getattr(errno, "ENOSPC", -1), getattr(errno, "EDQUOT", -1)):
        if folder is not None and args.command == "run":
            line += (
                f"; the run stopped at its last complete round: free space, then continue "
                f"with dpfl run --resume {folder}"
            )
        elif args.command == "tune":
            line += "; free space, then continue with dpfl tune --resume --out DIR"
        else:
            line += "; free space and run the command again"
    else:
        line += "; choose another --out folder or fix its permissions"
    return line


def _continue_hint(args: argparse.Namespace) -> str:
    """How to continue an interrupted command from what it wrote (every run writes its
    checkpoint before its row, so nothing released is lost)."""
    folder = getattr(args, "resume", None)
    folder = folder if isinstance(folder, str) else getattr(args, "out", None)
    if args.command == "run" and folder:
        return f"; the rounds written so far are kept: dpfl run --resume {folder} continues"
    if args.command == "leaderboard" and folder:
        return f"; finished runs are kept: dpfl leaderboard --resume {folder} continues"
    if args.command == "tune" and folder:
        return f"; finished trials are kept: dpfl tune --resume --out {folder} continues"
    return ""


def main(argv: list[str] | None = None) -> int:
    """Run ``dpfl`` with ``argv`` (default: the process's arguments); the exit status."""
    import yaml

    from engine.telemetry import timeline

    timeline.mark("main")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    parser = build_parser()
    args = parse_args(parser, argv)
    if not hasattr(warnings, "_formatwarning_orig"):
        warnings._formatwarning_orig = warnings.formatwarning  # type: ignore[attr-defined]
    quiet_before = os.environ.get(QUIET_ENV)
    if getattr(args, "quiet", False):
        os.environ[QUIET_ENV] = "1"  # read by ensure_ray: no dashboard line
    from engine.runtime import interrupt

    try:
        with warnings.catch_warnings(), interrupt.handled():
            warnings.simplefilter("default")
            warnings.formatwarning = _format_warning
            try:
                check_flag_conflicts(args)
                return int(HANDLERS[args.command](args))
            finally:
                warnings.formatwarning = warnings._formatwarning_orig  # type: ignore[attr-defined]
    except ConfigError as e:
        print(f"dpfl: error: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:  # it ran, and part of it failed: said in one line
        print(f"dpfl: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        line = _os_error(e, args)
        if line is None:
            raise
        print(f"dpfl: error: {line}", file=sys.stderr)
        return 2
    except yaml.YAMLError as e:
        print(f"dpfl: error: {_yaml_error(e, args)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dpfl: interrupted{_continue_hint(args)}", file=sys.stderr)
        return 130
    finally:
        if quiet_before is None:
            os.environ.pop(QUIET_ENV, None)
        else:
            os.environ[QUIET_ENV] = quiet_before
        timeline.mark("command done")
        timeline.dump()
        _no_colour_reset_at_exit()


def console_main() -> None:
    """The ``dpfl`` executable (and ``python -m engine.cli``): :func:`main`, then a quick
    exit. Once the command has returned, its results are on disk. A local Ray that a
    run started and left up (:func:`engine.runtime.ray_start.stop_ray_at_exit`) is
    handed to a detached helper that stops its processes after this one has gone
    (:mod:`engine.runtime.reaper`); the exit handlers run (``atexit``: temporary
    files', logging's) and the streams are flushed, then the process ends without the
    interpreter's module teardown (about 1 s with torch loaded, on 2 cores). The
    teardown (and ``ray.shutdown()``) is kept where something may still be running: a
    non-daemon thread alive, or a Ray this process did not leave for its exit (one it
    attached to)."""
    import threading

    from engine.runtime import ray_start

    ray_start.stop_ray_at_exit()  # a run's own Ray: stopped behind the exit, not waited for
    rc = main()
    alive = [t for t in threading.enumerate() if t is not threading.main_thread()]
    ray = sys.modules.get("ray")
    ray_up = ray is not None and ray.is_initialized()
    if any(not t.daemon for t in alive):
        sys.exit(rc)  # ray.shutdown() runs in the exit handlers if Ray is up
    if ray_up and not ray_start.hand_off_at_exit():
        sys.exit(rc)
    import atexit
    import logging

    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def _no_colour_reset_at_exit() -> None:
    """Ray's CLI logger calls ``colorama.init(strip=False)`` when imported, which
    registers an exit hook that writes ``ESC[0m`` to a terminal after dpfl's last line;
    dpfl prints no colour, so the hook is removed."""
    import atexit

    initialise = sys.modules.get("colorama.initialise")
    reset = getattr(initialise, "reset_all", None)
    if reset is not None:
        atexit.unregister(reset)
