"""Hyperparameter search under fixed privacy budgets (Ray Tune).

Not implemented in this release: importing this package exposes nothing yet. The
budget calibration it will use is already public as
``engine.calibrate_noise_multiplier``.
"""
