"""The runtime: where clients run and with what resources.

:mod:`.executors` holds the round (:func:`.executors.play_round`), the worker-pool
interface and the :class:`.executors.Executor` that runs rounds on a pool;
:mod:`.ray_start` starts or attaches to Ray (:func:`.ray_start.ensure_ray`), once
what ``ray.init`` would refuse or hang on is checked (:func:`.ray_start.check_ray_start`);
the pools that dispatch a round's
cohort to the federated roles and return the partial sums are :mod:`.local_pool`
(in process) and :mod:`.ray_pool` (Ray actors pinned to CPUs or fractional GPUs, with
fault tolerance), whose server may live in the driver (:mod:`.driver_server`);
:mod:`.resources` plans the workers a run asks for and checks that they fit the Ray
instance it attaches to or starts; :mod:`.switches` names the environment switches
the command line sets for them (``dpfl -q``, ``--verbose``).
"""
