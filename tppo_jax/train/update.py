"""The policy and value updates: epochs x minibatches of optimizer steps, each minibatch run
as row groups of one width bucket (``update_plan``), their gradients summed, then one guarded
AdamW step.

The host loop only dispatches: the plan comes from host arrays (row lengths, shuffle keys)
and every device value stays on device, so the trainer still dispatches the policy and value
updates back to back without waiting on either (jax's async dispatch), as T-PPO prescribes.
The jitted pieces (row gather, group gradient, sum, apply, stats) compile once per shape: the
gradient once per width bucket (each width has one group size), the gather per (group
width, batch width), the rest once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from tppo_jax import algo
from tppo_jax.models.lora import join_params, split_trainable
from tppo_jax.train.step import (
    StepConfig,
    batch_spec,
    guarded_apply,
    placed,
    policy_group_loss,
    value_group_loss,
)
from tppo_jax.train.update_plan import Minibatch, plan_update

Kind = Literal["policy", "value"]

# The arrays each update's loss (and the critic's targets pass, ``train/targets.py``)
# reads, and which of them are masks (zeroed on padding rows).
KEYS = {"policy": ("tokens", "attn", "sample_logprobs", "advantages", "policy_mask",
                   "positive_mask"),
        "value": ("tokens", "attn", "values_old", "returns", "value_mask"),
        "targets": ("tokens", "attn")}
MASKS = {"policy_mask", "positive_mask", "value_mask"}

# The ratio statistics of the first minibatch, before this step changed the policy: with the
# ``keep`` KV policy they measure how far the sampled log-probs (decoded over an older policy's
# cache) are from a fresh forward pass; later minibatches average that away.
FIRST_MB_STATS = ("ratio_mean", "approx_kl", "clip_frac", "log_ratio_absmax")
MAX_STATS = ("log_ratio_absmax",)  # combined over groups and minibatches by max, not sum


def take_rows(batch: dict[str, jax.Array], rows: jax.Array, valid: jax.Array, *,
              width: int, kind: str) -> dict[str, jax.Array]:
    """``[R, width]`` row group of the ``[B, S]`` batch: rows ``rows``, columns ``:width``;
    the masks are zero on padding rows (``valid`` False)."""
    out = {}
    for k in KEYS[kind]:
        x = batch[k][rows]
        x = x[:, :width] if x.ndim == 2 else x
        out[k] = x * valid[:, None].astype(x.dtype) if k in MASKS else x
    return out


def row_counts(batch: dict[str, jax.Array], *, kind: Kind) -> dict[str, jax.Array]:
    """``[B]`` per-row counts the minibatch denominators sum: masked tokens (``tokens``),
    whether a row has any (``rows``), and for the policy the positive-example tokens."""
    m = batch["policy_mask" if kind == "policy" else "value_mask"].astype(jnp.float32).sum(1)
    out = {"tokens": m, "rows": (m > 0).astype(jnp.float32)}
    if kind == "policy":
        out["positive"] = batch["positive_mask"].astype(jnp.float32).sum(1)
    return out


def minibatch_denoms(counts: dict[str, jax.Array], weight: jax.Array) -> dict[str, jax.Array]:
    """The minibatch's totals (``weight [B]``: 1.0 on its rows)."""
    return {k: (v * weight).sum() for k, v in counts.items()}


def group_grads(loss_fn: Callable, params: Any, mb: dict[str, jax.Array],
                denoms: dict[str, jax.Array], *ref: Any) -> tuple[dict[str, jax.Array], Any]:
    """``(stats, grads)`` of one row group; ``stats["loss"]`` is its part of the loss
    (``ref``: the reference policy's params, for a policy loss with ``algo.kl_coef > 0``)."""
    (loss, stats), grads = jax.value_and_grad(loss_fn, argnums=0, has_aux=True)(
        params, mb, denoms, *ref)
    return dict(stats, loss=loss), grads


