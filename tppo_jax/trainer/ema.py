"""An exponential moving average of the policy's params (``optim.policy_ema``, Polyak
averaging): what the run's held-out evals, checkpoints' ``policy_ema`` item and readers of a
run (``tppo eval`` / ``export`` / ``serve``) take as its policy; rollouts sample from the
live params, so the average changes nothing that trains.

Why: on a small batch the policy's steps are mostly noise (the shuffled-reward control loses
as many greedy answers as a real run); an average over the last ~1 / (1 - decay) steps keeps
the drift the reward causes and cancels the part of that noise a later step undoes. Measured
on the long tail (0.95, results/README.md), the answers lost stay lost over ~20 steps: the
average is within one greedy answer of the live params, so the option is off by default.
The average covers only what trains (the LoRA adapters under LoRA), starts at the params RL
starts from, and needs no bias correction.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from tppo_jax.config import Config
from tppo_jax.learner.state import TrainState
from tppo_jax.trainer.trainable import rejoin, trainable_keys, trained_part

# The checkpoint item readers take a run's policy from.
LIVE_ITEM, EMA_ITEM = "policy", "policy_ema"


@partial(jax.jit, donate_argnums=0)
def ema_update(avg: Any, params: Any, decay: jax.Array) -> Any:
    """``decay * avg + (1 - decay) * params`` per leaf (``avg`` donated: updated in place)."""
    return jax.tree.map(lambda a, p: (decay * a + (1.0 - decay) * p).astype(a.dtype), avg,
                        params)


def with_ema(state: TrainState, cfg: Config) -> TrainState:
    """``state`` with its average started at its policy (the trained part, copied), when
    ``optim.policy_ema`` is on; else unchanged."""
    if not cfg.optim.policy_ema:
        return state
    # A copy: the update donates the average's buffers, never the live params'.
    trained = trained_part(state.policy, trainable_keys(cfg)[0])
    return dataclasses.replace(state, policy_ema=jax.tree.map(jnp.copy, trained))


def step_ema(state: TrainState, cfg: Config) -> TrainState:
    """The average moved one step toward ``state.policy`` (a no-op when off)."""
    if state.policy_ema is None:
        return state
    keep = trainable_keys(cfg)[0]
    return dataclasses.replace(state, policy_ema=ema_update(
        state.policy_ema, trained_part(state.policy, keep), cfg.optim.policy_ema))


def evaluated(state: TrainState, cfg: Config) -> TrainState:
    """The state whose policy is the run's result: the average joined with the frozen rest
    when ``optim.policy_ema`` is on, else ``state`` itself."""
    if state.policy_ema is None:
        return state
    keep = trainable_keys(cfg)[0]
    return dataclasses.replace(state, policy=rejoin(state.policy_ema, state.policy, keep))


def policy_item(cfg: Config) -> str:
    """The checkpoint item that holds a run's result policy."""
    return EMA_ITEM if cfg.optim.policy_ema else LIVE_ITEM
