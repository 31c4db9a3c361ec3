"""The loop's small parts: TrainState as a pytree (its step an array) whose trees carry the
checkpoint's item names, and the fault-injection hook the CLI builds from
TPPO_FAULT_NAN_FROM_STEP."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tppo_jax.learner import Targets, TrainState
from tppo_jax.runs.checkpoint import ITEMS
from tppo_jax.trainer.trainer import TrainHooks, nan_updates_from


def test_train_state_is_a_pytree_whose_step_is_an_array():
    s = TrainState({"w": jnp.ones(2)}, {"v": jnp.ones(3)}, {"m": jnp.zeros(2)},
                   {"m": jnp.zeros(3)}, step=7)
    assert isinstance(s.step, jax.Array) and s.step.dtype == jnp.int32 and int(s.step) == 7
    assert len(jax.tree.leaves(s)) == 5
    doubled = jax.tree.map(lambda x: x * 2, s)
    assert int(doubled.step) == 14 and float(doubled.policy["w"][0]) == 2.0
    # One tree structure at every step: a function jitted over the state compiles once.
    nxt = dataclasses.replace(s, step=s.step + 1)
    assert jax.tree.structure(nxt) == jax.tree.structure(s)
    traces = []

    @jax.jit
    def bump(state):
        traces.append(1)
        return dataclasses.replace(state, step=state.step + 1)

    assert int(bump(bump(s)).step) == 9 and len(traces) == 1
    # Its trees plus the scheduler's (slots, kv_cache) are exactly a run's checkpoint items.
    assert (*s.items(), "slots", "kv_cache") == ITEMS


def test_nan_hook_poisons_updates_from_the_given_step():
    hook = nan_updates_from(2).before_update
    ones = jnp.ones((2, 4))
    targets = Targets(advantages=ones, policy_mask=ones, returns=ones, value_mask=ones,
                      positive_mask=ones, values_old=ones, lam=jnp.ones(2))
    assert hook(0, targets) is targets  # step 1: untouched
    out = hook(1, targets)  # step 2 (0-based 1) on: NaN advantages and returns only
    assert np.isnan(out.advantages).all() and np.isnan(out.returns).all()
    assert all(np.isfinite(x).all() for x in (out.policy_mask, out.value_mask,
                                              out.positive_mask, out.values_old, out.lam))
    assert np.isfinite(targets.advantages).all()
    assert TrainHooks().before_update is None