def lora_loss(loss_fn: Callable, base_ref: bool, train: Any, mb: dict[str, jax.Array],
              denoms: dict[str, jax.Array], frozen: Any, *ref: Any):
    """``loss_fn`` of the params ``train`` (adapters, and what else trains) joined with the
    ``frozen`` base: differentiated in ``train`` only, so the base gets no gradient.
    ``base_ref``: the KL reference is the base itself (every adapter zero), so a LoRA run
    needs no second copy of the weights."""
    if base_ref:
        ref = (join_params(jax.tree.map(jnp.zeros_like, train), frozen),)
    return loss_fn(join_params(train, frozen), mb, denoms, *ref)


class GroupGrads:
    """``group_grads`` jitted once per forward-only prefix (``grad_from``, a static of the
    policy's forward) and, as any jitted function, once per group shape:
    ``grads(params, mb, denoms, *extra, grad_from=P)``. ``make(P)`` builds the jitted
    function for ``P``; ``_cache_size()`` counts the shapes of all of them (the compile
    watch reads it)."""

    def __init__(self, make: Callable[[int], Callable]) -> None:
        self._make = make
        self._fns: dict[int, Callable] = {}

    def __call__(self, *args: Any, grad_from: int = 0) -> tuple[dict[str, jax.Array], Any]:
        return self.jitted(grad_from)(*args)

    def jitted(self, grad_from: int = 0) -> Callable:
        """The jitted gradient for ``grad_from`` (``.lower(...)`` compiles it ahead of time)."""
        if grad_from not in self._fns:
            self._fns[grad_from] = self._make(grad_from)
        return self._fns[grad_from]

    def _cache_size(self) -> int:
        return sum(int(f._cache_size()) for f in self._fns.values())


def add_groups(a: tuple[dict, Any], b: tuple[dict, Any]) -> tuple[dict, Any]:
    """Two groups' ``(stats, grads)`` summed (``MAX_STATS`` by max)."""
    stats = {k: jnp.maximum(v, b[0][k]) if k in MAX_STATS else v + b[0][k]
             for k, v in a[0].items()}
    return stats, jax.tree.map(jnp.add, a[1], b[1])


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
    for k, v in stacked.items():
        key = f"{name}_{k}" if k in ("loss", "grad_norm", "skipped") else k
        out[key] = (jnp.max(v) if k in MAX_STATS
                    else (v * w).sum() / jnp.maximum(w.sum(), 1.0))
    out[f"{name}_skipped"] = stacked["skipped"].sum()
    out[f"{name}_empty_mb"] = (1.0 - w).sum()
    out.update({f"{k}_first_mb": stacked[k][0] for k in first_mb})
    return out


