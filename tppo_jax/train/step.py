"""T-PPO's pure pieces: the optimizer, advantage/target computation (``compute_targets``),
the policy and value losses of one row group, and the guarded optimizer step. All formulas
come from ``tppo_jax.algo``; ``train/update.py`` composes these into the updates.

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
from tppo_jax.config import AlgoConfig, Config, OptimConfig
from tppo_jax.kernels.logprobs import token_kl, token_logprobs
from tppo_jax.parallel.mesh import logical_to_spec


@dataclass(frozen=True)
class StepConfig:
    """The static (hashable) knobs the jitted steps close over."""

    algo: AlgoConfig
    optim: OptimConfig
    window: int
    temperature: float

    @classmethod
    def from_config(cls, cfg: Config, window: int | None = None) -> StepConfig:
        """A run's step knobs: its algo and optim sections, the window (``rollout.window``
        unless given, at most L) and the sampling temperature the log-probs are taken at
        (greedy decoding, temperature 0, scores at 1)."""
        r = cfg.rollout
        return cls(algo=cfg.algo, optim=cfg.optim,
                   window=min(r.window if window is None else window, r.max_response_len),
                   temperature=r.temperature if r.temperature > 0 else 1.0)


def updates_per_step(optim: OptimConfig, epochs: int | None = None) -> int:
    """Optimizer updates one training step makes (when every minibatch has tokens): one per
    minibatch per epoch (``epochs``: default ``optim.epochs``; the critic's are
    ``optim.critic_epochs``). ``grad_accum`` splits a minibatch into micro-batches whose
    gradients make a single update, so it does not change the count."""
    return optim.minibatches * (optim.epochs if epochs is None else epochs)


def lr_schedule(lr: float, optim: OptimConfig, epochs: int | None = None,
                decay_steps: int = 0) -> optax.Schedule:
    """Linear warm-up over ``optim.warmup_steps`` *training steps*, then constant, or with
    ``decay_steps`` a cosine decay to 0 over that many training steps (then 0).

    The schedule's clock is optax's update count, so the warm-up is scaled to
    ``warmup_steps * updates_per_step`` updates (the paper's "20 warm-up steps" with 16
    minibatches is 320 updates, not 20). A minibatch with nothing to train on takes no update
    and does not advance the clock (see ``guarded_apply``).
    """
    ups = updates_per_step(optim, epochs)
    n = max(optim.warmup_steps * ups, 1)
    after = (optax.cosine_decay_schedule(lr, decay_steps * ups) if decay_steps > 0
             else optax.constant_schedule(lr))
    return optax.join_schedules([optax.linear_schedule(lr / n, lr, n), after], [n])


def scheduled_lrs(optim: OptimConfig, step: int) -> dict[str, float]:
    """The policy's and the critic's learning rates after training step ``step`` (1-based):
    the schedules of ``make_optimizer`` at ``step * updates_per_step`` updates (a skipped,
    empty minibatch would leave the real clock a little behind)."""
    p = lr_schedule(optim.policy_lr, optim, decay_steps=optim.policy_lr_decay_steps)
    v = lr_schedule(optim.value_lr, optim, optim.critic_epochs)
    return {"lr_policy": float(p(step * updates_per_step(optim))),
            "lr_value": float(v(step * updates_per_step(optim, optim.critic_epochs)))}


def make_optimizer(lr: float, optim: OptimConfig, epochs: int | None = None,
                   decay_steps: int = 0) -> optax.GradientTransformation:
    """AdamW on ``lr_schedule`` (``epochs`` passes per step, ``decay_steps``) after
    global-norm clipping."""
    parts = [optax.clip_by_global_norm(optim.grad_clip)] if optim.grad_clip > 0 else []
    parts.append(optax.adamw(lr_schedule(lr, optim, epochs, decay_steps), b1=optim.b1, b2=optim.b2,
                             eps=optim.eps, weight_decay=optim.weight_decay))
    return optax.chain(*parts)


def shift_right(x: jax.Array) -> jax.Array:
    """``[B, S-1]`` per-next-token quantities -> ``[B, S]`` indexed by token (col 0 = 0)."""
    return jnp.pad(x, ((0, 0), (1, 0)))


def policy_token_logprobs(model: nnx.Module, tokens: jax.Array, attn: jax.Array,
                          temperature: float) -> tuple[jax.Array, jax.Array]:
    """``logp[b, t]`` and entropy of token ``t``'s distribution, ``[B, S]`` each, chunked."""
    return _token_logprobs(model, model.hidden_states(tokens, attention_mask=attn), tokens,
                           temperature)


def _token_logprobs(model: nnx.Module, hidden: jax.Array, tokens: jax.Array,
                    temperature: float) -> tuple[jax.Array, jax.Array]:
    lp, ent = token_logprobs(hidden[:, :-1], model.lm_head_weight(), tokens[:, 1:],
                             temperature=temperature, chunk_size=128)
    return shift_right(lp), shift_right(ent)


