"""Hyperparameter search under fixed privacy budgets with Ray Tune.

* :mod:`tuning.spaces` — search spaces per recipe as data, YAML overrides, validation;
* :mod:`tuning.trial` — one trial = one simulation at a fixed ε (σ calibrated), with
  its own seed;
* :mod:`tuning.rounds` — the sweep's rounds dataset: one Parquet row per (trial, round),
  folded into one file per trial;
* :mod:`tuning.experiment` — ``dpfl tune``: experiments, results, resume;
* :mod:`tuning.plan` — an experiment's settings, trial placement and the number of
  trials per (algorithm, ε);
* :mod:`tuning.driver` — the driver runner: a cell's trials in this process, no Tune;
* :mod:`tuning.trials_table` — ``trials.parquet`` and which trial is released;
* :mod:`tuning.selection` — the privacy cost of tuning: composition of all trials, or
  Papernot & Steinke's repeat-and-select bound (K drawn by dpfl, best trial only);
* :mod:`tuning.report` — ``dpfl report``, its figures and pandas helpers
  (``load_rounds``, ``load_trials``, ``best_trials``, ``summary_table``).

Each trial's ε excludes hyperparameter selection; the report's
``epsilon_with_tuning`` includes it, by the rule named in ``tuning_accounting``.
"""
