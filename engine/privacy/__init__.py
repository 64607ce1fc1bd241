"""Privacy: every number a run's ε depends on, and every random draw that hides data.

:mod:`.mechanisms` clips updates and draws the Gaussian noise of a round;
:mod:`.rng` holds the seeded (simulation) and secure (release) randomness;
:mod:`.accounting` turns (σ, sampling, rounds, δ) into ε with dp-accounting and
calibrates σ from ε (:mod:`.calibration_store` caches it); :mod:`.adaptive_clip`
tracks the clipping norm C_t privately; :mod:`.tree_aggregation` and
:mod:`.banded_mf` draw the correlated noise of DP-FTRL and banded matrix
factorization; :mod:`.audit` measures a lower bound on ε with canaries.
"""