def reference_kl(model: nnx.Module, hidden: jax.Array, logp: jax.Array, ref: nnx.Module,
                 mb: dict[str, jax.Array], n_tokens: jax.Array, *, estimator: str,
                 temperature: float) -> jax.Array:
    """Token-mean ``KL(policy || ref)`` over ``mb["policy_mask"]``; the reference's forward
    carries no gradient. ``hidden [R, W, H]`` / ``logp [R, W]``: the policy's, reused.
    ``estimator``: ``k3`` (on the sampled tokens) or ``exact`` (whole distributions)."""
    ref_hidden = jax.lax.stop_gradient(ref.hidden_states(mb["tokens"], attention_mask=mb["attn"]))
    if estimator == "k3":
        ref_logp, _ = _token_logprobs(ref, ref_hidden, mb["tokens"], temperature)
        return algo.kl_to_reference(logp, jax.lax.stop_gradient(ref_logp), mb["policy_mask"],
                                    n_tokens=n_tokens)
    kl = token_kl(hidden[:, :-1], model.lm_head_weight(), ref_hidden[:, :-1],
                  jax.lax.stop_gradient(ref.lm_head_weight()), temperature=temperature,
                  chunk_size=128)
    return algo.aggregate(shift_right(kl), mb["policy_mask"], mode="token", denom=n_tokens)


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
    """EGAE advantages on the current window (``algo.policy_trains: response``: GAE on a
    finished row's whole response, nothing on an unfinished one) + MC returns + masks, all
    ``[B, S]``.

    Args:
      values: ``[B, S]`` ``V(s_t)`` from the critic at rollout time.
      batch: ``tokens, prompt_len, window_start, window_len, finished, reward, correct`` (the
        grader's verdict, ``[B]`` bool: the positive-example NLL trains on these rows, not on
        ``reward > 0``, which shaping or +1/-1 rewards make a different set) and optionally
        ``token_rewards [B, S]`` (dense process rewards, added to the outcome reward),
        ``group [B]`` (the prompt's id: ``algo.advantage_baseline: group``; with
        ``group_prior_sum, group_prior_n [B]``, its siblings graded in earlier steps) and
        ``blame_start [B]`` (``algo.blame_from_first_error``: columns before it get no
        advantage; they stay in the policy mask, so the KL term still holds them).
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
    resp_len = total - batch["prompt_len"]
    if a.length_adaptive:
        lam = algo.length_adaptive_lambda(
            algo.effective_length(resp_len, fin, window=cfg.window), alpha=a.alpha,
            lam_min=a.lam_min)
    else:
        lam = jnp.full((b,), a.lam_policy, jnp.float32)
    w = cfg.window
    if a.policy_trains == "response":  # a finished row's whole response; nothing else
        start, wlen, w = batch["prompt_len"], jnp.where(fin, resp_len, 0), s
    mask_w = (jnp.arange(w)[None] < wlen[:, None]).astype(jnp.float32)
    adv_w = algo.egae(_gather_window(rewards, start, w), _gather_window(values, start, w),
                      mask_w, fin, gamma=a.gamma, lam=lam)
    if a.advantage_baseline == "group":  # finished rows with a finished sibling: r - mean
        base, has = algo.group_baseline(batch["reward"], batch["group"], fin,
                                        batch.get("group_prior_sum"), batch.get("group_prior_n"))
        adv_w = jnp.where((fin & has)[:, None], (batch["reward"] - base)[:, None] * mask_w,
                          adv_w)
    adv = _scatter_window(adv_w, start, s)
    pmask = algo.policy_mask(s, start, wlen, fin, ignore_last=a.window_ignore_tokens)
    amask = pmask  # the tokens that carry an advantage
    if "blame_start" in batch:
        amask = pmask * (jnp.arange(s)[None] >= batch["blame_start"][:, None])
    if a.whiten_advantages:
        adv = algo.masked_whiten(adv, amask, shift_mean=a.whiten_center)
    if a.advantage_clip is not None:
        adv = algo.masked_clip(adv, amask, bound=a.advantage_clip)
    adv = adv * amask

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


def policy_group_loss(graphdef: Any, params: Any, mb: dict[str, jax.Array],
                      denoms: dict[str, jax.Array], ref: Any = None, *, cfg: StepConfig,
                      grad_from: int = 0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The policy loss of one row group of a minibatch: clipped surrogate on the policy mask
    + ``nll_coef`` x positive-example NLL (+ ``kl_coef`` x KL to the reference policy, whose
    params ``ref`` are given when ``kl_coef > 0``), each divided by the whole minibatch's
    count (``denoms``: ``tokens``/``rows`` of the policy mask, ``positive`` tokens), so a
    minibatch's loss and mean stats are the sums over its groups.

    ``mb``: ``[R, W]`` ``tokens, attn, sample_logprobs, advantages, policy_mask,
    positive_mask``. ``grad_from`` (static): columns before it run forward only
    (``algo.detach_prefix``; ``update_plan`` puts it before every token its rows train).
    """
    a = cfg.algo
    model = nnx.merge(graphdef, params)
    hidden = model.hidden_states(mb["tokens"], attention_mask=mb["attn"], grad_from=grad_from)
    logp, ent = _token_logprobs(model, hidden, mb["tokens"], cfg.temperature)
    pl, stats = algo.policy_loss(logp, mb["sample_logprobs"], mb["advantages"],
                                 mb["policy_mask"], eps_low=a.eps_low, eps_high=a.eps_high,
                                 dual_clip_c=a.dual_clip_c, aggregation=a.loss_aggregation,
                                 n_tokens=denoms["tokens"], n_rows=denoms["rows"])
    nll = algo.nll_loss(logp, mb["positive_mask"], n_tokens=denoms["positive"])
    stats = dict(stats, pg_loss=pl, nll_loss=nll,
                 entropy=algo.aggregate(ent, mb["policy_mask"], denom=denoms["tokens"]))
    loss = pl + a.nll_coef * nll
    if ref is not None:
        kl = reference_kl(model, hidden, logp, nnx.merge(graphdef, jax.lax.stop_gradient(ref)),
                          mb, denoms["tokens"], estimator=a.kl_estimator,
                          temperature=cfg.temperature)
        stats["kl_ref"] = kl
        loss = loss + a.kl_coef * kl
    return loss, stats


