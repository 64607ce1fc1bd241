"""The values of ``dpfl``'s flags, checked where argparse reads them: list flags
(``--seeds``, ``--epsilons``, ``--algorithms``) refuse an empty value or an empty item
(``1,,2`` is never read as ``1,2``), path flags an empty string, and an unknown flag
names the closest one the command knows. Each refusal is one line naming the flag."""

from __future__ import annotations

import argparse

from engine.config import ConfigError


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, with unknown flags refused by the command's own parser
    (its ``--help`` named, and the closest flag it knows suggested)."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[
            args.command
        ]
        sub.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def closest_flag(parser: argparse.ArgumentParser, given: list[str]) -> str:
    """``; did you mean --x?`` for the first unknown flag close to one ``parser`` knows."""
    import difflib

    known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    for word in given:
        if word.startswith("-"):
            match = difflib.get_close_matches(word.split("=", 1)[0], known, n=1, cutoff=0.6)
            if match:
                return f"; did you mean {match[0]}?"
    return ""


def _items(text: str, flag: str, example: str) -> list[str]:
    """The comma-separated items of a list flag's value; ConfigError naming the flag for
    an empty value or an empty item (``1,,2``: never silently skipped)."""
    items = [x.strip() for x in text.split(",")]
    if not text.strip() or any(not x for x in items):
        what = "is empty" if not text.strip() else "has an empty item"
        raise ConfigError(f"{flag}={text!r}: {what}; expected e.g. {example}")
    return items


def parse_seeds(text: str | None) -> list[int] | None:
    if text is None:
        return None
    items = _items(text, "--seeds", "0,1,2")
    try:
        seeds = [int(x) for x in items]
    except ValueError:
        seeds = []
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds={text!r}: expected distinct integers >= 0, e.g. 0,1,2")
    return seeds


def parse_floats(text: str, flag: str) -> list[float]:
    items = _items(text, flag, "1,4,8")
    try:
        return [float(x) for x in items]
    except ValueError:
        raise ConfigError(f"{flag}={text!r}: expected comma-separated numbers") from None


def checked(check, *args: str):  # noqa: ANN001, ANN202 - an argparse ``type``
    """An argparse ``type`` that runs ``check(value, *args)`` and keeps the string:
    argparse then refuses a bad value in one line naming the flag, before any work."""

    def convert(value: str) -> str:
        try:
            check(value, *args)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value

    return convert


def nonempty(value: str, flag: str) -> None:
    if not value.strip():
        raise ConfigError(f"{flag}={value!r}: is empty; give a path or name")


def name_list(value: str, flag: str) -> None:
    _items(value, flag, "all, or dp_fedavg,fedavg")


def number_list(value: str, flag: str) -> None:
    parse_floats(value, flag)


def seed_list(value: str, flag: str) -> None:
    parse_seeds(value)
