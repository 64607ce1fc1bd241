"""Privacy: every number a run's ε depends on, and every random draw that hides data.

:mod:`.mechanism` is the run's Gaussian mechanism: it clips updates to C_t, sizes
the noise (the one z·C formula), draws it from the seeded or secure stream of
:mod:`.rng`, moves C_t under adaptive clipping (:mod:`.adaptive_clip`) and names the
DpEvent it implies with its noise scheme (:mod:`.noise`); :mod:`.kernels` holds its
pure clip and draw functions; :mod:`.participation` (and :mod:`.sampling`, the
``sampling:`` section's) draws cohorts and states the sampling the accountant assumes;
:mod:`.accounting` turns (σ, participation, noise scheme, rounds, δ) into ε with
dp-accounting, and :mod:`.resolve` turns any two of (ε, δ, σ) into the third
(:mod:`.calibration_store` caches calibrations); two modules hold the arithmetic of
the correlated noise schemes the methods' modules (``algorithms``) build on;
:mod:`.audit` measures a lower bound on ε with canaries.
"""
