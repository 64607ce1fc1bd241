"""``python -m engine.cli ...`` runs ``dpfl ...`` (how ``dpfl submit`` starts a job on a
cluster, and how tests run dpfl in a fresh process)."""

from __future__ import annotations

import sys

from engine.cli.dispatch import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
