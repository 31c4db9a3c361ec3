"""Advantage estimators: GAE, EGAE (T-PPO), Monte-Carlo returns, VAPO's lambdas.

All functions are pure ``jax.numpy`` over right-padded ``[B, T]`` arrays:
``mask[b, t] = 1`` marks the real tokens of row ``b`` (a prefix of the row).
``values[b, t] = V(s_t)`` is the critic's estimate *before* token ``t`` is emitted.

The backward recursion ``A_t = delta_t + gamma * lam * A_{t+1}`` is a linear
recurrence, so it is provided both as a sequential ``lax.scan`` (O(T) depth) and a
``lax.associative_scan`` (O(log T) depth, for 8k-token windows); tests check
they agree. ``method="associative"`` is the default.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from jax import Array

Method = Literal["scan", "associative"]


def _check_bt(name: str, x: Array, shape: tuple[int, ...]) -> None:
    if x.shape != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {x.shape}")


def _per_row(x: float | Array, batch: int) -> Array:
    """A scalar or ``[B]`` hyper-parameter as a ``[B, 1]`` float32 array."""
    x = jnp.asarray(x, jnp.float32)
    if x.ndim == 0:
        x = jnp.broadcast_to(x, (batch,))
    if x.shape != (batch,):
        raise ValueError(f"per-sequence parameter must be a scalar or [{batch}], got {x.shape}")
    return x[:, None]


def discounted_backward(deltas: Array, coefs: Array, *, method: Method = "associative") -> Array:
    """Solves ``A_t = deltas_t + coefs_t * A_{t+1}`` backwards with ``A_T = 0``.

    Args:
      deltas: ``[B, T]`` float.
      coefs: ``[B, T]`` float; ``coefs[:, t]`` multiplies ``A_{t+1}``.
      method: ``"scan"`` (sequential) or ``"associative"`` (log-depth).
    Returns:
      ``[B, T]`` float32.
    """
    deltas = deltas.astype(jnp.float32)
    coefs = coefs.astype(jnp.float32)
    if method == "scan":

        def step(carry: Array, x: tuple[Array, Array]) -> tuple[Array, Array]:
            d, c = x
            a = d + c * carry
            return a, a

        _, out = jax.lax.scan(step, jnp.zeros(deltas.shape[0], jnp.float32), (deltas.T, coefs.T),
                              reverse=True)
        return out.T
    if method == "associative":
        # Element t is the affine map A -> d_t + c_t * A. Composing the map of the
        # suffix (later positions, `acc`) into position t gives (c_t*c_acc, d_t + c_t*d_acc).
        def compose(acc: tuple[Array, Array], cur: tuple[Array, Array]) -> tuple[Array, Array]:
            c_acc, d_acc = acc
            c_cur, d_cur = cur
            return c_cur * c_acc, d_cur + c_cur * d_acc

        _, out = jax.lax.associative_scan(compose, (coefs, deltas), reverse=True, axis=1)
        return out
    raise ValueError(f"method must be 'scan' or 'associative', got {method!r}")


def egae(
    rewards: Array,
    values: Array,
    mask: Array,
    finished: Array,
    *,
    gamma: float | Array = 1.0,
    lam: float | Array = 1.0,
    method: Method = "associative",
) -> Array:
    """Extended GAE over the current window (T-PPO).

    ``delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)`` and
    ``A_t = sum_k (gamma*lam)^k delta_{t+k}`` over the row's masked tokens. The
    state after the last token ``n-1`` is terminal (``V(s_n) = 0``) for finished
    rows; for unfinished rows it is unseen and bootstrapped as
    ``V(s_n) := V(s_{n-1})``, so ``delta_{n-1} = r_{n-1} + (gamma - 1) V(s_{n-1})``.

    Args:
      rewards: ``[B, T]`` per-token rewards (sparse: the last token of finished rows).
      values: ``[B, T]`` ``V(s_t)``.
      mask: ``[B, T]`` 1 on real window tokens, right-padded.
      finished: ``[B]`` bool, row ended (EOS or max length) inside this window.
      gamma: discount, scalar or ``[B]``.
      lam: GAE lambda, scalar or ``[B]`` (length-adaptive lambda is per row).
      method: recursion implementation, see ``discounted_backward``.
    Returns:
      ``[B, T]`` float32 advantages, 0 where ``mask`` is 0.
    """
    b, t = rewards.shape
    _check_bt("values", values, (b, t))
    _check_bt("mask", mask, (b, t))
    _check_bt("finished", finished, (b,))
    m = mask.astype(jnp.float32)
    r = rewards.astype(jnp.float32) * m
    v = values.astype(jnp.float32) * m
    g = _per_row(gamma, b)
    lm = _per_row(lam, b)

    # Value of the state after the last real token of each row.
    length = m.sum(axis=1).astype(jnp.int32)
    last_v = jnp.take_along_axis(v, jnp.maximum(length - 1, 0)[:, None], axis=1)[:, 0]
    bootstrap = jnp.where(finished, 0.0, last_v)[:, None]

    next_m = jnp.pad(m[:, 1:], ((0, 0), (0, 1)))
    next_v = jnp.pad(v[:, 1:], ((0, 0), (0, 1)))
    is_last = m * (1.0 - next_m)
    next_v = next_m * next_v + is_last * bootstrap
    deltas = (r + g * next_v - v) * m
    adv = discounted_backward(deltas, g * lm * next_m, method=method)
    return adv * m


def gae(
    rewards: Array,
    values: Array,
    mask: Array,
    *,
    gamma: float | Array = 1.0,
    lam: float | Array = 1.0,
    method: Method = "associative",
) -> Array:
    """Classic GAE on complete sequences: ``egae`` with every row finished (``V(s_T) = 0``).

    Shapes as in ``egae``; returns ``[B, T]`` float32.
    """
    finished = jnp.ones(rewards.shape[:1], dtype=bool)
    return egae(rewards, values, mask, finished, gamma=gamma, lam=lam, method=method)


def mc_returns(
    rewards: Array,
    mask: Array,
    *,
    gamma: float | Array = 1.0,
    method: Method = "associative",
) -> Array:
    """Monte-Carlo returns ``G_t = sum_{k>=t} gamma^(k-t) r_k`` (critic targets, lambda = 1).

    Only meaningful on finished rows; the value mask removes the rest.

    Args:
      rewards: ``[B, T]``; mask: ``[B, T]`` right-padded; gamma: scalar or ``[B]``.
    Returns:
      ``[B, T]`` float32, 0 where ``mask`` is 0.
    """
    b = rewards.shape[0]
    m = mask.astype(jnp.float32)
    next_m = jnp.pad(m[:, 1:], ((0, 0), (0, 1)))
    coefs = _per_row(gamma, b) * next_m
    return discounted_backward(rewards.astype(jnp.float32) * m, coefs, method=method) * m


def length_adaptive_lambda(
    lengths: Array,
    *,
    alpha: float = 0.05,
    lam_min: float = 0.95,
) -> Array:
    """VAPO's length-adaptive policy lambda ``max(lam_min, 1 - 1/(alpha * n))``.

    The formula is <= 0 for ``n <= 1/alpha`` (20 tokens at alpha = 0.05), hence the
    clamp. For unfinished T-PPO rows the caller passes ``n = tokens so far + l/2``
    (see ``effective_length``).

    Args:
      lengths: ``[B]`` response lengths (int or float).
    Returns:
      ``[B]`` float32 lambdas in ``[lam_min, 1)``.
    """
    n = jnp.maximum(jnp.asarray(lengths, jnp.float32), 1.0)
    return jnp.maximum(jnp.float32(lam_min), 1.0 - 1.0 / (alpha * n))


def effective_length(
    response_len: Array,
    finished: Array,
    *,
    window: int,
) -> Array:
    """Length used by ``length_adaptive_lambda``: an unfinished row is expected to run on,
    so it counts as ``tokens so far + window/2`` (verl's T-PPO recipe).

    Args:
      response_len: ``[B]`` response tokens generated so far (all windows).
      finished: ``[B]`` bool.
    Returns:
      ``[B]`` float32.
    """
    n = jnp.asarray(response_len, jnp.float32)
    return jnp.where(finished, n, n + window / 2.0)


def advantage_mass(advantages: Array, mask: Array, finished: Array, correct: Array
                   ) -> dict[str, Array]:
    """Where the policy update's advantage goes: its mean per trained token on rows that
    finished right, finished wrong and did not finish, and the fraction of trained tokens
    of right answers whose advantage is negative (a right answer pushed down: a poor
    critic's credit assignment, or noise).

    Args:
      advantages, mask: ``[B, T]`` (the policy mask: tokens the update trains on).
      finished, correct: ``[B]`` bool.
    Returns:
      scalars ``adv_right_mean``, ``adv_wrong_mean``, ``adv_unfinished_mean``,
      ``adv_right_neg_frac`` (0 where a set is empty).
    """
    m = mask.astype(jnp.float32)
    right = (finished & correct)[:, None] * m
    wrong = (finished & ~correct)[:, None] * m
    unfin = (~finished)[:, None] * m

    def mean(x: Array, w: Array) -> Array:
        return (x * w).sum() / jnp.maximum(w.sum(), 1.0)

    return {"adv_right_mean": mean(advantages, right), "adv_wrong_mean": mean(advantages, wrong),
            "adv_unfinished_mean": mean(advantages, unfin),
            "adv_right_neg_frac": mean((advantages < 0).astype(jnp.float32), right)}


def group_baseline(reward: Array, group: Array, finished: Array) -> tuple[Array, Array]:
    """Leave-one-out baseline over a prompt's samples: for each row, the mean reward of the
    *other* finished rows of its group in the batch (GRPO/RLOO's baseline, unbiased: the
    siblings' rewards do not depend on the row's own actions).

    Args:
      reward: ``[B]`` outcome rewards (meaningful on finished rows).
      group: ``[B]`` int group ids (the G samples of one prompt share one).
      finished: ``[B]`` bool.
    Returns:
      ``(baseline [B] float32, has [B] bool)``; ``has`` is False where the row has no such
      sibling (the baseline then reads 0).
    """
    b = reward.shape[0]
    same = (group[:, None] == group[None, :]) & finished[None, :] & ~jnp.eye(b, dtype=bool)
    n = same.sum(axis=1).astype(jnp.float32)
    total = (same * reward.astype(jnp.float32)[None, :]).sum(axis=1)
    return total / jnp.maximum(n, 1.0), n > 0


def group_baseline_frac(group: Array, finished: Array) -> Array:
    """The fraction of finished rows with a sibling that finished in the same step: those
    whose advantage ``algo.advantage_baseline: group`` takes from their group (the others
    fall back to EGAE on the critic). Under T-PPO a prompt's samples finish in different
    steps, so this is below 1 where PPO's is 1. ``group, finished: [B]`` -> scalar (0: none
    finished)."""
    _, has = group_baseline(jnp.zeros(group.shape, jnp.float32), group, finished)
    f = finished.astype(jnp.float32)
    return (has * f).sum() / jnp.maximum(f.sum(), 1.0)

