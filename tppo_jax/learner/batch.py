"""The learner's typed records: a rollout as arrays (``TrainBatch``), what the estimators
make of it (``Targets``) and the row groups the losses read (``PolicyRows``, ``ValueRows``,
``TokenRows``).

Layout: ``[B, S]`` arrays span the token buffer (prompt + windows) and ``X[b, t]`` refers to
token ``t`` (``sample_logprobs[b, t]`` = log-prob of token ``t``, ``values[b, t] = V(s_t)``
read from the hidden state at ``t - 1``); ``[B]`` arrays are per row.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

Array = jax.Array
# A field's layout: per row ``[B]`` or per token ``[B, S]``.
ROW, TOKEN = "row", "token"


def _laid_out(dims: str, dtype: str, **kw: Any) -> Any:
    """A ``TrainBatch`` field with its layout (``dims``, ``dtype``): ``TrainBatch.abstract``
    reads them, so the compile path's batch is the dataclass's, field for field."""
    return struct.field(metadata={"layout": (dims, dtype)}, **kw)


@struct.dataclass
class TrainBatch:
    """One step's rollout as device arrays.

    tokens: ``[B, S]`` int32, prompt then response; attn: ``[B, S]`` bool, the row's tokens;
    sample_logprobs: ``[B, S]`` the sampling policy's log-prob of each response token;
    prompt_len, window_start, window_len: ``[B]`` int32 (the current window is columns
    ``[window_start, window_start + window_len)``); finished: ``[B]`` bool, the row ended in
    this window; reward: ``[B]`` float32, its outcome reward (finished rows); correct: ``[B]``
    bool, the grader's verdict (the positive-example NLL trains on these rows, not on
    ``reward > 0``, which shaping makes a different set); group: ``[B]`` int32 prompt ids,
    unique over hosts (set when the estimator reads siblings, else None).
    """

    tokens: Array = _laid_out(TOKEN, "int32")
    attn: Array = _laid_out(TOKEN, "bool")
    sample_logprobs: Array = _laid_out(TOKEN, "float32")
    prompt_len: Array = _laid_out(ROW, "int32")
    window_start: Array = _laid_out(ROW, "int32")
    window_len: Array = _laid_out(ROW, "int32")
    finished: Array = _laid_out(ROW, "bool")
    reward: Array = _laid_out(ROW, "float32")
    correct: Array = _laid_out(ROW, "bool")
    group: Array | None = _laid_out(ROW, "int32", default=None)

    @property
    def shape(self) -> tuple[int, int]:
        """``(B, S)``."""
        return tuple(self.tokens.shape)

    @classmethod
    def abstract(cls, rows: int, width: int, sharding: Any = None) -> TrainBatch:
        """A batch of ``rows`` rows and ``width`` columns as ``jax.ShapeDtypeStruct``s (with
        ``sharding``: the rows split over the mesh's batch axes), every field from its
        declared layout: what the compile path lowers the learner's programs for. Every
        field is set (``group`` too, as a run's batch has it)."""
        out = {}
        for f in dataclasses.fields(cls):
            if "layout" not in f.metadata:
                raise TypeError(f"TrainBatch.{f.name} declares no layout (batch.py _laid_out)")
            dims, dtype = f.metadata["layout"]
            shape = (rows, width) if dims == TOKEN else (rows,)
            out[f.name] = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)
        return cls(**out)


@struct.dataclass
class Targets:
    """What the policy and value losses train towards, from ``estimators.compute_targets``.

    advantages, policy_mask, returns, value_mask, positive_mask, values_old: ``[B, S]``
    (``values_old``: the rollout-time critic); lam: ``[B]`` the policy's GAE lambda.
    """

    advantages: Array
    policy_mask: Array
    returns: Array
    value_mask: Array
    positive_mask: Array
    values_old: Array
    lam: Array
    # The learner's own log-probs of the sampled tokens before the update (``[B, S]``), with
    # ``algo.sampler_correction`` on; None: the PPO ratio's old policy is the sampler.
    old_logprobs: Array | None = None


def _cut(x: Array, rows: Array, width: int) -> Array:
    x = x[rows]
    return x[:, :width] if x.ndim == 2 else x


def _masked(x: Array, valid: Array) -> Array:
    return x * valid[:, None].astype(x.dtype)


class TokenRows(NamedTuple):
    """``[R, W]`` tokens and attention of a row group (the critic's values pass)."""

    tokens: Array
    attn: Array

    @classmethod
    def take(cls, batch: TrainBatch, targets: Targets | None, rows: Array, valid: Array, *,
             width: int) -> TokenRows:
        del targets, valid
        return cls(_cut(batch.tokens, rows, width), _cut(batch.attn, rows, width))


class PolicyRows(NamedTuple):
    """``[R, W]`` arrays the policy loss of one row group reads."""

    tokens: Array
    attn: Array
    sample_logprobs: Array
    advantages: Array
    policy_mask: Array
    positive_mask: Array
    old_logprobs: Array | None = None  # Targets.old_logprobs, cut alike

    @classmethod
    def take(cls, batch: TrainBatch, targets: Targets, rows: Array, valid: Array, *,
             width: int) -> PolicyRows:
        """Rows ``rows [R]``, columns ``:width``; masks zero on padding rows (``valid``)."""
        c = lambda x: _cut(x, rows, width)  # noqa: E731
        old = None if targets.old_logprobs is None else c(targets.old_logprobs)
        return cls(c(batch.tokens), c(batch.attn), c(batch.sample_logprobs),
                   c(targets.advantages), _masked(c(targets.policy_mask), valid),
                   _masked(c(targets.positive_mask), valid), old)


class ValueRows(NamedTuple):
    """``[R, W]`` arrays the value loss of one row group reads."""

    tokens: Array
    attn: Array
    values_old: Array
    returns: Array
    value_mask: Array

    @classmethod
    def take(cls, batch: TrainBatch, targets: Targets, rows: Array, valid: Array, *,
             width: int) -> ValueRows:
        """Rows ``rows [R]``, columns ``:width``; the mask zero on padding rows (``valid``)."""
        c = lambda x: _cut(x, rows, width)  # noqa: E731
        return cls(c(batch.tokens), c(batch.attn), c(targets.values_old), c(targets.returns),
                   _masked(c(targets.value_mask), valid))


def row_counts(targets: Targets, *, kind: str) -> dict[str, Array]:
    """``[B]`` per-row counts the minibatch denominators sum: masked tokens (``tokens``),
    whether a row has any (``rows``), and for the policy the positive-example tokens."""
    m = (targets.policy_mask if kind == "policy" else targets.value_mask)
    m = m.astype(jnp.float32).sum(1)
    out = {"tokens": m, "rows": (m > 0).astype(jnp.float32)}
    if kind == "policy":
        out["positive"] = targets.positive_mask.astype(jnp.float32).sum(1)
    return out
