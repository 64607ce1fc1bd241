"""Hyperparameter search under fixed privacy budgets with Ray Tune.

* :mod:`tuning.spaces` — search spaces per recipe as data, YAML overrides, validation;
* :mod:`tuning.trial` — one trial = one simulation at a fixed ε (σ calibrated);
* :mod:`tuning.experiment` — ``dpfl tune``: experiments, results, resume;
* :mod:`tuning.report` — ``dpfl report`` and pandas helpers (``load_rounds``,
  ``load_trials``, ``best_trials``, ``tuning_epsilon``).

Each trial's ε excludes hyperparameter selection; ``tuning_epsilon`` gives the cost
of releasing the best trial (Papernot & Steinke 2022).
"""
