"""Jitted T-PPO pieces: advantage/target computation, policy update, value update.

Pure functions of (params, optimizer state, batch arrays); the trainer dispatches the
policy and value updates back to back without waiting on either (jax's async dispatch),
so they run independently, as T-PPO prescribes. All formulas come from ``tppo_jax.algo``.

Array layout: every batch array is ``[B, S]`` over the full token buffer (prompt +
windows); ``X[b, t]`` refers to token ``t`` (e.g. ``logp[b, t]`` = log-prob of token t,
``values[b, t] = V(s_t)`` read from the hidden state at ``t - 1``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from tppo_jax import algo
from tppo_jax.config import AlgoConfig, OptimConfig
from tppo_jax.kernels.logprobs import token_logprobs
from tppo_jax.parallel.mesh import logical_to_spec


@dataclass(frozen=True)
class StepConfig:
    """The static (hashable) knobs the jitted steps close over."""

    algo: AlgoConfig
    optim: OptimConfig
    window: int
    temperature: float


def updates_per_step(optim: OptimConfig) -> int:
    """Optimizer updates one training step makes (when every minibatch has tokens): one per
    minibatch per epoch. ``grad_accum`` splits a minibatch into micro-batches whose gradients
    make a single update, so it does not change the count."""
    return optim.minibatches * optim.epochs


def lr_schedule(lr: float, optim: OptimConfig) -> optax.Schedule:
    """Linear warm-up over ``optim.warmup_steps`` *training steps*, then constant.

    The schedule's clock is optax's update count, so the warm-up is scaled to
    ``warmup_steps * updates_per_step`` updates (the paper's "20 warm-up steps" with 16
    minibatches is 320 updates, not 20). A minibatch with nothing to train on takes no update
    and does not advance the clock (see ``_guarded_apply``).
    """
    n = max(optim.warmup_steps * updates_per_step(optim), 1)
    return optax.join_schedules([optax.linear_schedule(lr / n, lr, n),
                                 optax.constant_schedule(lr)], [n])


def make_optimizer(lr: float, optim: OptimConfig) -> optax.GradientTransformation:
    """AdamW on ``lr_schedule`` after global-norm clipping."""
    parts = [optax.clip_by_global_norm(optim.grad_clip)] if optim.grad_clip > 0 else []
    parts.append(optax.adamw(lr_schedule(lr, optim), b1=optim.b1, b2=optim.b2,
                             weight_decay=optim.weight_decay))
    return optax.chain(*parts)


def shift_right(x: jax.Array) -> jax.Array:
    """``[B, S-1]`` per-next-token quantities -> ``[B, S]`` indexed by token (col 0 = 0)."""
    return jnp.pad(x, ((0, 0), (1, 0)))


def policy_token_logprobs(model: nnx.Module, tokens: jax.Array, attn: jax.Array,
                          temperature: float) -> tuple[jax.Array, jax.Array]:
    """``logp[b, t]`` and entropy of token ``t``'s distribution, ``[B, S]`` each, chunked."""
    hidden = model.hidden_states(tokens, attention_mask=attn)
    lp, ent = token_logprobs(hidden[:, :-1], model.lm_head_weight(), tokens[:, 1:],
                             temperature=temperature, chunk_size=128)
    return shift_right(lp), shift_right(ent)


def critic_token_values(model: nnx.Module, tokens: jax.Array, attn: jax.Array) -> jax.Array:
    """``V(s_t)`` for every token ``t``: ``[B, S]`` (the critic reads position ``t-1``)."""
    return shift_right(model(tokens, attention_mask=attn)[:, :-1])


def _gather_window(x: jax.Array, start: jax.Array, width: int) -> jax.Array:
    idx = jnp.clip(start[:, None] + jnp.arange(width)[None], 0, x.shape[1] - 1)
    return jnp.take_along_axis(x, idx, axis=1)


def _scatter_window(xw: jax.Array, start: jax.Array, length: int) -> jax.Array:
    b, w = xw.shape
    idx = start[:, None] + jnp.arange(w)[None]
    return jnp.zeros((b, length), xw.dtype).at[jnp.arange(b)[:, None], idx].set(xw, mode="drop")


