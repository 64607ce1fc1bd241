"""``python -m engine.cli ...`` runs ``dpfl ...`` (how ``dpfl submit`` starts a job on a
cluster, and how tests run dpfl in a fresh process)."""

from __future__ import annotations

from engine.cli.dispatch import console_main

if __name__ == "__main__":  # pragma: no cover
    console_main()
