"""A rollout as the learner's input: a ``TrainBatch`` of device arrays (columns cut to a
width bucket, rows global over hosts) and the ``RowPlan`` the updates' plans read (row
lengths, finished rows, each epoch's order)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from tppo_jax.buckets import bucket_width
from tppo_jax.config import Config
from tppo_jax.learner import RowPlan, TrainBatch
from tppo_jax.parallel import multihost as mh
from tppo_jax.rollout.scheduler import RolloutBatch

if TYPE_CHECKING:  # annotations only: setup and collect build on this module's callers
    from tppo_jax.trainer.collect import Rollout
    from tppo_jax.trainer.trainer import Trainer


def train_batch(rb: RolloutBatch, reward: np.ndarray, correct: np.ndarray, mesh
                ) -> TrainBatch:
    """The rollout as device arrays, split over the mesh's batch axes (global arrays of
    every host's rows when there are several processes), prompt ids included.

    Columns are cut to the longest row (over all hosts) rounded up to a width bucket
    (``buckets.bucket_width``): the updates then cost what the batch needs, not the full
    buffer, and only a handful of widths ever compile (the updates then cut each row group
    to its own bucket, see ``learner/plan.py``).
    """
    longest = mh.max_over_hosts({"len": int(rb.total_len.max())})["len"]
    width = bucket_width(int(longest), rb.tokens.shape[1])
    g = lambda x: mh.host_to_global(x, mesh)  # noqa: E731
    return TrainBatch(
        tokens=g(rb.tokens[:, :width]), attn=g(np.arange(width)[None] < rb.total_len[:, None]),
        sample_logprobs=g(rb.sample_logprobs[:, :width]), prompt_len=g(rb.prompt_len),
        window_start=g(rb.window_start), window_len=g(rb.window_len),
        finished=g(rb.finished), reward=g(reward.astype(np.float32)),
        correct=g(correct.astype(bool)),
        group=g(global_group_ids(rb.group_id, jax.process_index(), jax.process_count())))


def global_group_ids(group_id: np.ndarray, host: int, hosts: int) -> np.ndarray:
    """``[B]`` int32 prompt ids unique over hosts: each host's scheduler counts its groups
    from 0, so host 1's group 5 is not host 0's group 5 (ids wrap at 2**31 / hosts)."""
    local = group_id.astype(np.int64) % ((1 << 31) // hosts)
    return (local * hosts + host).astype(np.int32)


def row_plan(rb: RolloutBatch, shuffle: np.ndarray) -> RowPlan:
    """This rollout's ``RowPlan`` over every host's rows (``shuffle``: this host's
    ``shuffle_keys``)."""
    if jax.process_count() == 1:
        lengths, fin = rb.total_len, rb.finished
    else:
        lengths, fin = mh.gather_rows(rb.total_len), mh.gather_rows(rb.finished)
        shuffle = mh.gather_rows(shuffle)
    return RowPlan(np.asarray(lengths), np.asarray(shuffle), np.flatnonzero(fin))


def shuffle_keys(cfg: Config, step: int, rows: int) -> np.ndarray:
    """``[rows, epochs]`` random keys ordering this host's rows in each epoch's minibatches
    (as many epochs as the policy's or the critic's update has, whichever is more);
    a pure function of (seed, step, host), so a resumed run replays the same minibatches."""
    rng = np.random.default_rng([cfg.train.seed, step, jax.process_index(), 0x5EED])
    return rng.random((rows, max(cfg.optim.epochs, cfg.optim.critic_epochs)), dtype=np.float32)


def learner_input(run: Trainer, roll: Rollout, step: int) -> tuple[TrainBatch, RowPlan]:
    """What ``Learner.step`` trains on for ``roll``: its batch and its ``RowPlan``
    (``step``'s shuffle)."""
    rb = roll.rb
    batch = train_batch(rb, roll.reward, roll.correct, run.mesh)
    return batch, row_plan(rb, shuffle_keys(run.cfg, step, rb.tokens.shape[0]))


def init_value_bias(run: Trainer, value: Any, roll: Rollout) -> Any:
    """``value`` params with the critic's output bias set as ``algo.value_bias_init`` says,
    before its first update: ``mean_reward`` = the mean reward of ``roll``'s finished rows
    over all hosts (the midpoint of ``reward.correct`` and ``reward.wrong`` when none
    finished); ``zero`` leaves ``value`` as it is."""
    if run.cfg.algo.value_bias_init == "zero":
        return value
    tot = mh.sum_over_hosts({"fin": len(roll.fin), "reward": float(roll.reward[roll.fin].sum())})
    rc = run.cfg.reward
    mean = tot["reward"] / tot["fin"] if tot["fin"] else 0.5 * (rc.correct + rc.wrong)
    old = value["head_bias"]
    return {**value, "head_bias": jax.device_put(jnp.asarray(mean, old.dtype), old.sharding)}