def compute_targets(values: jax.Array, batch: dict[str, jax.Array], cfg: StepConfig
                    ) -> dict[str, jax.Array]:
    """EGAE advantages on the current window + MC returns + masks, all ``[B, S]``.

    Args:
      values: ``[B, S]`` ``V(s_t)`` from the critic at rollout time.
      batch: ``tokens, prompt_len, window_start, window_len, finished, reward, correct`` (the
        grader's verdict, ``[B]`` bool: the positive-example NLL trains on these rows, not on
        ``reward > 0``, which shaping or +1/-1 rewards make a different set) and optionally
        ``token_rewards [B, S]`` (dense process rewards, added to the outcome reward).
    """
    a = cfg.algo
    b, s = batch["tokens"].shape
    start, wlen, fin = batch["window_start"], batch["window_len"], batch["finished"]
    total = start + wlen
    last = jnp.maximum(total - 1, 0)
    rewards = jnp.zeros((b, s), jnp.float32).at[jnp.arange(b), last].set(
        jnp.where(fin, batch["reward"], 0.0))
    if "token_rewards" in batch:  # process rewards at step ends (reward.process)
        rewards = rewards + batch["token_rewards"]

    # Policy side: EGAE over the window [start, start + wlen).
    w = cfg.window
    mask_w = (jnp.arange(w)[None] < wlen[:, None]).astype(jnp.float32)
    resp_len = total - batch["prompt_len"]
    if a.length_adaptive:
        lam = algo.length_adaptive_lambda(algo.effective_length(resp_len, fin, window=w),
                                          alpha=a.alpha, lam_min=a.lam_min)
    else:
        lam = jnp.full((b,), a.lam_policy, jnp.float32)
    adv_w = algo.egae(_gather_window(rewards, start, w), _gather_window(values, start, w),
                      mask_w, fin, gamma=a.gamma, lam=lam)
    adv = _scatter_window(adv_w, start, s)
    pmask = algo.policy_mask(s, start, wlen, fin, ignore_last=a.window_ignore_tokens)
    if a.whiten_advantages:
        adv = algo.masked_whiten(adv, pmask)
    if a.advantage_clip is not None:
        adv = algo.masked_clip(adv, pmask, bound=a.advantage_clip)
    adv = adv * pmask

    # Critic side: MC returns (lambda_critic = 1) on every response token of finished rows.
    rmask = algo.response_mask(s, batch["prompt_len"], total)
    if a.lam_critic == 1.0:
        returns = algo.mc_returns(rewards, rmask, gamma=a.gamma)
    else:  # decoupled-GAE ablation: lambda-returns A + V with lam_critic
        returns = algo.gae(rewards, values, rmask, gamma=a.gamma, lam=a.lam_critic) + values
    vmask = algo.value_mask(s, batch["prompt_len"], total, fin)
    posmask = algo.positive_example_mask(s, batch["prompt_len"], total, fin,
                                         batch["correct"].astype(bool))
    return {"advantages": adv, "policy_mask": pmask, "returns": returns * rmask,
            "value_mask": vmask, "positive_mask": posmask, "lam": lam}


