"""The learner: one training step of T-PPO on arrays, ``Learner.step(state, batch, rows)``.

A step is the critic's values pass over the rollout, the targets (``estimators``), then the
policy's and the critic's updates, independent of each other (T-PPO: the policy on the
current windows, the critic on finished rows). Each update is epochs x minibatches of
optimizer steps; each minibatch runs as row groups of one width bucket (``plan``), their
gradients summed, then one guarded AdamW step. The values pass runs the same row groups.

The host loop only dispatches: plans come from host arrays (``RowPlan``) and every device
value stays on device, so the policy's and the critic's updates are dispatched back to back
without waiting on each other (jax's async dispatch). Jitted pieces compile once per shape:
a group's gradient and values once per width bucket (each width has one row count), the
row gather per (group width, batch width), the rest once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from tppo_jax import algo
from tppo_jax.kernels.attention import traced_on
from tppo_jax.learner.batch import (
    PolicyRows,
    Targets,
    TokenRows,
    TrainBatch,
    ValueRows,
    row_counts,
)
from tppo_jax.learner.estimators import compute_targets, needs_critic, reads_groups
from tppo_jax.learner.losses import (
    LearnerConfig,
    critic_token_values,
    group_logprobs,
    policy_loss,
    value_loss,
)
from tppo_jax.learner.plan import (
    Minibatch,
    RowGroup,
    max_group_rows,
    plan_cells,
    plan_minibatch,
    plan_update,
)
from tppo_jax.learner.state import TrainState, guarded_apply, policy_optimizer, value_optimizer
from tppo_jax.models.lora import join_params, split_trainable
from tppo_jax.parallel.mesh import logical_to_spec

Kind = Literal["policy", "value"]
ROWS = {"policy": PolicyRows, "value": ValueRows}

# The ratio statistics of the first minibatch, before this step changed the policy: with the
# ``keep`` KV policy they measure how far the sampled log-probs (decoded over an older policy's
# cache) are from a fresh forward pass; later minibatches average that away.
FIRST_MB_STATS = ("ratio_mean", "approx_kl", "clip_frac", "log_ratio_absmax")
# The sampler / learner gap (algo.sampler_gap): the first minibatch's alone, under their own
# names, since only its forward pass runs before this step changes the policy.
GAP_STATS = ("sampler_gap_abs_mean", "sampler_gap_abs_max", "sampler_kl", "sampler_clip_frac")
# Combined over groups and minibatches by max, not sum
MAX_STATS = ("log_ratio_absmax", "sampler_gap_abs_max")


@dataclass(frozen=True)
class RowPlan:
    """What the updates' plans need, as host arrays over every host's rows (global row order,
    so every host plans the same steps): ``lengths [B]`` columns each row uses, ``shuffle
    [B, epochs]`` each epoch's row order, ``finished`` the indices of the rows the critic
    trains on."""

    lengths: np.ndarray
    shuffle: np.ndarray | None
    finished: np.ndarray


@dataclass
class StepStats:
    """What one ``Learner.step`` reports (device scalars; ``policy`` is empty when the policy
    did not train): the updates' stats, where the advantage went, and the token cells (rows
    x columns) each update's forward passes ran over."""

    policy: dict[str, jax.Array]
    value: dict[str, jax.Array]
    advantages: dict[str, jax.Array]
    policy_cells: int = 0
    value_cells: int = 0


def batch_spec(mesh: Any) -> NamedSharding:
    """Row-indexed arrays on ``mesh``: the leading (row) dim split over the batch axes."""
    return NamedSharding(mesh, logical_to_spec(("batch",)))  # a prefix: leading dim only


def placed(tree: Any, mesh: Any) -> Any:
    """The shardings ``tree``'s leaves have on ``mesh`` now (replicated for leaves off it, such
    as an optimizer's step count): declared in and out of a jitted step, they make it hand
    back params exactly as placed, never in a layout the compiler chose."""
    rep = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: x.sharding if isinstance(x.sharding, NamedSharding)
                        and x.sharding.mesh == mesh else rep, tree)


