"""Pure T-PPO / VAPO math: advantages, masks, losses (imports jax only)."""

from tppo_jax.algo.advantages import (
    advantage_mass,
    discounted_backward,
    effective_length,
    egae,
    gae,
    group_baseline,
    group_baseline_frac,
    length_adaptive_lambda,
    mc_returns,
)
from tppo_jax.algo.losses import (
    aggregate,
    explained_variance,
    kl_to_reference,
    nll_loss,
    policy_loss,
    sampler_gap,
    tis_weights,
    value_loss,
)
from tppo_jax.algo.masks import (
    masked_clip,
    masked_mean,
    masked_whiten,
    policy_mask,
    positive_example_mask,
    response_mask,
    span_mask,
    value_mask,
    window_mask,
)

__all__ = [
    "advantage_mass", "aggregate", "discounted_backward", "effective_length", "egae",
    "explained_variance", "gae", "group_baseline", "group_baseline_frac",
    "kl_to_reference",
    "length_adaptive_lambda", "masked_clip", "masked_mean", "masked_whiten", "mc_returns",
    "nll_loss", "policy_loss", "policy_mask", "positive_example_mask", "response_mask",
    "sampler_gap", "span_mask", "tis_weights", "value_loss", "value_mask", "window_mask",
]
