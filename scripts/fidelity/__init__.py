"""Regenerate docs/fidelity.md: every paper preset's claim, dpfl's numbers, a verdict.

    python -m scripts.fidelity                 # CPU scale of every preset, 3 seeds
    python -m scripts.fidelity --ablation      # also the DP-Fed-LS departures ablation
    python -m scripts.fidelity --scale real --seeds 0,1,2,3,4 [--only a,b]

Split by concern: :mod:`.runs` runs the presets (``dpfl compare``'s code) at the CPU and
real scales, :mod:`.verdicts` applies each preset's ``verdict:`` rule, :mod:`.stats` holds
the paired Student-t intervals (scipy) and the real scale's decision rule,
:mod:`.ablation` the two ablations, :mod:`.page` assembles the page from the prose in
``text/`` (:mod:`.text`), and :mod:`.cli` is the command line. Importable from the
repository root (``python -m``, or pytest run there) without path changes.

Paper-scale rows need the full data sets and hours of compute; they are listed as
*not yet run*. Every ε shown was computed by the accountant for the σ, sampling and
rounds used. The real-scale comparisons are untuned (one setting per row, horizons cut
for the CPU): their verdicts are labelled so; the tuned comparison is
``dpfl leaderboard`` (docs/leaderboard.md).
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