@dataclass(frozen=True)
class Updater:
    """One update (policy or value) as jitted pieces and the host loop over its plan.

    Call ``updater(params, opt_state, batch, plan=...)`` -> ``(params, opt_state, stats)``:
    ``batch`` holds the ``[B, S]`` arrays of ``KEYS[kind]``; ``plan`` is ``self.plan(...)``,
    or made from host arrays ``lengths [B]`` (columns each row uses; default: ``attn``'s row
    sums, a device sync), ``shuffle [B, epochs]`` (each epoch's row order; default:
    ``batch["shuffle"]`` or the given order) and ``rows`` (the rows to train on; default all).
    ``ref``: the reference policy's params, required when ``uses_ref``. ``trainable``
    (LoRA): gradients and optimizer steps only for the adapters and the top-level params it
    names (``models.lora.split_trainable``; ``opt_state`` is theirs alone); the frozen rest
    of ``params`` comes back as the same arrays.
    """

    kind: Kind
    cfg: StepConfig
    unit: int  # group rows are multiples of it (the batch axes' size)
    take: Callable
    grads: GroupGrads  # the one that compiles per group shape
    add: Callable
    apply: Callable
    counts: Callable
    denoms: Callable
    combine: Callable
    explained_variance: Callable
    uses_ref: bool = False  # the policy loss has a KL-to-reference term (algo.kl_coef > 0)
    trainable: tuple[str, ...] | None = None  # None: every param trains; else LoRA

    def plan(self, lengths: np.ndarray, width: int, shuffle: np.ndarray | None = None,
             rows: np.ndarray | None = None, train_start: np.ndarray | None = None
             ) -> list[Minibatch]:
        """``update_plan.plan_update`` for this update's optimizer settings and mesh. With
        ``algo.detach_prefix``, the policy's groups run the columns before the first token
        their rows train (``train_start [B]``, ``RowPlan``'s) forward only."""
        o = self.cfg.optim
        epochs = o.epochs if self.kind == "policy" else o.critic_epochs
        first = None
        if self.kind == "policy" and self.cfg.algo.detach_prefix and train_start is not None:
            # a token is predicted from the column before it
            first = np.maximum(np.asarray(train_start) - 1, 0)
        return plan_update(lengths, minibatches=o.minibatches, epochs=epochs,
                           grad_accum=o.grad_accum, unit=self.unit, cap=width,
                           shuffle=shuffle, rows=rows, first_needed=first)

    def __call__(self, params: Any, opt_state: Any, batch: dict[str, jax.Array], *,
                 plan: list[Minibatch] | None = None, lengths: np.ndarray | None = None,
                 shuffle: np.ndarray | None = None, rows: np.ndarray | None = None,
                 ref: Any = None) -> tuple[Any, Any, dict[str, jax.Array]]:
        if self.uses_ref and ref is None:
            raise ValueError("algo.kl_coef > 0: the policy update needs the reference params")
        extra = (ref,) if self.uses_ref else ()
        frozen = None
        if self.trainable is not None:
            params, frozen = split_trainable(params, self.trainable)
            extra = (frozen, *extra)
        if plan is None:
            if lengths is None:
                lengths = np.asarray(jax.device_get(batch["attn"].sum(1)))
            if shuffle is None and "shuffle" in batch:
                shuffle = np.asarray(jax.device_get(batch["shuffle"]))
            plan = self.plan(np.asarray(lengths), int(batch["tokens"].shape[1]), shuffle, rows)
        counts = self.counts(batch)
        per_mb, stats0 = [], None
        for mb in plan:
            d = self.denoms(counts, mb.weight)
            acc = None
            for g in mb.groups:
                part = self.grads(params, self.take(batch, g.rows, g.valid, width=g.width), d,
                                  *extra, grad_from=g.grad_from)
                acc = part if acc is None else self.add(acc, part)
            if acc is None:  # no rows: no step (stats filled in below)
                per_mb.append(None)
                continue
            params, opt_state, stats = self.apply(params, opt_state, acc[1], acc[0], d)
            stats0 = stats
            per_mb.append(stats)
        if frozen is not None:
            params = join_params(params, frozen)
        if stats0 is None:  # nothing to train on anywhere
            return params, opt_state, {f"{self.kind}_loss": jnp.zeros(()),
                                       f"{self.kind}_skipped": jnp.zeros(())}
        zero = jax.tree.map(jnp.zeros_like, stats0)
        stats = self.combine([zero if s is None else s for s in per_mb])
        if self.kind == "value":  # the critic at rollout time against this batch's returns
            stats["explained_variance"] = self.explained_variance(
                batch["values_old"], batch["returns"], batch["value_mask"])
        return params, opt_state, stats


def plan_cells(plan: list[Minibatch]) -> int:
    """Token cells (rows x columns, padding included) a plan's forward passes run over."""
    return sum(g.rows.size * g.width for mb in plan for g in mb.groups)


