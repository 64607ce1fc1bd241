"""The server step's state is the server's checkpoint's (``state["step"]``): a run
resumed from it equals the uninterrupted run bit for bit, also from a checkpoint in the
layout written before server steps held their state (PGN's ``g_tilde``, correlated
noise's ``correlated`` at the top of the server's state)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.config import load_config
from engine.simulation import simulate
from tests.conftest import TINY


class Stop(Exception):
    pass


@pytest.mark.parametrize("algorithm, old_key", [("dp_fedpgn", "g_tilde"), ("dp_ftrl", None)])
def test_resume_from_the_step_state_and_from_the_former_layout(algorithm, old_key) -> None:
    over = [*TINY, f"algorithm={algorithm}", "rounds=4", "privacy.noise_multiplier=1.0"]
    whole = simulate(load_config(overrides=over), write=False)
    saved: dict = {}

    def keep(state: dict, row: dict) -> None:
        saved["state"] = state

    def stop(row: dict, executor) -> None:
        if int(row["round"]) == 2:
            raise Stop

    with pytest.raises(Stop):
        simulate(load_config(overrides=over), write=False, on_checkpoint=keep, on_round=stop)
    state = saved["state"]
    assert state["server"]["step"]  # the step's own state is checkpointed
    resumed = simulate(load_config(overrides=over), write=False, resume=state)
    assert np.array_equal(resumed.weights, whole.weights)
    server = {k: v for k, v in state["server"].items() if k != "step"}
    if old_key is not None:
        server[old_key] = state["server"]["step"][old_key]
    else:
        server["correlated"] = state["server"]["step"]
    former = simulate(load_config(overrides=over), write=False, resume={**state, "server": server})
    assert np.array_equal(former.weights, whole.weights)
