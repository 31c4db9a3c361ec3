"""A rollout as the updates' device arrays: columns cut to a width bucket, rows global over
hosts, the critic's rows bucketed, and each epoch's minibatch order."""

from __future__ import annotations

import math

import jax
import numpy as np

from tppo_jax.buckets import bucket_width
from tppo_jax.config import Config
from tppo_jax.parallel import multihost as mh
from tppo_jax.rollout.scheduler import RolloutBatch
from tppo_jax.train.shapes import bucket_rows


def batch_arrays(rb: RolloutBatch, reward: np.ndarray, correct: np.ndarray, mesh,
                 token_rewards: np.ndarray | None = None,
                 shuffle: np.ndarray | None = None) -> dict[str, jax.Array]:
    """The rollout as device arrays, split over the mesh's batch axes (global arrays of
    every host's rows when there are several processes).

    Columns are cut to the longest row (over all hosts) rounded up to a width bucket
    (``buckets.bucket_width``): the updates then cost what the batch needs, not the full
    buffer, and only a handful of widths ever compile. ``shuffle`` (``[B, epochs]`` random
    keys) orders the rows of each epoch's minibatches.
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
    if shuffle is not None:
        arrays["shuffle"] = shuffle.astype(np.float32)
    return {k: mh.host_to_global(v, mesh) for k, v in arrays.items()}


def value_rows(finished: np.ndarray, mesh, unit: int) -> jax.Array | None:
    """Global indices of the rows the critic trains on: this host's finished rows, padded with
    unfinished ones (value mask 0) to a row bucket agreed by all hosts; None when no host has
    a finished row (the critic update is then skipped, not run on nothing)."""
    fin = np.flatnonzero(finished)
    need = int(mh.max_over_hosts({"fin": len(fin)})["fin"])
    if need == 0:
        return None
    b, p = len(finished), jax.process_count()
    # Host-local bucket whose global total (x P hosts) still splits into `unit` parts.
    r = bucket_rows(need, b, max(unit // math.gcd(unit, p), 1))
    rows = np.concatenate([fin, np.flatnonzero(~finished)])[:r]
    return mh.host_to_global((rows + jax.process_index() * b).astype(np.int32), mesh)


def shuffle_keys(cfg: Config, step: int, rows: int) -> np.ndarray:
    """``[rows, epochs]`` random keys ordering this host's rows in each epoch's minibatches;
    a pure function of (seed, step, host), so a resumed run replays the same minibatches."""
    rng = np.random.default_rng([cfg.train.seed, step, jax.process_index(), 0x5EED])
    return rng.random((rows, cfg.optim.epochs), dtype=np.float32)
