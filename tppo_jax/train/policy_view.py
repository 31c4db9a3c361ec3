"""The policy module that rollouts and evals decode with, from the ``TrainState``'s params."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flax import nnx

from tppo_jax.parallel.mesh import reshard
from tppo_jax.train.state import TrainState

if TYPE_CHECKING:
    from tppo_jax.train.setup import Run


def policy_module(run: Run, state: TrainState) -> nnx.Module:
    """The policy for rollout and eval: the trained params, or (decode layout) a copy moved
    to the decode shardings by one explicit reshard."""
    params = state.policy
    if run.decode_shardings is not None:
        params = reshard(params, run.decode_shardings)
    return nnx.merge(run.models.policy_def, params)
