"""``python -m scripts.fidelity``."""

from scripts.fidelity.cli import main

raise SystemExit(main())
