"""The policy and value losses of one row group, from ``tppo_jax.algo``'s formulas.

Each loss divides by the whole minibatch's counts (``denoms``), so a minibatch's loss and
its mean stats are the sums over its row groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tppo_jax import algo
from tppo_jax.config import AlgoConfig, Config, OptimConfig
from tppo_jax.kernels.logprobs import token_logprobs
from tppo_jax.learner.batch import PolicyRows, TokenRows, ValueRows
from tppo_jax.models.precision import cast_params, compute_dtype

Array = jax.Array


@dataclass(frozen=True)
class LearnerConfig:
    """The static (hashable) knobs the jitted programs close over."""

    algo: AlgoConfig
    optim: OptimConfig
    window: int
    temperature: float
    # The dtype the forward passes cast the stored params to (bfloat16 compute on float32
    # master params, models/precision.py); None: the params' own dtype, no cast
    compute_dtype: str | None = None
    # The dtype the TrainState stores the trained params (and so the AdamW moments) in:
    # float32 masters of a bfloat16 model (learner/init.py); None: as the model was loaded
    param_dtype: str | None = None

    @classmethod
    def from_config(cls, cfg: Config, window: int | None = None) -> LearnerConfig:
        """A run's learner knobs: its algo and optim sections, the window (``rollout.window``
        unless given, at most L), the sampling temperature the log-probs are taken at
        (greedy decoding, temperature 0, scores at 1), the compute and the stored dtype."""
        r, m = cfg.rollout, cfg.model
        return cls(algo=cfg.algo, optim=cfg.optim,
                   window=min(r.window if window is None else window, r.max_response_len),
                   temperature=r.temperature if r.temperature > 0 else 1.0,
                   compute_dtype=compute_dtype(m.dtype, m.param_dtype),
                   param_dtype=None if m.param_dtype == m.dtype else m.param_dtype)

    def merge(self, graphdef: Any, params: Any) -> nnx.Module:
        """The model of ``params`` as the forward runs it (cast to ``compute_dtype``; the
        gradient flows back through the cast in the params' dtype)."""
        return nnx.merge(graphdef, cast_params(params, self.compute_dtype))


def shift_right(x: Array) -> Array:
    """``[B, S-1]`` per-next-token quantities -> ``[B, S]`` indexed by token (col 0 = 0)."""
    return jnp.pad(x, ((0, 0), (1, 0)))


def logprobs_from_hidden(model: nnx.Module, hidden: Array, tokens: Array, temperature: float
                         ) -> tuple[Array, Array]:
    """``logp[b, t]`` and entropy of token ``t``'s distribution, ``[B, S]`` each, chunked
    over the vocabulary (``hidden [B, S, H]``: the model's last hidden states)."""
    lp, ent = token_logprobs(hidden[:, :-1], model.lm_head_weight(), tokens[:, 1:],
                             temperature=temperature, chunk_size=128)
    return shift_right(lp), shift_right(ent)


def critic_token_values(model: nnx.Module, tokens: Array, attn: Array) -> Array:
    """``V(s_t)`` for every token ``t``: ``[B, S]`` (the critic reads position ``t-1``)."""
    return shift_right(model(tokens, attention_mask=attn)[:, :-1])


def reference_kl(ref: nnx.Module, logp: Array, mb: PolicyRows, n_tokens: Array,
                 temperature: float) -> Array:
    """Token-mean k3 estimate of ``KL(policy || ref)`` on the sampled tokens over
    ``mb.policy_mask`` (``logp [R, W]``: the policy's); the reference carries no gradient."""
    hidden = jax.lax.stop_gradient(ref.hidden_states(mb.tokens, attention_mask=mb.attn))
    ref_logp, _ = logprobs_from_hidden(ref, hidden, mb.tokens, temperature)
    return algo.kl_to_reference(logp, jax.lax.stop_gradient(ref_logp), mb.policy_mask,
                                n_tokens=n_tokens)


def policy_loss(graphdef: Any, params: Any, mb: PolicyRows, denoms: dict[str, Array],
                ref: Any = None, *, cfg: LearnerConfig) -> tuple[Array, dict[str, Array]]:
    """Clipped surrogate on the policy mask + ``nll_coef`` x positive-example NLL (+
    ``kl_coef`` x KL to the reference policy, whose params ``ref`` are given when
    ``kl_coef > 0``), each divided by the minibatch's counts (``denoms``: ``tokens`` /
    ``rows`` of the policy mask, ``positive`` tokens)."""
    a = cfg.algo
    model = cfg.merge(graphdef, params)
    hidden = model.hidden_states(mb.tokens, attention_mask=mb.attn)
    logp, ent = logprobs_from_hidden(model, hidden, mb.tokens, cfg.temperature)
    # sampler_correction: the old policy is the learner's own forward before the update
    old = mb.sample_logprobs if mb.old_logprobs is None else mb.old_logprobs
    if a.sampler_correction != "none" and mb.old_logprobs is None:
        raise ValueError(f"algo.sampler_correction: {a.sampler_correction} needs the targets' "
                         "old_logprobs (Learner.step computes them)")
    weights = (algo.tis_weights(mb.old_logprobs, mb.sample_logprobs, a.tis_cap)
               if a.sampler_correction == "tis" else None)
    pl, stats = algo.policy_loss(logp, old, mb.advantages, mb.policy_mask,
                                 eps_low=a.eps_low, eps_high=a.eps_high,
                                 dual_clip_c=a.dual_clip_c, aggregation=a.loss_aggregation,
                                 n_tokens=denoms["tokens"], n_rows=denoms["rows"],
                                 weights=weights)
    nll = algo.nll_loss(logp, mb.positive_mask, n_tokens=denoms["positive"])
    stats = dict(stats, pg_loss=pl, nll_loss=nll,
                 entropy=algo.aggregate(ent, mb.policy_mask, denom=denoms["tokens"]),
                 **algo.sampler_gap(jax.lax.stop_gradient(logp), mb.sample_logprobs,
                                    mb.policy_mask, eps_low=a.eps_low, eps_high=a.eps_high,
                                    n_tokens=denoms["tokens"]))
    if weights is not None:
        stats["tis_weight_mean"] = algo.aggregate(weights, mb.policy_mask,
                                                  denom=denoms["tokens"])
    loss = pl + a.nll_coef * nll
    if ref is not None:
        kl = reference_kl(cfg.merge(graphdef, jax.lax.stop_gradient(ref)), logp, mb,
                          denoms["tokens"], cfg.temperature)
        stats["kl_ref"] = kl
        loss = loss + a.kl_coef * kl
    return loss, stats


def value_loss(graphdef: Any, params: Any, mb: ValueRows, denoms: dict[str, Array], *,
               cfg: LearnerConfig) -> tuple[Array, dict[str, Array]]:
    """Clipped value regression to MC returns on one row group's value mask (finished rows
    only), divided by the minibatch's ``denoms`` (``tokens`` / ``rows`` of the value mask)."""
    a = cfg.algo
    v = critic_token_values(cfg.merge(graphdef, params), mb.tokens, mb.attn)
    return algo.value_loss(v, mb.values_old, mb.returns, mb.value_mask,
                           clip_low=a.value_clip_low, clip_high=a.value_clip_high,
                           aggregation=a.loss_aggregation, n_tokens=denoms["tokens"],
                           n_rows=denoms["rows"])


def group_logprobs(graphdef: Any, params: Any, group: TokenRows, *, cfg: LearnerConfig
                   ) -> Array:
    """``[R, W]`` the policy's log-probs of a row group's tokens (no gradient): the
    learner's old policy for ``algo.sampler_correction``."""
    model = cfg.merge(graphdef, params)
    hidden = model.hidden_states(group.tokens, attention_mask=group.attn)
    return logprobs_from_hidden(model, hidden, group.tokens, cfg.temperature)[0]
