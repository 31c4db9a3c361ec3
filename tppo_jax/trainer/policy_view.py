"""The policy module that rollouts and evals decode with, from the ``TrainState``'s params."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple

import jax
from flax import nnx

from tppo_jax.learner.state import TrainState
from tppo_jax.parallel.mesh import reshard

if TYPE_CHECKING:
    from tppo_jax.trainer.trainer import Trainer


def policy_module(run: Trainer, state: TrainState) -> nnx.Module:
    """The policy for rollout and eval: the trained params, or (decode layout) a copy moved
    to the decode shardings by one explicit reshard."""
    return timed_policy_module(run, state)[0]


class Reshard(NamedTuple):
    """One move of the policy into the decode layout: its wall time (until the copy is
    on the devices) and the bytes of the copy."""

    seconds: float
    bytes: int


def timed_policy_module(run: Trainer, state: TrainState) -> tuple[nnx.Module, Reshard | None]:
    """``policy_module``, and with a decode layout how long its reshard took and how many
    bytes it copied (``None`` in the training layout: nothing moves)."""
    if run.decode_shardings is None:
        return nnx.merge(run.models.policy_def, state.policy), None
    t0 = time.perf_counter()
    params = jax.block_until_ready(reshard(state.policy, run.decode_shardings))
    moved = Reshard(time.perf_counter() - t0,
                    sum(x.nbytes for x in jax.tree.leaves(params)))
    return nnx.merge(run.models.policy_def, params), moved
