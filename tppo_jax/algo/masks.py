"""Token masks for T-PPO's token filtering (docs/algorithm.md section 3), whitening and clamping.

Rows are sequences laid out as ``[prompt | earlier windows | current window | pad]``
along a length-``T`` axis. Per row we know ``prompt_len``, ``window_start`` (index of
the first current-window token) and ``window_len``; the row's total length is
``window_start + window_len``. Every mask is a ``[B, T]`` float32 array of 0/1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array


def span_mask(length: int, start: Array, end: Array) -> Array:
    """``[B, length]`` mask of positions ``start[b] <= t < end[b]``."""
    t = jnp.arange(length)[None, :]
    return ((t >= start[:, None]) & (t < end[:, None])).astype(jnp.float32)


def window_mask(length: int, window_start: Array, window_len: Array) -> Array:
    """1 on the current window's tokens: ``[B, length]``."""
    return span_mask(length, window_start, window_start + window_len)


def response_mask(length: int, prompt_len: Array, total_len: Array) -> Array:
    """1 on every response token (all windows): ``[B, length]``."""
    return span_mask(length, prompt_len, total_len)


def policy_mask(
    length: int,
    window_start: Array,
    window_len: Array,
    finished: Array,
    *,
    ignore_last: int = 8,
) -> Array:
    """Tokens the policy trains on this step: ``[B, length]``.

    The current window's tokens, minus the last ``ignore_last`` tokens of an
    *unfinished* window: their EGAE estimate rests almost entirely on the
    bootstrap ``V(s_l) := V(s_{l-1})``, so they are dropped (advantage 0, and out of
    the whitening statistics). Prompt and earlier-window tokens are 0: they were
    trained when they were generated.
    """
    keep = jnp.where(finished, window_len, jnp.maximum(window_len - ignore_last, 0))
    return window_mask(length, window_start, keep)


def value_mask(length: int, prompt_len: Array, total_len: Array, finished: Array) -> Array:
    """Critic targets: every response token of *finished* rows (MC returns need the
    outcome); 0 on prompts and on every token of unfinished rows. ``[B, length]``."""
    return response_mask(length, prompt_len, total_len) * finished[:, None].astype(jnp.float32)


def positive_example_mask(
    length: int, prompt_len: Array, total_len: Array, finished: Array, correct: Array
) -> Array:
    """VAPO's positive-example NLL mask: response tokens of finished, correct rows."""
    ok = (finished & correct)[:, None].astype(jnp.float32)
    return response_mask(length, prompt_len, total_len) * ok


def masked_mean(x: Array, mask: Array) -> Array:
    """Mean of ``x`` over ``mask``; 0 when the mask is empty."""
    m = mask.astype(jnp.float32)
    return (x * m).sum() / jnp.maximum(m.sum(), 1.0)


def masked_whiten(x: Array, mask: Array, *, shift_mean: bool = True, eps: float = 1e-8) -> Array:
    """Normalises ``x`` to zero mean, unit variance over ``mask`` (batch statistics).

    Positions outside the mask are returned as 0. With fewer than two masked
    entries the variance is undefined; ``x`` is then only centred.
    """
    m = mask.astype(jnp.float32)
    n = m.sum()
    mean = (x * m).sum() / jnp.maximum(n, 1.0)
    var = (((x - mean) ** 2) * m).sum() / jnp.maximum(n - 1.0, 1.0)
    scale = jnp.where(n > 1, jax.lax.rsqrt(var + eps), 1.0)
    out = (x - mean) * scale if shift_mean else x * scale
    return out * m


def masked_clip(x: Array, mask: Array, *, bound: float = 10.0) -> Array:
    """Clamps to ``[-bound, bound]`` and zeroes positions outside the mask."""
    return jnp.clip(x, -bound, bound) * mask.astype(jnp.float32)