def make_updater(kind: Kind, graphdef: Any, *, tx: optax.GradientTransformation,
                 cfg: StepConfig, mesh=None, params: Any = None,
                 opt_state: Any = None, trainable: tuple[str, ...] | None = None) -> Updater:
    """The policy or value ``Updater``; with ``mesh``, its steps declare the shardings of
    ``params`` and ``opt_state`` as placed now (in and out) and split row groups over the
    batch axes. ``trainable``: see ``Updater`` (LoRA; ``opt_state`` is the adapters')."""
    kl = kind == "policy" and cfg.algo.kl_coef > 0

    def grads(grad_from: int) -> Callable:  # the group gradient for one forward-only prefix
        loss = (partial(policy_group_loss, graphdef, cfg=cfg, grad_from=grad_from)
                if kind == "policy" else partial(value_group_loss, graphdef, cfg=cfg))
        if trainable is not None:
            loss = partial(lora_loss, loss, kl)
        return partial(group_grads, loss)
    apply = partial(apply_step, tx=tx, kind=kind)
    name = "policy" if kind == "policy" else "value"
    first = FIRST_MB_STATS if kind == "policy" else ()
    combine = jax.jit(partial(combine_stats, name=name, first_mb=first))
    uses_ref = kl and trainable is None  # LoRA: the reference is the frozen base
    common = dict(kind=kind, cfg=cfg, uses_ref=uses_ref, trainable=trainable,
                  counts=jax.jit(partial(row_counts, kind=kind)),
                  denoms=jax.jit(minibatch_denoms), add=jax.jit(add_groups, donate_argnums=0),
                  combine=combine, explained_variance=jax.jit(algo.explained_variance))
    take = partial(take_rows, kind=kind)
    if mesh is None:
        return Updater(unit=1, take=jax.jit(take, static_argnames="width"),
                       grads=GroupGrads(lambda p: jax.jit(grads(p))),
                       apply=jax.jit(apply, donate_argnums=(0, 1)),
                       **common)
    from tppo_jax.parallel.mesh import data_parallel_size

    rep, rows = NamedSharding(mesh, PartitionSpec()), batch_spec(mesh)
    p, o = placed(params, mesh), placed(opt_state, mesh)
    extra = (p,) if uses_ref else ()
    if trainable is not None:  # the trained part in and out, the frozen base in only
        p, frozen = split_trainable(p, trainable)
        extra = (frozen,)
    return Updater(
        unit=data_parallel_size(mesh),
        take=jax.jit(take, static_argnames="width", out_shardings=rows),
        grads=GroupGrads(lambda gf: jax.jit(grads(gf), in_shardings=(p, rows, rep, *extra),
                                            out_shardings=(rep, p))),
        apply=jax.jit(apply, donate_argnums=(0, 1), in_shardings=(p, o, p, rep, rep),
                      out_shardings=(p, o, rep)),
        **common)


@lru_cache(maxsize=32)
def _default_updater(kind: Kind, graphdef: Any, tx: optax.GradientTransformation,
                     cfg: StepConfig, trainable: tuple[str, ...] | None = None) -> Updater:
    return make_updater(kind, graphdef, tx=tx, cfg=cfg, trainable=trainable)


def policy_update(graphdef: Any, params: Any, opt_state: Any, batch: dict[str, jax.Array], *,
                  tx: optax.GradientTransformation, cfg: StepConfig,
                  trainable: tuple[str, ...] | None = None, **plan: Any):
    """PPO epochs x minibatches on the policy mask (+ positive-example NLL, weight mu), off
    any mesh. ``batch``: ``[B, S]`` ``tokens, attn, sample_logprobs, advantages,
    policy_mask, positive_mask`` (optionally ``shuffle [B, epochs]``); ``plan``: ``Updater``'s
    keywords. Returns ``(params, opt_state, stats)``; ``stats["policy_loss"]`` is the total
    loss. ``trainable``: see ``Updater`` (LoRA)."""
    return _default_updater("policy", graphdef, tx, cfg, trainable)(params, opt_state, batch,
                                                                     **plan)


def value_update(graphdef: Any, params: Any, opt_state: Any, batch: dict[str, jax.Array], *,
                 tx: optax.GradientTransformation, cfg: StepConfig,
                 trainable: tuple[str, ...] | None = None, **plan: Any):
    """Clipped value regression to MC returns on the value mask, off any mesh; as
    ``policy_update`` with ``tokens, attn, values_old, returns, value_mask`` (``rows``: the
    finished rows, so the critic pays only for rows with a target)."""
    return _default_updater("value", graphdef, tx, cfg, trainable)(params, opt_state, batch,
                                                                    **plan)
