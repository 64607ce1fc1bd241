"""The runtime: where clients run and with what resources.

:mod:`.executors` holds the worker pools (in process, or Ray actors pinned to CPUs or
fractional GPUs) that dispatch a round's cohort to the federated roles and return the
partial sums; :mod:`.resources` plans the workers a run asks for and checks that they
fit the Ray instance it attaches to or starts; :mod:`.switches` names the environment
switches the command line sets for them (``dpfl -q``, ``--verbose``).
"""
