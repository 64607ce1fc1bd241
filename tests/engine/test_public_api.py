"""The notebook API (README, *Python API*) keeps its names after the engine is used.

``engine.simulate`` was once both a function of the package and the name of its
submodule: the first call imported the submodule, which rebound the package attribute,
so a later ``from engine import simulate`` (a notebook's second cell) returned a module.
The submodule is now ``engine.simulation``.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import types


def test_simulate_stays_the_function_after_the_simulation_module_is_imported() -> None:
    code = (
        "import engine, engine.simulation\n"
        "from engine import simulate, load_config\n"
        "assert callable(simulate) and not isinstance(simulate, type(engine)), simulate\n"
        "res = simulate(load_config(overrides=['rounds=1', 'dataset.num_clients=10',"
        " 'sampling.rate=0.5', 'ray.executor=local', 'privacy.noise_multiplier=1.0']))\n"
        "from engine import simulate as again\n"
        "assert again is simulate, again\n"
        "print(len(res.rounds))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "1"


def test_every_public_name_is_what_all_says() -> None:
    engine = importlib.import_module("engine")
    importlib.import_module("engine.simulation")
    for name in engine.__all__:
        value = getattr(engine, name)
        assert not isinstance(value, types.ModuleType), name
