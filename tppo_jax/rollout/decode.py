"""The decode core: prefill, the window ``lax.while_loop``, sampling, one RNG rule.

Every token this package generates (training windows, held-out eval, ``tppo serve``) comes
from ``decode_window`` here, driven by ``rollout.engine.DecodeEngine``. It works over any
``KVCache`` (``DenseKVCache`` or ``rollout.paged_cache.PagedKVCache``): the cache only
stores and attends; this module decides what to feed and what to keep.

Cache invariant: a live row has positions ``[0, position)`` cached and its pending token
``next_token`` (a prompt's last token, or the last token sampled) sits at ``position`` and
has not been fed yet. Each loop iteration feeds it, samples the following token and makes
that the pending one. So a continuation resumes exactly where its previous window stopped,
and one token (the engine's ``generate_step``, JetStream's ``generate``) is a window of 1.

RNG rule (the only one): response token ``n`` of the sequence with id ``seq_id`` is drawn
with ``fold_in(fold_in(rng, n), seq_id)``. Results then depend on neither the batch
composition, nor the slot, nor the window size: T-PPO (``l < L``) and PPO (``l = L``) sample
the same tokens from the same weights, and serving one token at a time equals one window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from tppo_jax.models.cache import KVCache
from tppo_jax.rollout.sampling import sample, sample_per_row

Array = jax.Array


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn. Static under jit (hashable): one compile per setting.

    per_row: each row's temperature (0 = greedy) and top_p come from the decode state
    (traced, so one program serves every request's setting: ``tppo serve``); temperature /
    top_p here are then only the engine's defaults, and log-probs are those of the
    distribution each row actually draws from (``sampling.sample_per_row``).
    top_logprobs: per-row mode, also return the ``top_logprobs`` most likely tokens of that
    distribution with their log-probs.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    per_row: bool = False
    top_logprobs: int = 0

    def sample_kwargs(self) -> dict:
        """The ``sampling.sample`` arguments; None switches a truncation off at trace time
        (no full-vocabulary sort when top-p / top-k are off)."""
        return dict(temperature=self.temperature,
                    top_p=self.top_p if self.top_p < 1.0 else None,
                    top_k=self.top_k if self.top_k > 0 else None,
                    greedy=self.greedy)


class WindowOut(NamedTuple):
    """What one window produced, per row (``W`` = the window).

    tokens: ``[B, W]`` new tokens (0 after ``count``); logprobs: ``[B, W]`` float32 log-prob of
    each under the sampling policy; count: ``[B]`` int32 tokens generated; hit_eos: ``[B]``
    bool, the row's last new token is an EOS id; steps: () int32 loop iterations run (the loop
    exits early once every row is done); top_ids / top_logprobs: ``[B, W, N]`` the N =
    ``SamplingParams.top_logprobs`` most likely tokens at each step (N = 0 unless asked).
    """

    tokens: Array
    logprobs: Array
    count: Array
    hit_eos: Array
    steps: Array
    top_ids: Array
    top_logprobs: Array


def sequence_keys(rng: Array, generated: Array, seq_id: Array) -> Array:
    """``[B]`` keys ``fold_in(fold_in(rng, generated_b), seq_id_b)`` (the RNG rule above).

    Args:
      rng: one PRNG key; generated: ``[B]`` response tokens each sequence already has;
      seq_id: ``[B]`` stable per-sequence ids.
    """
    one = lambda n, s: jax.random.fold_in(jax.random.fold_in(rng, n), s)  # noqa: E731
    return jax.vmap(one)(generated.astype(jnp.uint32), seq_id.astype(jnp.uint32))


def is_eos(tokens: Array, eos_ids: Sequence[int]) -> Array:
    """``tokens`` (any shape) is one of the static ``eos_ids`` (empty: never)."""
    hit = jnp.zeros(tokens.shape, bool)
    for e in eos_ids:
        hit = hit | (tokens == e)
    return hit


def prefill(model: nnx.Module, cache: KVCache, tokens: Array, lengths: Array, rows: Array
            ) -> KVCache:
    """Caches positions ``[0, lengths - 1)`` of the selected rows (their last token stays
    pending, see the module docstring); other rows' cache entries are untouched.

    Args:
      tokens: ``[B, T]`` right-padded tokens (prompt, or prompt + earlier windows).
      lengths: ``[B]`` tokens per row; rows: ``[B]`` bool, the rows to (re)prefill.
    """
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    valid = (positions < (lengths - 1)[:, None]) & rows[:, None]
    _, cache = model.forward_with_cache(tokens, positions, cache, valid=valid, prefill=True)
    return cache


def decode_window(model: nnx.Module, cache: KVCache, next_token: Array, position: Array,
                  generated: Array, seq_id: Array, budget: Array, rng: Array, *, window: int,
                  eos_ids: tuple[int, ...], params: SamplingParams,
                  row_sampling: tuple[Array, Array] | None = None
                  ) -> tuple[WindowOut, KVCache]:
    """Generates up to ``budget`` (<= ``window``) tokens per row in one ``lax.while_loop``.

    Args:
      next_token: ``[B]`` each row's pending token (fed first), at ``position`` ``[B]``.
      generated: ``[B]`` response tokens each row already has (indexes its RNG stream).
      seq_id: ``[B]`` per-sequence ids; budget: ``[B]`` int32 tokens the row may generate
        (0 = the row sits this window out). A paged cache must already hold pages for them.
      window: static loop bound and output width; eos_ids: static stop tokens.
      row_sampling: ``(temperature [B], top_p [B])`` when ``params.per_row``.
    """
    b, n_top = next_token.shape[0], params.top_logprobs if params.per_row else 0
    budget = jnp.clip(budget, 0, window).astype(jnp.int32)
    rows = jnp.arange(b)

    def cond(carry):
        i, _, _, _, count, done = carry[:6]
        return (i < window) & jnp.any(~done & (count < budget))

    def body(carry):
        i, cur, pos, cache, count, done, toks, lps, top_ids, top_lps = carry
        run = ~done & (count < budget)
        logits, cache = model.forward_with_cache(cur[:, None], pos[:, None], cache,
                                                 valid=run[:, None])
        keys = sequence_keys(rng, generated + count, seq_id)
        idx = jnp.where(run, count, window)  # out of range -> dropped
        if params.per_row:
            nxt, lp, t_ids, t_lps = sample_per_row(
                logits[:, 0], keys, *row_sampling, top_k=params.top_k or None, n_top=n_top)
            top_ids = top_ids.at[rows, idx].set(t_ids, mode="drop")
            top_lps = top_lps.at[rows, idx].set(t_lps, mode="drop")
        else:
            nxt, lp = sample(logits[:, 0], keys, **params.sample_kwargs())
        toks = toks.at[rows, idx].set(nxt, mode="drop")
        lps = lps.at[rows, idx].set(lp, mode="drop")
        step = run.astype(jnp.int32)
        done = done | (run & is_eos(nxt, eos_ids))
        return (i + 1, jnp.where(run, nxt, cur), pos + step, cache, count + step, done,
                toks, lps, top_ids, top_lps)

    init = (jnp.int32(0), next_token.astype(jnp.int32), position.astype(jnp.int32), cache,
            jnp.zeros(b, jnp.int32), jnp.zeros(b, bool), jnp.zeros((b, window), jnp.int32),
            jnp.zeros((b, window), jnp.float32), jnp.zeros((b, window, n_top), jnp.int32),
            jnp.zeros((b, window, n_top), jnp.float32))
    steps, _, _, cache, count, done, toks, lps, top_ids, top_lps = jax.lax.while_loop(
        cond, body, init)
    return WindowOut(toks, lps, count, done, steps, top_ids, top_lps), cache