def _jit(fn: Callable, mesh: Any, in_shardings: Any = None, out_shardings: Any = None,
         **kw: Any) -> Callable:
    """``jax.jit``; on a mesh with the given shardings declared, traced on the mesh (splash
    attention on TPU runs per shard)."""
    if mesh is not None:
        kw.update({k: v for k, v in (("in_shardings", in_shardings),
                                     ("out_shardings", out_shardings)) if v is not None})
    return jax.jit(traced_on(fn, mesh), **kw)


def group_grads(loss_fn: Callable, params: Any, mb: Any, denoms: dict[str, jax.Array],
                *extra: Any) -> tuple[dict[str, jax.Array], Any]:
    """``(stats, grads)`` of one row group; ``stats["loss"]`` is its part of the loss
    (``extra``: the frozen base under LoRA, the reference params with ``algo.kl_coef > 0``)."""
    (loss, stats), grads = jax.value_and_grad(loss_fn, argnums=0, has_aux=True)(
        params, mb, denoms, *extra)
    return dict(stats, loss=loss), grads


def lora_loss(loss_fn: Callable, base_ref: bool, train: Any, mb: Any,
              denoms: dict[str, jax.Array], frozen: Any, *ref: Any):
    """``loss_fn`` of the params ``train`` (adapters, and what else trains) joined with the
    ``frozen`` base: differentiated in ``train`` only, so the base gets no gradient.
    ``base_ref``: the KL reference is the base itself (every adapter zero), so a LoRA run
    needs no second copy of the weights."""
    if base_ref:
        ref = (join_params(jax.tree.map(jnp.zeros_like, train), frozen),)
    return loss_fn(join_params(train, frozen), mb, denoms, *ref)


def add_groups(a: tuple[dict, Any], b: tuple[dict, Any]) -> tuple[dict, Any]:
    """Two groups' ``(stats, grads)`` summed (``MAX_STATS`` by max)."""
    stats = {k: jnp.maximum(v, b[0][k]) if k in MAX_STATS else v + b[0][k]
             for k, v in a[0].items()}
    return stats, jax.tree.map(jnp.add, a[1], b[1])


def minibatch_denoms(counts: dict[str, jax.Array], weight: jax.Array) -> dict[str, jax.Array]:
    """The minibatch's totals (``weight [B]``: 1.0 on its rows)."""
    return {k: (v * weight).sum() for k, v in counts.items()}


def apply_step(params: Any, opt_state: Any, grads: Any, stats: dict[str, jax.Array],
               denoms: dict[str, jax.Array], *, tx: optax.GradientTransformation, kind: Kind):
    """One guarded optimizer step on a minibatch's summed gradient; its stats gain
    ``grad_norm``, ``skipped`` and ``_active`` (the minibatch has a token to train on)."""
    active = denoms["tokens"] > 0
    if kind == "policy":
        active = active | (denoms["positive"] > 0)
    params, opt_state, skipped = guarded_apply(tx, grads, opt_state, params, stats["loss"],
                                               active)
    stats = dict(stats, grad_norm=optax.tree.norm(grads),
                 skipped=skipped.astype(jnp.float32), _active=active.astype(jnp.float32))
    return params, opt_state, stats


def combine_stats(per_mb: list[dict[str, jax.Array]], *, name: str,
                  first_mb: tuple[str, ...]) -> dict[str, jax.Array]:
    """Means over the minibatches that stepped; ``{name}_skipped``/``{name}_empty_mb`` counts;
    ``first_mb`` stats of the first minibatch alone as ``{key}_first_mb``."""
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *per_mb)
    w = stacked.pop("_active")
    out = {}
    gap = {k: stacked.pop(k)[0] for k in GAP_STATS if k in stacked}
    if gap:  # NeMo-RL's token_mult_prob_error: exp of the token mean |log ratio|
        out.update(gap, sampler_prob_ratio_err=jnp.exp(gap["sampler_gap_abs_mean"]))
    for k, v in stacked.items():
        key = f"{name}_{k}" if k in ("loss", "grad_norm", "skipped") else k
        out[key] = (jnp.max(v) if k in MAX_STATS
                    else (v * w).sum() / jnp.maximum(w.sum(), 1.0))
    out[f"{name}_skipped"] = stacked["skipped"].sum()
    out[f"{name}_empty_mb"] = (1.0 - w).sum()
    out.update({f"{k}_first_mb": stacked[k][0] for k in first_mb})
    return out