def value_group_loss(graphdef: Any, params: Any, mb: dict[str, jax.Array],
                     denoms: dict[str, jax.Array], cfg: StepConfig
                     ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped value regression to MC returns on one row group's value mask (finished rows
    only), divided by the minibatch's ``denoms`` (``tokens``/``rows`` of the value mask).

    ``mb``: ``[R, W]`` ``tokens, attn, values_old, returns, value_mask``.
    """
    a = cfg.algo
    v = critic_token_values(nnx.merge(graphdef, params), mb["tokens"], mb["attn"])
    return algo.value_loss(v, mb["values_old"], mb["returns"], mb["value_mask"],
                           clip_low=a.value_clip_low, clip_high=a.value_clip_high,
                           aggregation=a.loss_aggregation, n_tokens=denoms["tokens"],
                           n_rows=denoms["rows"])


def guarded_apply(tx: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any,
                  loss: jax.Array, active: jax.Array) -> tuple[Any, Any, jax.Array]:
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


def targets_with_values(values: jax.Array, batch: dict[str, jax.Array], cfg: StepConfig
                        ) -> dict[str, jax.Array]:
    """``compute_targets`` plus ``values_old`` (``values [B, S]``, the rollout-time critic)."""
    return dict(compute_targets(values, batch, cfg), values_old=values)


def group_values(graphdef: Any, value_params: Any, group: dict[str, jax.Array]) -> jax.Array:
    """The critic's ``V(s_t)`` over one row group: ``group`` ``[R, W]`` ``tokens, attn`` ->
    ``[R, W]``."""
    return critic_token_values(nnx.merge(graphdef, value_params), group["tokens"],
                               group["attn"])


def put_rows(values: jax.Array, part: jax.Array, rows: jax.Array, valid: jax.Array
             ) -> jax.Array:
    """``values [B, S]`` with rows ``rows [R]``, columns ``:W``, set to ``part [R, W]``
    (padding rows, ``valid`` False, dropped)."""
    idx = jnp.where(valid, rows, values.shape[0])
    return values.at[idx, :part.shape[1]].set(part, mode="drop")


@partial(jax.jit, static_argnames=("graphdef", "cfg"))
def rollout_targets(graphdef: Any, value_params: Any, batch: dict[str, jax.Array], *,
                    cfg: StepConfig) -> dict[str, jax.Array]:
    """Critic forward at rollout time over the whole ``[B, S]`` buffer, then the targets
    (the one-width reference of ``train/targets.py``'s row groups)."""
    values = group_values(graphdef, value_params, batch)
    return targets_with_values(values, batch, cfg)


def batch_spec(mesh) -> NamedSharding:
    """Batch arrays on ``mesh``: the leading (row) dim split over the batch axes."""
    return NamedSharding(mesh, logical_to_spec(("batch",)))  # a prefix: leading dim only


def placed(tree: Any, mesh) -> Any:
    """The shardings ``tree``'s leaves have on ``mesh`` now (replicated for leaves off it, such
    as an optimizer's step count): declared in and out of a jitted step, they make it hand
    back params exactly as placed, never in a layout the compiler chose."""
    rep = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: x.sharding if isinstance(x.sharding, NamedSharding)
                        and x.sharding.mesh == mesh else rep, tree)
