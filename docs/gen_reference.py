"""Generate the reference pages from the code, so that they cannot drift from it.

Run by mkdocs-gen-files when the site is built (``mkdocs.yml``), or by hand with
``python docs/gen_reference.py OUTDIR`` to look at the Markdown:

* ``reference/cli.md``: every ``dpfl`` command's ``--help``, from the argument parser
  itself (:func:`engine.cli.parser.build_parser`);
* ``reference/config.md``: every configuration key with its default and meaning, from
  the configuration schema and the pieces' declarations
  (:func:`engine.config.doc.config_keys`, :func:`engine.config.doc.key_help`);
* ``reference/algorithms.md``: the prose page of that name, with its two markers
  replaced by the recipe registry's table (:func:`algorithms.recipes.markdown_table`)
  and the papers (:func:`algorithms.catalog.references`).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # mkdocs runs this file as a script
    sys.path.insert(0, str(ROOT))


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps its subparsers there
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def cli_page() -> str:
    """Markdown of every command's help, in the parser's order."""
    from engine.cli.parser import build_parser

    parser = build_parser()
    lines = [
        "# Command line",
        "",
        "Generated from dpfl's argument parser (`dpfl COMMAND --help` prints the same).",
        "Every command refuses a bad value with one line naming it and exit status 2.",
        "",
        "```text",
        parser.format_help().rstrip(),
        "```",
    ]
    for name, sub in _subcommands(parser).items():
        lines += ["", f"## dpfl {name}", "", "```text", sub.format_help().rstrip(), "```"]
    return "\n".join(lines) + "\n"


def _value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return str(value)


def config_page() -> str:
    """Markdown tables of every configuration key, one table per section."""
    from engine.config.doc import config_keys, key_help

    helps = key_help()
    sections: dict[str, list[tuple[str, Any]]] = {}
    for dotted, value in config_keys().items():
        head = dotted.rpartition(".")[0]
        sections.setdefault(head, []).append((dotted, value))
    lines = [
        "# Configuration keys",
        "",
        "Generated from the configuration schema and the pieces' declarations. Set a key",
        "with `--set KEY=VALUE` on the command line, or in a YAML file given with",
        "`--config` (a diff over these defaults); `dpfl config` prints the same keys as",
        "commented YAML. An unknown key or a value of the wrong type is refused with one",
        "line naming it.",
    ]
    for head, keys in sections.items():
        lines += ["", f"## `{head}`" if head else "## Top level", ""]
        lines += ["| key | default | meaning |", "| --- | --- | --- |"]
        for dotted, value in keys:
            text = helps.get(dotted, "").replace("|", "\\|")
            lines.append(f"| `{dotted}` | `{_value(value)}` | {text} |")
    return "\n".join(lines) + "\n"


ALGORITHMS_PAGE = ROOT / "docs" / "reference" / "algorithms.md"
MARKERS = ("<!-- generated: recipes table -->", "<!-- generated: references -->")


def algorithms_page() -> str:
    """``reference/algorithms.md`` with the registry's table and references filled in."""
    from algorithms.catalog import references
    from algorithms.recipes import markdown_table

    text = ALGORITHMS_PAGE.read_text(encoding="utf-8")
    table, papers = MARKERS
    for marker in MARKERS:
        if text.count(marker) != 1:
            raise ValueError(f"{ALGORITHMS_PAGE}: needs the line {marker!r} once")
    refs = "\n".join(  # "[name] reference" -> "* `name`: reference"
        re.sub(r"^\[(\w+)\] ", r"* `\1`: ", line) for line in references()
    )
    return text.replace(table, markdown_table()).replace(papers, refs)


PAGES: dict[str, Callable[[], str]] = {
    "reference/cli.md": cli_page,
    "reference/config.md": config_page,
    "reference/algorithms.md": algorithms_page,
}


def write_all(opener: Callable[[str], TextIO]) -> None:
    for path, make in PAGES.items():
        text = make()  # before opening: a page may read its own source file
        with opener(path) as f:
            f.write(text)


def _gen_files_opener() -> Callable[[str], TextIO]:
    import mkdocs_gen_files

    return lambda path: mkdocs_gen_files.open(path, "w")


if __name__ == "__main__" and len(sys.argv) == 2:  # by hand: python docs/gen_reference.py DIR
    out = Path(sys.argv[1])

    def _open(path: str) -> TextIO:
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        return (out / path).open("w", encoding="utf-8")

    write_all(_open)
elif __name__ == "<run_path>":  # under mkdocs-gen-files (runpy.run_path); imported: nothing
    write_all(_gen_files_opener())