def put_rows(values: jax.Array, part: jax.Array, rows: jax.Array, valid: jax.Array
             ) -> jax.Array:
    """``values [B, S]`` with rows ``rows [R]``, columns ``:W``, set to ``part [R, W]``
    (padding rows, ``valid`` False, dropped)."""
    idx = jnp.where(valid, rows, values.shape[0])
    return values.at[idx, :part.shape[1]].set(part, mode="drop")


def advantage_stats(batch: TrainBatch, targets: Targets, *, groups: bool
                    ) -> dict[str, jax.Array]:
    """Where the policy's advantage went (``algo.advantage_mass``) and, with ``groups`` (an
    estimator that reads same-step siblings), the fraction of finished rows it judged."""
    out = algo.advantage_mass(targets.advantages, targets.policy_mask, batch.finished,
                              batch.correct)
    if groups:
        out["group_baseline_frac"] = algo.group_baseline_frac(batch.group, batch.finished)
    return out


@dataclass(frozen=True)
class UpdatePrograms:
    """One update's (policy or value) jitted programs: the row gather ``take``, the group
    gradient ``grads`` (the one that compiles per group shape), and the minibatch's sum,
    denominators, guarded step and stats."""

    kind: Kind
    take: Callable
    grads: Callable
    add: Callable
    apply: Callable
    counts: Callable
    denoms: Callable
    combine: Callable
    extra: tuple[Any, ...] = ()  # sharding placeholders of the extra args (compile path)
    uses_ref: bool = False  # the policy loss has a KL-to-reference term (algo.kl_coef > 0)
    trainable: tuple[str, ...] | None = None  # None: every param trains; else LoRA


