"""``dpfl algorithms`` (the catalog) and ``dpfl config`` (every key, commented): plain
data, printed without importing torch or Ray."""

from __future__ import annotations

import argparse
import sys

from engine.config import load_config


def algorithms_command(args: argparse.Namespace) -> int:
    """``dpfl algorithms``: the catalog (``--markdown``: the README's table)."""
    # the catalog is plain data: listing the algorithms imports neither torch nor Ray
    from algorithms.catalog import CATALOG, references

    if args.markdown:  # the registry's own table (the README holds exactly this)
        from algorithms.recipes import markdown_table

        print(markdown_table())
        return 0
    width = max(len(n) for n in CATALOG)
    for name, e in CATALOG.items():
        print(f"{name:<{width}}  {e.summary}  [{e.citation()}]")
    if args.references:
        print("\nReferences (what each method computes: docs/algorithms.md):")
        for line in references():
            print(f"  {line}")
    return 0


def config_command(args: argparse.Namespace) -> int:
    """``dpfl config``: every key with its default (or the given config's value), commented."""
    from engine.config.doc import commented_yaml

    config = load_config(args.config, args.set) if (args.config or args.set) else None
    sys.stdout.write(commented_yaml(config))
    return 0
