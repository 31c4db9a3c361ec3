"""PPO losses with VAPO/DAPO options (docs/algorithm.md section 4), pure ``jax.numpy``.

Every loss takes per-token ``[B, T]`` arrays and a ``[B, T]`` mask and returns a
scalar plus a dict of scalar diagnostics.
"""

from __future__ import annotations

from typing import Literal

import jax.numpy as jnp
from jax import Array

Aggregation = Literal["token", "sample"]

# |log rho| beyond this is clamped before exp (verl's bound): exp(89) overflows float32 and the
# backward pass then multiplies 0 by inf, a NaN that would skip the whole minibatch.
LOG_RATIO_CLAMP = 20.0


def aggregate(per_token: Array, mask: Array, *, mode: Aggregation = "token",
              denom: Array | None = None) -> Array:
    """Reduces a ``[B, T]`` loss over ``mask``.

    ``token`` (VAPO/DAPO): sum over every masked token of the batch / number of
    masked tokens, so long sequences weigh by their length. ``sample``: mean over
    rows (with at least one masked token) of each row's token mean.

    ``denom`` replaces the count (masked tokens, or rows with one) by that of a larger batch
    these rows are part of: the results over a batch's parts then add up to the batch's.
    """
    m = mask.astype(jnp.float32)
    if mode == "token":
        n = m.sum() if denom is None else denom
        return (per_token * m).sum() / jnp.maximum(n, 1.0)
    if mode == "sample":
        n = m.sum(axis=1)
        row = (per_token * m).sum(axis=1) / jnp.maximum(n, 1.0)
        has = (n > 0).astype(jnp.float32)
        return (row * has).sum() / jnp.maximum(has.sum() if denom is None else denom, 1.0)
    raise ValueError(f"aggregation must be 'token' or 'sample', got {mode!r}")