def _minibatches(batch: dict[str, jax.Array], n: int) -> dict[str, jax.Array]:
    return jax.tree.map(lambda x: x.reshape((n, x.shape[0] // n) + x.shape[1:]), batch)


def _guarded_apply(tx, grads, opt_state, params, loss, active):
    """Applies the update only if the minibatch has tokens to train on (``active``) and its
    loss and grads are finite; else params *and* optimizer state stay as they were (no AdamW
    momentum step on a zero gradient, no tick of the learning-rate schedule).

    Returns ``(params, opt_state, skipped)``; ``skipped``: active but non-finite.
    """
    finite = jnp.isfinite(loss) & jnp.all(jnp.array(
        [jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    apply = finite & active
    safe = jax.tree.map(lambda g: jnp.where(apply, g, 0.0), grads)
    updates, new_opt = tx.update(safe, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)  # noqa
    return keep(new_params, params), keep(new_opt, opt_state), active & ~finite


def _epoch_order(batch: dict[str, jax.Array], epoch: int) -> dict[str, jax.Array]:
    """The batch's rows in this epoch's order: sorted by ``shuffle[:, epoch]`` (``[B, E]``
    random keys drawn by the caller from its seed and step, so an exact resume replays the same
    minibatches); in the given order when the batch has no ``shuffle``."""
    if "shuffle" not in batch:
        return batch
    perm = jnp.argsort(batch["shuffle"][:, epoch])
    return jax.tree.map(lambda x: x[perm], {k: v for k, v in batch.items() if k != "shuffle"})


def _run_epochs(loss_fn, active_fn, tx, params, opt_state, batch, cfg: StepConfig, name: str,
                first_mb: tuple[str, ...] = ()):
    """``cfg.optim.epochs`` passes over ``minibatches`` splits (rows reshuffled every epoch,
    see ``_epoch_order``); one optimizer step each, its gradient averaged over ``grad_accum``
    micro-batches (memory: one micro-batch's activations at a time). A minibatch where
    ``active_fn(mb)`` is False (no token to train on) takes no step (``{name}_empty_mb``); a
    non-finite loss/grad skips the step (``{name}_skipped``). Stats are means over the
    minibatches that stepped; ``first_mb`` stats are also reported for the very first
    minibatch alone as ``{key}_first_mb`` (before any update of this step).
    """
    accum = cfg.optim.grad_accum
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def accumulated(p, mb):
        """Mean loss, stats and grads over ``accum`` micro-batches (one optimizer step)."""
        if accum == 1:
            return grad_fn(p, mb)
        micro = _minibatches(mb, accum)

        def add(acc, x):
            out = grad_fn(p, x)
            return jax.tree.map(lambda a, b: a + b / accum, acc, out), None

        zero = jax.tree.map(jnp.zeros_like, jax.eval_shape(grad_fn, p,
                                                           jax.tree.map(lambda x: x[0], micro)))
        total, _ = jax.lax.scan(add, zero, micro)
        return total

    def one(carry, mb):
        p, o = carry
        (loss, stats), grads = accumulated(p, mb)
        active = active_fn(mb)
        p, o, skipped = _guarded_apply(tx, grads, o, p, loss, active)
        stats = dict(stats, **{f"{name}_loss": loss, f"{name}_grad_norm": optax.tree.norm(grads),
                               f"{name}_skipped": skipped.astype(jnp.float32),
                               "_active": active.astype(jnp.float32)})
        return (p, o), stats

    carry = (params, opt_state)
    per_mb = []
    for epoch in range(cfg.optim.epochs):
        mbs = _minibatches(_epoch_order(batch, epoch), cfg.optim.minibatches)
        carry, stats = jax.lax.scan(one, carry, mbs)
        per_mb.append(stats)
    per_mb = jax.tree.map(lambda *xs: jnp.concatenate(xs), *per_mb)  # [epochs * minibatches]
    w = per_mb.pop("_active")
    stats = jax.tree.map(lambda x: (x * w).sum() / jnp.maximum(w.sum(), 1.0), per_mb)
    stats[f"{name}_skipped"] = per_mb[f"{name}_skipped"].sum()
    stats[f"{name}_empty_mb"] = (1.0 - w).sum()
    stats.update({f"{k}_first_mb": per_mb[k][0] for k in first_mb})
    return carry[0], carry[1], stats


# The ratio statistics of the first minibatch, before this step changed the policy: with the
# ``keep`` KV policy they measure how far the sampled log-probs (decoded over an older policy's
# cache) are from a fresh forward pass; later minibatches average that away.
FIRST_MB_STATS = ("ratio_mean", "approx_kl", "clip_frac", "log_ratio_absmax")


@partial(jax.jit, static_argnames=("graphdef", "tx", "cfg"), donate_argnums=(1, 2))
def policy_update(graphdef: Any, params: Any, opt_state: Any, batch: dict[str, jax.Array], *,
                  tx: optax.GradientTransformation, cfg: StepConfig):
    """PPO epochs x minibatches on the policy mask (+ positive-example NLL, weight mu).

    ``batch``: ``[B, ...]`` arrays (``compute_targets``' outputs plus ``tokens, attn,
    sample_logprobs``, optionally ``shuffle [B, epochs]``). Returns ``(params, opt_state,
    stats)``; ``stats["policy_loss"]`` is the total loss.
    """
    a = cfg.algo

    def loss_fn(p, mb):
        model = nnx.merge(graphdef, p)
        logp, ent = policy_token_logprobs(model, mb["tokens"], mb["attn"], cfg.temperature)
        pl, stats = algo.policy_loss(logp, mb["sample_logprobs"], mb["advantages"],
                                     mb["policy_mask"], eps_low=a.eps_low, eps_high=a.eps_high,
                                     dual_clip_c=a.dual_clip_c, aggregation=a.loss_aggregation)
        nll = algo.nll_loss(logp, mb["positive_mask"])
        stats = dict(stats, pg_loss=pl, nll_loss=nll,
                     entropy=algo.masked_mean(ent, mb["policy_mask"]))
        return pl + a.nll_coef * nll, stats

    def active(mb):
        n = mb["policy_mask"].sum()
        return n + mb["positive_mask"].sum() * (a.nll_coef > 0) > 0

    return _run_epochs(loss_fn, active, tx, params, opt_state, batch, cfg, "policy",
                       first_mb=FIRST_MB_STATS)


@partial(jax.jit, static_argnames=("graphdef", "tx", "cfg"), donate_argnums=(1, 2))
def value_update(graphdef: Any, params: Any, opt_state: Any, batch: dict[str, jax.Array], *,
                 tx: optax.GradientTransformation, cfg: StepConfig):
    """Clipped value regression to MC returns on the value mask (finished rows only).

    With ``batch["value_rows"]`` (``[R]`` row indices, ``R <= B``: the finished rows padded
    with unfinished ones) only those rows are run: the critic pays for the rows that have a
    target, not for the whole batch.
    """
    a = cfg.algo
    if "value_rows" in batch:
        rows = batch["value_rows"]
        batch = jax.tree.map(lambda x: x[rows], {k: v for k, v in batch.items()
                                                 if k != "value_rows"})

    def loss_fn(p, mb):
        model = nnx.merge(graphdef, p)
        v = critic_token_values(model, mb["tokens"], mb["attn"])
        return algo.value_loss(v, mb["values_old"], mb["returns"], mb["value_mask"],
                               clip_low=a.value_clip_low, clip_high=a.value_clip_high,
                               aggregation=a.loss_aggregation)

    return _run_epochs(loss_fn, lambda mb: mb["value_mask"].sum() > 0, tx, params, opt_state,
                       batch, cfg, "value")


@partial(jax.jit, static_argnames=("graphdef", "cfg"))
def rollout_targets(graphdef: Any, value_params: Any, batch: dict[str, jax.Array], *,
                    cfg: StepConfig) -> dict[str, jax.Array]:
    """Critic forward at rollout time, then ``compute_targets``; adds ``values_old``."""
    critic = nnx.merge(graphdef, value_params)
    values = critic_token_values(critic, batch["tokens"], batch["attn"])
    out = compute_targets(values, batch, cfg)
    out["values_old"] = values
    return out


def on_mesh(step, mesh, graphdef: Any, params: Any, opt_state: Any | None = None,
            **static: Any):
    """``step`` (``policy_update``/``value_update``, or ``rollout_targets`` without an
    optimizer state) re-jitted for this mesh with its shardings declared, its static
    arguments (``graphdef`` and the ``tx``/``cfg`` keywords) bound. Params and optimizer
    state go in and come out exactly as placed now (leaves off the mesh, such as a step
    count, replicated); every batch array is split over the batch axes; stats are
    replicated. The update can then never hand back params in a layout the compiler chose.

    Returns ``f(params, opt_state, batch)`` (``f(params, batch)`` for ``rollout_targets``).
    """
    rep = NamedSharding(mesh, PartitionSpec())
    batch = NamedSharding(mesh, logical_to_spec(("batch",)))  # a prefix: leading dim only

    def placed(tree: Any) -> Any:
        return jax.tree.map(lambda x: x.sharding if isinstance(x.sharding, NamedSharding)
                            and x.sharding.mesh == mesh else rep, tree)

    fn = partial(step.__wrapped__, graphdef, **static)
    if opt_state is None:  # rollout_targets(params, batch) -> targets
        return jax.jit(fn, in_shardings=(placed(params), batch), out_shardings=batch)
    p, o = placed(params), placed(opt_state)
    return jax.jit(fn, donate_argnums=(0, 1), in_shardings=(p, o, batch),
                   out_shardings=(p, o, rep))
