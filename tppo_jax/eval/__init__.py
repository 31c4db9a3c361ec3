"""Evaluation metrics."""

from tppo_jax.eval.metrics import (
    avg_at_k,
    pass_at_k,
    pass_at_k_batch,
    pass_at_k_from_correct,
    summarize,
)

__all__ = ["avg_at_k", "pass_at_k", "pass_at_k_batch", "pass_at_k_from_correct", "summarize"]
