"""A rollout as the updates' device arrays: columns cut to a width bucket, rows global over
hosts, and what the updates' plans read (row lengths, finished rows, each epoch's order)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from tppo_jax.buckets import bucket_width
from tppo_jax.config import Config
from tppo_jax.parallel import multihost as mh
from tppo_jax.rollout.scheduler import RolloutBatch
from tppo_jax.train.update import plan_cells

if TYPE_CHECKING:  # annotations only: setup and collect build on this module's callers
    from tppo_jax.train.collect import Rollout
    from tppo_jax.train.setup import Run


def batch_arrays(rb: RolloutBatch, reward: np.ndarray, correct: np.ndarray, mesh,
                 token_rewards: np.ndarray | None = None, groups: bool = False,
                 blame_start: np.ndarray | None = None,
                 group_prior: tuple[np.ndarray, np.ndarray] | None = None
                 ) -> dict[str, jax.Array]:
    """The rollout as device arrays, split over the mesh's batch axes (global arrays of
    every host's rows when there are several processes).

    Columns are cut to the longest row (over all hosts) rounded up to a width bucket
    (``buckets.bucket_width``): the updates then cost what the batch needs, not the full
    buffer, and only a handful of widths ever compile (the updates then cut each row group
    to its own bucket, see ``update_plan``).
    """
    longest = mh.max_over_hosts({"len": int(rb.total_len.max())})["len"]
    width = bucket_width(int(longest), rb.tokens.shape[1])
    attn = np.arange(width)[None] < rb.total_len[:, None]
    arrays = {"tokens": rb.tokens[:, :width], "attn": attn, "prompt_len": rb.prompt_len,
              "window_start": rb.window_start, "window_len": rb.window_len,
              "finished": rb.finished, "reward": reward.astype(np.float32),
              "correct": correct.astype(bool),
              "sample_logprobs": rb.sample_logprobs[:, :width]}
    if token_rewards is not None:
        arrays["token_rewards"] = token_rewards[:, :width]
    if blame_start is not None:
        arrays["blame_start"] = blame_start.astype(np.int32)
    if groups:  # the prompt ids, for algo.advantage_baseline: group
        arrays["group"] = global_group_ids(rb.group_id, jax.process_index(), jax.process_count())
    if group_prior is not None:  # algo.group_siblings: so_far (the scheduler's outcomes)
        arrays["group_prior_sum"], arrays["group_prior_n"] = group_prior
    return {k: mh.host_to_global(v, mesh) for k, v in arrays.items()}


def global_group_ids(group_id: np.ndarray, host: int, hosts: int) -> np.ndarray:
    """``[B]`` int32 prompt ids unique over hosts: each host's scheduler counts its groups
    from 0, so host 1's group 5 is not host 0's group 5 (ids wrap at 2**31 / hosts)."""
    local = group_id.astype(np.int64) % ((1 << 31) // hosts)
    return (local * hosts + host).astype(np.int32)


@dataclass(frozen=True)
class RowPlan:
    """What the updates' plans need, as host arrays over every host's rows (global row order,
    so every host plans the same steps): ``lengths [B]`` columns each row uses, ``shuffle
    [B, epochs]`` each epoch's row order, ``finished`` the rows the critic trains on,
    ``train_start [B]`` the first column each row's policy loss trains: its current
    window's, or its response's on a row it trains whole (``row_plan``'s ``whole``);
    ``policy_rows`` the rows the policy trains on (None: every row; ``finished`` when it
    trains whole responses)."""

    lengths: np.ndarray
    shuffle: np.ndarray
    finished: np.ndarray
    train_start: np.ndarray
    policy_rows: np.ndarray | None = None


def row_plan(rb: RolloutBatch, shuffle: np.ndarray, whole: np.ndarray | None = None,
             responses: bool = False) -> RowPlan:
    """This rollout's ``RowPlan`` (``shuffle``: this host's ``shuffle_keys``; ``whole [B]``:
    this host's rows whose whole response the policy loss trains, None: none;
    ``responses``: the policy trains the finished rows only, ``algo.policy_trains``)."""
    start = rb.window_start if whole is None else np.where(whole, rb.prompt_len,
                                                            rb.window_start)
    if jax.process_count() == 1:
        lengths, fin = rb.total_len, rb.finished
    else:
        lengths, fin = mh.gather_rows(rb.total_len), mh.gather_rows(rb.finished)
        shuffle, start = mh.gather_rows(shuffle), mh.gather_rows(start)
    fin = np.flatnonzero(fin)
    return RowPlan(np.asarray(lengths), np.asarray(shuffle), fin, np.asarray(start),
                   fin if responses else None)


def shuffle_keys(cfg: Config, step: int, rows: int) -> np.ndarray:
    """``[rows, epochs]`` random keys ordering this host's rows in each epoch's minibatches
    (as many epochs as the policy's or the critic's update has, whichever is more);
    a pure function of (seed, step, host), so a resumed run replays the same minibatches."""
    rng = np.random.default_rng([cfg.train.seed, step, jax.process_index(), 0x5EED])
    return rng.random((rows, max(cfg.optim.epochs, cfg.optim.critic_epochs)), dtype=np.float32)


def update_batch(run: Run, value: Any, roll: Rollout, step: int
                 ) -> tuple[dict[str, jax.Array], RowPlan]:
    """The batch one step's updates train on: the rollout's arrays plus the critic's targets
    and EGAE advantages at ``value`` params; and its ``RowPlan`` (``step``'s shuffle)."""
    rb, a = roll.rb, run.cfg.algo
    groups = a.advantage_baseline == "group"
    prior = (run.sched.sibling_outcomes(rb.group_id)
             if groups and a.group_siblings == "so_far" else None)
    arrays = batch_arrays(rb, roll.reward, roll.correct, run.mesh, roll.token_rewards,
                          groups=groups, blame_start=roll.blame_start, group_prior=prior)
    # Rows whose whole response the policy loss trains: every finished row when the policy
    # trains responses, else a finished right row, which the positive-example NLL imitates
    responses = a.policy_trains == "response"
    whole = rb.finished if responses else (
        rb.finished & roll.correct if a.nll_coef > 0 else None)
    plan = row_plan(rb, shuffle_keys(run.cfg, step, rb.tokens.shape[0]), whole, responses)
    # Training responses, every target the updates read is on a row the policy trains
    targets = run.steps.targets(value, arrays, lengths=plan.lengths, rows=plan.policy_rows)
    return {**arrays, **targets}, plan


def critic_update(run: Run, value: Any, opt_state: Any, batch: dict[str, jax.Array],
                  plan: RowPlan) -> tuple[Any, Any, dict[str, Any], int]:
    """The critic's update on the finished rows only: ``(params, opt_state, stats, cells)``
    (``cells``: rows x columns its passes ran over); no finished row: unchanged, zero loss."""
    if not len(plan.finished):
        return value, opt_state, {"value_loss": 0.0, "value_skipped": 0.0}, 0
    v_plan = run.steps.value.plan(plan.lengths, int(batch["tokens"].shape[1]), plan.shuffle,
                                  plan.finished)
    value, opt_state, stats = run.steps.value(value, opt_state, batch, plan=v_plan)
    return value, opt_state, stats, plan_cells(v_plan)


def init_value_bias(run: Run, value: Any, roll: Rollout) -> Any:
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
