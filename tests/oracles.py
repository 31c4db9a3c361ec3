"""Reference computations the tests compare the learner against (not part of the package).

``tests/`` is on ``sys.path`` (its conftest's folder), so a test imports these as
``from oracles import ...``.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from tppo_jax.learner import Learner, LearnerConfig, RowPlan, Targets, TrainBatch
from tppo_jax.learner.estimators import compute_targets
from tppo_jax.learner.losses import critic_token_values, logprobs_from_hidden


def policy_token_logprobs(model: nnx.Module, tokens: jax.Array, attn: jax.Array,
                          temperature: float) -> tuple[jax.Array, jax.Array]:
    """``logp[b, t]`` and entropy of token ``t``'s distribution, ``[B, S]`` each: one
    forward over the whole buffer."""
    return logprobs_from_hidden(model, model.hidden_states(tokens, attention_mask=attn),
                                tokens, temperature)


def rollout_targets(value_def: Any, value_params: Any, batch: TrainBatch, cfg: LearnerConfig
                    ) -> Targets:
    """The critic's forward over the whole ``[B, S]`` buffer at one width, then the targets:
    what ``Learner.targets``'s row groups must equal."""
    values = critic_token_values(nnx.merge(value_def, value_params), batch.tokens, batch.attn)
    return compute_targets(values, batch, cfg.algo, cfg.window)


def row_plan_of(batch: TrainBatch, shuffle: np.ndarray | None = None) -> RowPlan:
    """A ``RowPlan`` read off ``batch`` (a device sync): lengths from ``attn``, the finished
    rows, and the given shuffle keys (None: rows in order)."""
    lengths = np.asarray(jax.device_get(batch.attn.sum(1)))
    return RowPlan(lengths, shuffle, np.flatnonzero(np.asarray(batch.finished)))


def update(learner: Learner, kind: str, params: Any, opt_state: Any, batch: TrainBatch,
           targets: Targets, rows: RowPlan | None = None, ref: Any = None
           ) -> tuple[Any, Any, dict[str, jax.Array]]:
    """One update (``kind``: policy or value) of ``learner`` on ``batch``'s rows (``rows``:
    default ``row_plan_of(batch)``)."""
    rows = row_plan_of(batch) if rows is None else rows
    plan = learner.plan(kind, rows, batch.shape[1])
    if kind == "policy":
        return learner.update_policy(params, opt_state, batch, targets, plan, ref)
    return learner.update_value(params, opt_state, batch, targets, plan)


def learner_with(policy_def: Any, value_def: Any, cfg: LearnerConfig, *,
                 tx_policy: Any = None, tx_value: Any = None, **kw: Any) -> Learner:
    """A ``Learner`` whose optimizers are ``tx_policy`` / ``tx_value`` (None: ``cfg.optim``'s),
    e.g. ``optax.sgd`` so params move by exactly the gradient (``kw``: ``Learner``'s)."""
    from unittest import mock

    from tppo_jax.learner import learner as module

    p = module.policy_optimizer if tx_policy is None else (lambda _: tx_policy)
    v = module.value_optimizer if tx_value is None else (lambda _: tx_value)
    with mock.patch.object(module, "policy_optimizer", p), \
            mock.patch.object(module, "value_optimizer", v):
        return Learner(policy_def, value_def, cfg, **kw)


def batch_and_targets(arrays: dict[str, Any]) -> tuple[TrainBatch, Targets]:
    """``[B, S]`` arrays an update reads (``tokens``, ``attn``, ``sample_logprobs`` and the
    targets ``advantages``, ``policy_mask``, ``positive_mask``, ``values_old``, ``returns``,
    ``value_mask``) as a ``TrainBatch`` and ``Targets``: a missing array reads zeros (``attn``
    ones); the per-row fields, which the updates do not read, make every row a finished
    window over the whole buffer (so ``row_plan_of`` plans every row, the critic's too)."""
    import jax.numpy as jnp

    b, s = arrays["tokens"].shape

    def get(k: str) -> jax.Array:
        return jnp.asarray(arrays[k], jnp.float32) if k in arrays else jnp.zeros((b, s))

    batch = TrainBatch(
        tokens=jnp.asarray(arrays["tokens"], jnp.int32),
        attn=jnp.asarray(arrays["attn"], bool) if "attn" in arrays else jnp.ones((b, s), bool),
        sample_logprobs=get("sample_logprobs"), prompt_len=jnp.zeros(b, jnp.int32),
        window_start=jnp.zeros(b, jnp.int32), window_len=jnp.full(b, s, jnp.int32),
        finished=jnp.ones(b, bool), reward=jnp.zeros(b, jnp.float32),
        correct=jnp.zeros(b, bool))
    targets = Targets(advantages=get("advantages"), policy_mask=get("policy_mask"),
                      returns=get("returns"), value_mask=get("value_mask"),
                      positive_mask=get("positive_mask"), values_old=get("values_old"),
                      lam=jnp.ones(b, jnp.float32))
    return batch, targets


def finished_rows(rng: np.random.Generator, lens: np.ndarray, p: int, n: int, *,
                  reward: Any, correct: Any, **fields: Any) -> TrainBatch:
    """A batch of finished rows: prompts of ``p`` tokens, responses of ``lens`` in a buffer of
    ``p + n``, token ids drawn from ``rng`` (after whatever the caller drew), log-probs 0."""
    import jax.numpy as jnp

    b, s = len(lens), p + n
    return TrainBatch(
        tokens=jnp.asarray(rng.integers(2, 30, size=(b, s)), jnp.int32),
        attn=jnp.asarray(np.arange(s)[None] < (p + lens)[:, None]),
        sample_logprobs=jnp.zeros((b, s), jnp.float32),
        prompt_len=jnp.full((b,), p, jnp.int32), window_start=jnp.full((b,), p, jnp.int32),
        window_len=jnp.asarray(lens, jnp.int32), finished=jnp.ones((b,), bool),
        reward=reward, correct=correct, **fields)
