"""``dpfl leaderboard``: which method wins at a total ε, each tuned, the tuning paid for.

Methods × total-ε values on one data set and partition (``docs/leaderboard.md``):
each cell is a private search with the same number of trials and the same shared
ranges for every method, drawn identically (trial k of every method gets the same
shared values), under a total budget that includes the search
(:mod:`tuning.budget`); the trial with the best accuracy on a public validation set
(held out of every client, never the test set) is selected and re-run on fresh seeds
shared by every method; the methods are then compared to a baseline by paired
differences over those seeds, with a decision rule fixed before any run.

* :mod:`~tuning.leaderboard.settings` — the ``leaderboard:`` section and its checks;
* :mod:`~tuning.leaderboard.draws` — paired draws and run seeds;
* :mod:`~tuning.leaderboard.runs` — one run, its validation accuracy, its files;
* :mod:`~tuning.leaderboard.cells` — a cell: trials, selection, seed runs, released ε;
* :mod:`~tuning.leaderboard.stats` — intervals and the decision rule (scipy);
* :mod:`~tuning.leaderboard.command` — planning, budgets, resume, the run of all cells;
* :mod:`~tuning.leaderboard.output`, :mod:`~tuning.leaderboard.table` — the Parquet
  dataset, the cells table, ``leaderboard.md`` and the plot.

Threat model: a seeded simulation; each ε is dp-accounting's for what ran and
describes a deployment with fresh secret randomness publishing only the selected trial.
"""
