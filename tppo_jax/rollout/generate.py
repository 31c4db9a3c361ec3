"""On-device window decode over a dense KV cache (one jitted call per window).

Cache invariant: for a live row, the cache holds positions ``[0, total_len - 1)``; the
last token (a prompt's final token, or the last token sampled in the previous window)
has not been fed yet. Each decode iteration feeds it, samples the next token and
appends. So a continuation resumes exactly where its previous window stopped.

The paged engine (``rollout/engine.py``, JetStream API) replaces the dense cache with
pages; this module is the reference decode path the scheduler and tests use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from tppo_jax.models.cache import DenseKVCache
from tppo_jax.rollout.sampling import sample, slot_keys


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False


class WindowOut(NamedTuple):
    """What one window of decode produced.

    tokens: ``[B, W]`` new tokens (right-padded with 0 after ``count``).
    logprobs: ``[B, W]`` float32 log-prob of each under the sampling policy.
    count: ``[B]`` int32 tokens generated this window.
    hit_eos: ``[B]`` bool, the row emitted EOS (its last new token is EOS).
    steps: () int32 decode iterations actually run (early exit when all rows stop).
    """

    tokens: jax.Array
    logprobs: jax.Array
    count: jax.Array
    hit_eos: jax.Array
    steps: jax.Array


def prefill(model: nnx.Module, cache: DenseKVCache, tokens: jax.Array, total_len: jax.Array,
            rows: jax.Array) -> DenseKVCache:
    """Writes positions ``[0, total_len-1)`` of the selected rows into the cache.

    Args:
      tokens: ``[B, S]`` full token buffer (prompt + earlier windows), right-padded.
      total_len: ``[B]`` tokens per row.
      rows: ``[B]`` bool, rows to (re)prefill; other rows' cache entries are untouched.
    """
    b, s = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(s)[None], (b, s))
    valid = (positions < (total_len - 1)[:, None]) & rows[:, None]
    _, cache = model.forward_with_cache(tokens, positions, cache, valid=valid)
    return cache


def decode_window(
    model: nnx.Module,
    cache: DenseKVCache,
    last_token: jax.Array,
    total_len: jax.Array,
    budget: jax.Array,
    active: jax.Array,
    rng: jax.Array,
    slot_ids: jax.Array,
    step: jax.Array,
    *,
    window: int,
    eos_id: int,
    params: SamplingParams,
) -> tuple[WindowOut, DenseKVCache]:
    """Generates up to ``min(window, budget)`` tokens per active row in a ``lax.while_loop``.

    Args:
      last_token: ``[B]`` the last token of each row (fed first).
      total_len: ``[B]`` current length of each row (``last_token`` sits at ``total_len-1``).
      budget: ``[B]`` int32 tokens this row may still generate (``<= window``).
      active: ``[B]`` bool rows that decode this window.
      rng: a PRNG key; slot ``i`` at ``step`` uses ``fold_in(fold_in(rng, step), slot_ids[i])``.
    """
    b = last_token.shape[0]
    budget = jnp.where(active, jnp.minimum(budget, window), 0)

    def cond(state):
        i, _, _, _, count, done, _, _ = state
        return (i < window) & ~jnp.all(done | (count >= budget))

    def body(state):
        i, cur, pos, cache, count, done, toks, lps = state
        run = ~done & (count < budget)
        logits, cache = model.forward_with_cache(cur[:, None], pos[:, None], cache,
                                                 valid=run[:, None])
        keys = slot_keys(jax.random.fold_in(rng, i), slot_ids, step)
        # None switches truncation off at trace time (no full-vocabulary sort).
        nxt, lp = sample(logits[:, 0], keys, temperature=params.temperature,
                         top_p=params.top_p if params.top_p < 1.0 else None,
                         top_k=params.top_k if params.top_k > 0 else None,
                         greedy=params.greedy)
        idx = jnp.where(run, count, window)  # out of range -> dropped
        toks = toks.at[jnp.arange(b), idx].set(nxt, mode="drop")
        lps = lps.at[jnp.arange(b), idx].set(lp, mode="drop")
        count = count + run.astype(jnp.int32)
        done = done | (run & (nxt == eos_id))
        cur = jnp.where(run, nxt, cur)
        pos = pos + run.astype(jnp.int32)
        return i + 1, cur, pos, cache, count, done, toks, lps

    init = (
        jnp.int32(0), last_token.astype(jnp.int32), (total_len - 1).astype(jnp.int32), cache,
        jnp.zeros(b, jnp.int32), ~active, jnp.zeros((b, window), jnp.int32),
        jnp.zeros((b, window), jnp.float32),
    )
    steps, _, _, cache, count, done, toks, lps = jax.lax.while_loop(cond, body, init)
    hit_eos = done & active
    return WindowOut(toks, lps, count, hit_eos, steps), cache


@nnx.jit(static_argnames=("window", "eos_id", "params"))
def prefill_and_decode(model, cache, tokens, total_len, prefill_rows, active, budget, rng,
                       slot_ids, step, *, window: int, eos_id: int, params: SamplingParams):
    """One jitted call: prefill ``prefill_rows`` then decode a window for ``active`` rows."""
    cache = prefill(model, cache, tokens, total_len, prefill_rows)
    last = jnp.take_along_axis(tokens, jnp.maximum(total_len - 1, 0)[:, None], axis=1)[:, 0]
    return decode_window(model, cache, last, total_len, budget, active, rng, slot_ids, step,
                         window=window, eos_id=eos_id, params=params)