class Learner:
    """T-PPO's training step over a ``TrainState`` (pure arrays in, state and stats out).

    ``Learner(policy_def, value_def, cfg, mesh=..., state=...)``: the graph defs of the
    policy and the critic (``nnx.split``), the static knobs, and on a mesh the state as
    placed now (its shardings are declared in and out of every program; abstract
    ``ShapeDtypeStruct`` trees work, as the compile path passes). ``trainable``: the params
    each model trains under LoRA (``models.lora.split_trainable``; None: all).

    ``step(state, batch, rows)`` is a training step; ``values``, ``targets``,
    ``update_policy`` and ``update_value`` are its parts. A critic-free estimator
    (``estimators.needs_critic``): ``value_def`` and the state's value trees are None, and
    ``value`` / ``group_values`` too (nothing of the critic's is jitted or compiled).
    """

    def __init__(self, policy_def: Any, value_def: Any, cfg: LearnerConfig, *,
                 mesh: Any = None, state: TrainState | None = None,
                 trainable: tuple[tuple[str, ...] | None, tuple[str, ...] | None] = (None,
                                                                                     None)
                 ) -> None:
        if mesh is not None and state is None:
            raise ValueError("Learner on a mesh needs the state as placed (state=...)")
        self.cfg, self.mesh = cfg, mesh
        self.policy_def, self.value_def = policy_def, value_def
        self.tx_policy, self.tx_value = policy_optimizer(cfg.optim), value_optimizer(cfg.optim)
        self.unit = 1
        self._rows = self._rep = None
        if mesh is not None:
            from tppo_jax.parallel.mesh import data_parallel_size

            self.unit = data_parallel_size(mesh)
            self._rows, self._rep = batch_spec(mesh), NamedSharding(mesh, PartitionSpec())
        self.policy = self._update("policy", policy_def, self.tx_policy, trainable[0],
                                   None if state is None else (state.policy, state.policy_opt))
        critic = needs_critic(cfg.algo)
        self.value = self.group_values = None
        if critic:
            self.value = self._update("value", value_def, self.tx_value, trainable[1],
                                      None if state is None else (state.value, state.value_opt))
        rows, rep = self._rows, self._rep
        vp = None if mesh is None or not critic else placed(state.value, mesh)
        self.take_tokens = _jit(TokenRows.take, mesh, out_shardings=rows,
                                static_argnames="width")
        if critic:
            self.group_values = _jit(partial(_group_values, value_def, cfg), mesh, (vp, rows),
                                     rows)
        pp = None if mesh is None else placed(state.policy, mesh)
        self.group_logprobs = _jit(partial(group_logprobs, policy_def, cfg=cfg), mesh,
                                   (pp, rows), rows)
        self._put = _jit(put_rows, mesh, (rows, rows, rep, rep), rows, donate_argnums=0)
        self._blank = _jit(_blank, mesh, out_shardings=rows, static_argnums=1)
        self.finish = _jit(partial(_targets, a=cfg.algo, window=cfg.window), mesh,
                           (rows, rows), rows)
        self._adv_stats = jax.jit(partial(advantage_stats, groups=reads_groups(cfg.algo)))
        self._explained = jax.jit(algo.explained_variance)

    @property
    def uses_ref(self) -> bool:
        """The policy update needs the reference params (``algo.kl_coef > 0``, no LoRA)."""
        return self.policy.uses_ref

    def compiled_fns(self) -> dict[str, Callable]:
        """The programs that compile once per row-group shape, by name (a compile watch)."""
        old = ({"old_logprobs": self.group_logprobs}
               if self.cfg.algo.sampler_correction != "none" else {})
        if self.value is None:  # critic-free
            return {"policy_update": self.policy.grads, **old}
        return {"rollout_targets": self.group_values, "policy_update": self.policy.grads,
                "value_update": self.value.grads, **old}

    def _update(self, kind: Kind, graphdef: Any, tx: optax.GradientTransformation,
                trainable: tuple[str, ...] | None, placed_now: tuple[Any, Any] | None
                ) -> UpdatePrograms:
        cfg, mesh, rows, rep = self.cfg, self.mesh, self._rows, self._rep
        kl = kind == "policy" and cfg.algo.kl_coef > 0
        uses_ref = kl and trainable is None  # LoRA: the reference is the frozen base
        loss = (partial(policy_loss, graphdef, cfg=cfg) if kind == "policy"
                else partial(value_loss, graphdef, cfg=cfg))
        if trainable is not None:
            loss = partial(lora_loss, loss, kl)
        grads, apply = partial(group_grads, loss), partial(apply_step, tx=tx, kind=kind)
        p = o = None
        extra: tuple[Any, ...] = ()
        if mesh is not None:
            p, o = placed(placed_now[0], mesh), placed(placed_now[1], mesh)
            extra = (p,) if uses_ref else ()
            if trainable is not None:  # the trained part in and out, the frozen base in only
                p, frozen = split_trainable(p, trainable)
                extra = (frozen,)
        first = FIRST_MB_STATS if kind == "policy" else ()
        return UpdatePrograms(
            kind=kind,
            take=_jit(ROWS[kind].take, mesh, out_shardings=rows, static_argnames="width"),
            grads=_jit(grads, mesh, (p, rows, rep, *extra), (rep, p)),
            add=jax.jit(add_groups, donate_argnums=0),
            apply=_jit(apply, mesh, (p, o, p, rep, rep), (p, o, rep), donate_argnums=(0, 1)),
            counts=jax.jit(partial(row_counts, kind=kind)),
            denoms=jax.jit(minibatch_denoms),
            combine=jax.jit(partial(combine_stats, name=kind, first_mb=first)),
            extra=extra, uses_ref=uses_ref, trainable=trainable)

    # -- the values pass and the targets ------------------------------------------------

    def value_groups(self, lengths: np.ndarray, width: int, rows: np.ndarray | None = None
                     ) -> tuple[RowGroup, ...]:
        """The values pass's row groups: every row once (or ``rows``), longest first, as
        one minibatch of the update holds them (the same activation budget)."""
        o, b = self.cfg.optim, len(lengths)
        rows = np.arange(b) if rows is None else np.asarray(rows)
        if not len(rows):
            return ()
        return plan_minibatch(rows, np.asarray(lengths), b, unit=self.unit, cap=width,
                              max_rows=max_group_rows(b, o.minibatches, o.grad_accum)).groups

    def values(self, value_params: Any, batch: TrainBatch, lengths: np.ndarray,
               rows: np.ndarray | None = None) -> jax.Array:
        """``[B, S]`` ``V(s_t)`` of the critic over the rollout, run as row groups (causal
        attention: a row's values do not depend on the width it is cut to); 0 past each
        row's group width and on rows not in ``rows`` (None: all). Critic-free: zeros."""
        if self.group_values is None:
            return self._blank(batch.attn, jnp.float32)
        return self.row_pass(self.group_values, value_params, batch, lengths, rows)

    def row_pass(self, fn: Callable, params: Any, batch: TrainBatch, lengths: np.ndarray,
                 rows: np.ndarray | None = None) -> jax.Array:
        """``[B, S]`` of a per-token forward ``fn(params, TokenRows) -> [R, W]`` (the
        critic's values, the policy's log-probs) run as the values pass's row groups."""
        out = None
        for g in self.value_groups(lengths, batch.shape[1], rows):
            part = fn(params, self.take_tokens(batch, None, g.rows, g.valid, width=g.width))
            if out is None:  # made where the batch lives (sharded like a row array)
                out = self._blank(batch.attn, part.dtype)
            out = self._put(out, part, g.rows, g.valid)
        return self._blank(batch.attn, jnp.float32) if out is None else out

    def targets(self, value_params: Any, batch: TrainBatch, lengths: np.ndarray) -> Targets:
        """The critic's values pass, then ``estimators.compute_targets``."""
        return self.finish(self.values(value_params, batch, lengths), batch)

    # -- the updates --------------------------------------------------------------------

    def plan(self, kind: Kind, rows: RowPlan, width: int) -> list[Minibatch]:
        """The optimizer steps of one update: the policy's over every row, the critic's over
        the finished rows (``plan.plan_update`` with this learner's settings). Critic-free,
        the policy's too: no other row has a token to train on."""
        o = self.cfg.optim
        every = kind == "policy" and self.value is not None
        return plan_update(rows.lengths, minibatches=o.minibatches,
                           epochs=o.epochs if kind == "policy" else o.critic_epochs,
                           grad_accum=o.grad_accum, unit=self.unit, cap=width,
                           shuffle=rows.shuffle, rows=None if every else rows.finished)

    def _run(self, u: UpdatePrograms, params: Any, opt_state: Any, batch: TrainBatch,
             targets: Targets, plan: list[Minibatch], extra: tuple[Any, ...]
             ) -> tuple[Any, Any, dict[str, jax.Array]]:
        frozen = None
        if u.trainable is not None:
            params, frozen = split_trainable(params, u.trainable)
            extra = (frozen, *extra)
        counts = u.counts(targets)
        per_mb, stats0 = [], None
        for mb in plan:
            d = u.denoms(counts, mb.weight)
            acc = None
            for g in mb.groups:
                part = u.grads(params, u.take(batch, targets, g.rows, g.valid, width=g.width),
                               d, *extra)
                acc = part if acc is None else u.add(acc, part)
            if acc is None:  # no rows: no step (stats filled in below)
                per_mb.append(None)
                continue
            params, opt_state, stats = u.apply(params, opt_state, acc[1], acc[0], d)
            stats0 = stats
            per_mb.append(stats)
        if frozen is not None:
            params = join_params(params, frozen)
        if stats0 is None:  # nothing to train on anywhere
            return params, opt_state, {f"{u.kind}_loss": jnp.zeros(()),
                                       f"{u.kind}_skipped": jnp.zeros(())}
        zero = jax.tree.map(jnp.zeros_like, stats0)
        return params, opt_state, u.combine([zero if s is None else s for s in per_mb])

    def update_policy(self, params: Any, opt_state: Any, batch: TrainBatch, targets: Targets,
                      plan: list[Minibatch], ref: Any = None
                      ) -> tuple[Any, Any, dict[str, jax.Array]]:
        """PPO epochs x minibatches on the policy mask (+ positive-example NLL, + KL to
        ``ref``, the reference params, required when ``uses_ref``). Returns ``(params,
        opt_state, stats)``; ``stats["policy_loss"]`` is the total loss."""
        if self.uses_ref and ref is None:
            raise ValueError("algo.kl_coef > 0: the policy update needs the reference params")
        return self._run(self.policy, params, opt_state, batch, targets, plan,
                         (ref,) if self.uses_ref else ())

    def update_value(self, params: Any, opt_state: Any, batch: TrainBatch, targets: Targets,
                     plan: list[Minibatch]) -> tuple[Any, Any, dict[str, jax.Array]]:
        """Clipped value regression to MC returns on the value mask; its stats gain the
        rollout-time critic's explained variance of this batch's returns."""
        params, opt_state, stats = self._run(self.value, params, opt_state, batch, targets,
                                             plan, ())
        if any(mb.groups for mb in plan):
            stats["explained_variance"] = self._explained(targets.values_old, targets.returns,
                                                          targets.value_mask)
        return params, opt_state, stats

    def step(self, state: TrainState, batch: TrainBatch, rows: RowPlan, *,
             train_policy: bool = True, ref: Any = None,
             edit_targets: Callable[[Targets], Targets] | None = None
             ) -> tuple[TrainState, StepStats]:
        """One T-PPO step: targets at ``state.value``, then the policy's update (unless
        ``train_policy`` is False: critic warm-up) and the critic's on the finished rows,
        dispatched back to back (critic-free: the policy's alone, and ``StepStats.value`` is
        empty). ``edit_targets``: a caller's change to the targets before
        the updates read them (fault injection). Returns the state one step on."""
        return self._step(state, batch, rows, train_policy, ref, edit_targets)

    def _step(self, state: TrainState, batch: TrainBatch, rows: RowPlan, train_policy: bool,
              ref: Any, edit_targets: Callable[[Targets], Targets] | None
              ) -> tuple[TrainState, StepStats]:
        width = batch.shape[1]
        targets = self.targets(state.value, batch, rows.lengths)
        if edit_targets is not None:
            targets = edit_targets(targets)
        policy, popt, pstats, pcells = state.policy, state.policy_opt, {}, 0
        if train_policy and self.cfg.algo.sampler_correction != "none":
            targets = targets.replace(old_logprobs=self.row_pass(
                self.group_logprobs, state.policy, batch, rows.lengths))
        if train_policy:
            plan = self.plan("policy", rows, width)
            policy, popt, pstats = self.update_policy(policy, popt, batch, targets, plan, ref)
            pcells = plan_cells(plan)
        value, vopt, vcells = state.value, state.value_opt, 0
        vstats = ({} if self.value is None
                  else {"value_loss": jnp.zeros(()), "value_skipped": jnp.zeros(())})
        if len(rows.finished) and self.value is not None:
            plan = self.plan("value", rows, width)
            value, vopt, vstats = self.update_value(value, vopt, batch, targets, plan)
            vcells = plan_cells(plan)
        state = dataclasses.replace(state, policy=policy, value=value, policy_opt=popt,
                                    value_opt=vopt, step=state.step + 1)
        return state, StepStats(pstats, vstats, self._adv_stats(batch, targets), pcells,
                                vcells)


def _group_values(graphdef: Any, cfg: LearnerConfig, value_params: Any, group: TokenRows
                  ) -> jax.Array:
    return critic_token_values(cfg.merge(graphdef, value_params), group.tokens, group.attn)


def _targets(values: jax.Array, batch: TrainBatch, *, a: Any, window: int) -> Targets:
    return compute_targets(values, batch, a, window)


def _blank(like: jax.Array, dtype: Any) -> jax.Array:
    return jnp.zeros(like.shape, dtype)