def policy_loss(
    logp: Array,
    logp_old: Array,
    advantages: Array,
    mask: Array,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip_c: float | None = 10.0,
    aggregation: Aggregation = "token",
    n_tokens: Array | None = None,
    n_rows: Array | None = None,
    weights: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Clipped surrogate with clip-higher and dual clip.

    ``rho = exp(clip(logp - logp_old, -20, 20))`` (``LOG_RATIO_CLAMP``: no overflow, so no
    NaN gradient; a clamped token carries no gradient through rho, like any clipped one);
    ``l_t = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)``; for ``A < 0`` the
    dual clip caps ``l_t`` at ``c |A|`` so a huge ratio on a bad token cannot
    explode the update.

    Args:
      logp: ``[B, T]`` log-probs under the policy being trained.
      logp_old: ``[B, T]`` log-probs recorded at sampling time.
      advantages: ``[B, T]``.
      mask: ``[B, T]`` policy mask.
      n_tokens, n_rows: masked tokens / rows with one of the whole minibatch, when these
        rows are one part of it (``aggregate``'s ``denom``); the loss and the mean stats
        then add up over the parts.
      weights: ``[B, T]`` per-token weights of ``l_t`` (truncated importance sampling,
        ``tis_weights``; constants, no gradient); None: 1.
    Returns:
      ``(loss, {"clip_frac", "dual_clip_frac", "approx_kl", "ratio_mean",
      "log_ratio_absmax"})``.
    """
    m = mask.astype(jnp.float32)
    log_ratio = jnp.clip(logp - logp_old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) * m
    ratio = jnp.exp(log_ratio)
    surr1 = ratio * advantages
    surr2 = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = -jnp.minimum(surr1, surr2)
    dual = jnp.zeros_like(loss, dtype=bool)
    if dual_clip_c is not None:
        cap = dual_clip_c * jnp.abs(advantages)
        dual = (advantages < 0) & (loss > cap)
        loss = jnp.where(dual, cap, loss)
    if weights is not None:
        loss = loss * weights
    clipped = (surr2 < surr1).astype(jnp.float32)
    stats = {
        "clip_frac": aggregate(clipped, m, denom=n_tokens),
        "dual_clip_frac": aggregate(dual.astype(jnp.float32), m, denom=n_tokens),
        # k3 estimator of KL(old || new): unbiased and always >= 0.
        "approx_kl": aggregate(jnp.expm1(-log_ratio) + log_ratio, m, denom=n_tokens),
        "ratio_mean": aggregate(ratio, m, denom=n_tokens),
        "log_ratio_absmax": jnp.abs(log_ratio).max(),  # masked tokens are 0
    }
    denom = n_tokens if aggregation == "token" else n_rows
    return aggregate(loss, m, mode=aggregation, denom=denom), stats


def sampler_gap(logp: Array, sample_logp: Array, mask: Array, *, eps_low: float,
                eps_high: float, n_tokens: Array | None = None) -> dict[str, Array]:
    """How far the learner's log-probs of the sampled tokens are from the sampler's, before
    any update (``[B, T]`` each; ``mask`` the tokens trained on). With
    ``d = logp - sample_logp``: ``sampler_gap_abs_mean`` (token mean of ``|d|``; its exp is
    NeMo-RL's ``token_mult_prob_error``), ``sampler_gap_abs_max``, ``sampler_kl`` (k3 estimate
    of ``KL(sampler || learner)``, ``exp(d) - 1 - d``, on tokens the sampler drew) and
    ``sampler_clip_frac`` (tokens whose ratio ``exp(d)`` is already outside
    ``[1 - eps_low, 1 + eps_high]``). All 0 when the two programs agree exactly."""
    m = mask.astype(jnp.float32)
    d = (logp - sample_logp) * m
    dc = jnp.clip(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = jnp.exp(dc)
    out_of_range = ((ratio < 1.0 - eps_low) | (ratio > 1.0 + eps_high)).astype(jnp.float32)
    return {"sampler_gap_abs_mean": aggregate(jnp.abs(d), m, denom=n_tokens),
            "sampler_gap_abs_max": jnp.abs(d).max(),
            "sampler_kl": aggregate(jnp.expm1(dc) - dc, m, denom=n_tokens),
            "sampler_clip_frac": aggregate(out_of_range, m, denom=n_tokens)}


def tis_weights(learner_logp: Array, sample_logp: Array, cap: float) -> Array:
    """Truncated importance weights ``min(exp(learner_logp - sample_logp), cap)`` (``[B, T]``):
    the old policy's probability of each sampled token over the sampler's, capped so a token
    the sampler under-rated cannot dominate the update (``|log|`` clamped before exp)."""
    d = jnp.clip(learner_logp - sample_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return jnp.minimum(jnp.exp(d), cap)


def value_loss(
    values: Array,
    values_old: Array,
    returns: Array,
    mask: Array,
    *,
    clip_low: float | None = 0.5,
    clip_high: float | None = 0.6,
    aggregation: Aggregation = "token",
    n_tokens: Array | None = None,
    n_rows: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Clipped value loss ``0.5 max((V-G)^2, (clip(V, V_old - c_lo, V_old + c_hi) - G)^2)``.

    Args:
      values: ``[B, T]`` current critic outputs; values_old: ``[B, T]`` at rollout time;
      returns: ``[B, T]`` targets (MC returns); mask: ``[B, T]`` value mask.
      clip_low/clip_high: ``None`` disables clipping.
      n_tokens, n_rows: as in ``policy_loss``.
    Returns:
      ``(loss, {"value_clip_frac"})``.
    """
    m = mask.astype(jnp.float32)
    err = (values - returns) ** 2
    if clip_low is None or clip_high is None:
        per_tok = 0.5 * err
        clip_frac = jnp.zeros(())
    else:
        v_clip = jnp.clip(values, values_old - clip_low, values_old + clip_high)
        err_clip = (v_clip - returns) ** 2
        per_tok = 0.5 * jnp.maximum(err, err_clip)
        clip_frac = aggregate((err_clip > err).astype(jnp.float32), m, denom=n_tokens)
    denom = n_tokens if aggregation == "token" else n_rows
    return aggregate(per_tok, m, mode=aggregation, denom=denom), {"value_clip_frac": clip_frac}


def explained_variance(values: Array, returns: Array, mask: Array) -> Array:
    """``1 - Var(G - V) / Var(G)`` over ``mask`` (``[B, T]`` each): how much of the returns'
    spread the critic predicts (1: all, 0: no better than their mean; 0 when the returns
    have no spread)."""
    m = mask.astype(jnp.float32)
    n = jnp.maximum(m.sum(), 1.0)
    mean_g = (returns * m).sum() / n
    var_g = (((returns - mean_g) ** 2) * m).sum() / n
    resid = returns - values
    mean_r = (resid * m).sum() / n
    var_r = (((resid - mean_r) ** 2) * m).sum() / n
    return jnp.where(var_g > 0, 1.0 - var_r / jnp.maximum(var_g, 1e-12), 0.0)


def kl_to_reference(logp: Array, ref_logp: Array, mask: Array,
                    n_tokens: Array | None = None) -> Array:
    """KL(pi || pi_ref) per sampled token by the k3 estimator, ``exp(d) - d - 1`` with
    ``d = ref_logp - logp`` (unbiased for tokens sampled from ``pi``, always >= 0; verl's
    ``low_var_kl``), mean over ``mask`` (token-level, ``n_tokens`` as in ``policy_loss``).
    ``d`` is clamped to ``+-LOG_RATIO_CLAMP`` so a token the reference finds impossible
    cannot overflow. ``logp``/``ref_logp``/``mask``: ``[B, T]``."""
    d = jnp.clip(ref_logp - logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return aggregate(jnp.expm1(d) - d, mask, mode="token", denom=n_tokens)


def nll_loss(logp: Array, mask: Array, n_tokens: Array | None = None) -> Array:
    """VAPO positive-example loss: mean token NLL over ``mask``; 0 when the mask is
    empty (no correct sample in the batch). ``logp``/``mask``: ``[B, T]``; ``n_tokens`` as
    in ``policy_loss``."""
    return aggregate(-logp, mask, mode="token", denom=n_tokens)
