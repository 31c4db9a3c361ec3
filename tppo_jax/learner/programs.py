"""The programs one ``Learner.step`` runs, each with the arguments it runs on: the learner's
program table, read by the compile path (``tppo plan --compile``) and the accelerator
benchmark.

Every argument comes from the function that makes it in a step, evaluated abstractly
(``jitted.eval_shape``: shapes, dtypes and the shardings the jitted function declares):
the batch from ``TrainBatch``'s own fields (``TrainBatch.abstract``), the targets from the
targets program, a row group's record from its ``take``, the minibatch denominators from
the counts, the summed gradient and stats from the group gradient. A field added to any of
these records reaches the compiled program by itself.

Programs (names as the compiled report gives them):
- ``policy_update[w=W]`` / ``value_update[w=W]``: one row group's gradient at width bucket
  ``W`` with the rows every group of that width has (``plan.group_rows``);
- ``policy_apply`` / ``value_apply``: the guarded AdamW step on a minibatch's summed gradient;
- ``targets[w=W]``: the critic's values pass over a row group (``old_logprobs[w=W]``: the
  policy's log-probs pass, with ``algo.sampler_correction``); ``targets_finish``: the
  advantages and returns over the ``[B, S]`` buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from tppo_jax.buckets import width_buckets
from tppo_jax.learner.batch import Targets, TrainBatch
from tppo_jax.learner.learner import Learner
from tppo_jax.learner.plan import group_rows, max_group_rows
from tppo_jax.learner.state import TrainState
from tppo_jax.models.lora import split_trainable
from tppo_jax.programs import Program, on_mesh

# The groups of programs a step runs (``--programs``), in the order they are listed.
KINDS = ("policy_update", "policy_apply", "value_update", "value_apply", "targets")


def rows_per_group(learner: Learner, batch_rows: int, width: int) -> int:
    """Rows of every row group ``width`` columns wide, for a batch of ``batch_rows`` rows."""
    o = learner.cfg.optim
    return group_rows(width, max_group_rows(batch_rows, o.minibatches, o.grad_accum),
                      learner.unit)


def row_group(take: Any, batch: TrainBatch, targets: Targets | None, rows: int, width: int
              ) -> Any:
    """The record ``take`` cuts for a group of ``rows`` rows at ``width`` columns, abstract."""
    idx = jax.ShapeDtypeStruct((rows,), jnp.int32)
    valid = jax.ShapeDtypeStruct((rows,), jnp.bool_)
    return take.eval_shape(batch, targets, idx, valid, width=width)


def _token_pass(learner: Learner, fn: Any, params: Any, batch: TrainBatch) -> Any:
    """``[B, S]`` of a per-token pass (``Learner.row_pass``), abstract: the dtype of ``fn``'s
    output, laid out as the batch's rows."""
    b, s = batch.shape
    grp = row_group(learner.take_tokens, batch, None, rows_per_group(learner, b, s), s)
    part = fn.eval_shape(params, grp)
    return jax.ShapeDtypeStruct(batch.shape, part.dtype, sharding=batch.tokens.sharding)


def abstract_targets(learner: Learner, state: TrainState, batch: TrainBatch
                     ) -> tuple[Any, Targets]:
    """``(values, targets)``: the values pass's ``[B, S]`` and the targets the updates read,
    abstract, as ``Learner.step`` makes them (the policy's own log-probs added with
    ``algo.sampler_correction``)."""
    if learner.group_values is None:  # critic-free: zeros
        values = jax.ShapeDtypeStruct(batch.shape, jnp.float32, sharding=batch.tokens.sharding)
    else:
        values = _token_pass(learner, learner.group_values, state.value, batch)
    targets = learner.finish.eval_shape(values, batch)
    if learner.cfg.algo.sampler_correction != "none":
        targets = targets.replace(old_logprobs=_token_pass(
            learner, learner.group_logprobs, state.policy, batch))
    return values, targets


def _update_programs(learner: Learner, u: Any, params: Any, opt: Any, batch: TrainBatch,
                     targets: Targets, widths: Sequence[int], ref: Any,
                     kinds: Sequence[str]) -> list[Program]:
    """One update's group gradients (one per width) and its optimizer step."""
    kind = u.kind
    if f"{kind}_update" not in kinds and f"{kind}_apply" not in kinds:
        return []
    if u.uses_ref and ref is None:
        raise ValueError("algo.kl_coef > 0: the policy update needs the reference params")
    train, extra = params, ((ref,) if u.uses_ref else ())
    if u.trainable is not None:  # LoRA: the trained part in, the frozen base beside it
        train, frozen = split_trainable(params, u.trainable)
        extra = (frozen,)
    b = batch.shape[0]
    weight = jax.ShapeDtypeStruct((b,), jnp.float32)
    denoms = on_mesh(u.denoms.eval_shape(u.counts.eval_shape(targets), weight), learner.mesh)
    held = (f"{kind}_params",) + (("reference_policy",) if u.uses_ref else ())
    out, groups = [], {}
    for w in widths:
        rows = rows_per_group(learner, b, w)
        groups[w] = row_group(u.take, batch, targets, rows, w)
        if f"{kind}_update" in kinds:
            out.append(Program(f"{kind}_update[w={w}]", f"{kind}_update", u.grads,
                               (train, groups[w], denoms, *extra),
                               {"rows": rows, "width": w, "tokens": rows * w}, held))
    if f"{kind}_apply" in kinds:
        stats, grads = u.grads.eval_shape(train, groups[widths[0]], denoms, *extra)
        out.append(Program(f"{kind}_apply", f"{kind}_apply", u.apply,
                           (train, opt, grads, on_mesh(stats, learner.mesh), denoms), {},
                           (f"{kind}_params", f"{kind}_opt")))
    return out


def _targets_programs(learner: Learner, state: TrainState, batch: TrainBatch, values: Any,
                      widths: Sequence[int]) -> list[Program]:
    """The rollout-time passes over row groups, then the targets over the whole buffer."""
    b, s = batch.shape
    out = []
    passes = [("targets", learner.group_values, state.value, "value_params")]
    if learner.cfg.algo.sampler_correction != "none":
        passes.append(("old_logprobs", learner.group_logprobs, state.policy, "policy_params"))
    for name, fn, params, held in passes:
        for w in widths if fn is not None else ():  # critic-free: no values pass
            rows = rows_per_group(learner, b, w)
            grp = row_group(learner.take_tokens, batch, None, rows, w)
            out.append(Program(f"{name}[w={w}]", "targets", fn, (params, grp),
                               {"rows": rows, "width": w}, (held,)))
    out.append(Program("targets_finish", "targets", learner.finish, (values, batch),
                       {"rows": b, "width": s}, ()))
    return out


def step_programs(learner: Learner, state: TrainState, batch: TrainBatch, *,
                  widths: Sequence[int] | None = None, ref: Any = None,
                  kinds: Sequence[str] = KINDS) -> list[Program]:
    """The programs ``learner.step(state, batch, ...)`` runs, of the ``kinds`` asked for
    (``KINDS``), with their arguments: ``state`` and ``batch`` abstract or real (a batch of
    the buffer's full width, ``TrainBatch.abstract``), ``ref`` the KL reference's params
    (``Learner.uses_ref``). ``widths``: the row groups' width buckets to build (default
    every bucket up to the batch's width, ``buckets.width_buckets``). A critic-free learner
    has no ``value_*`` or ``targets[w=...]`` programs."""
    bad = sorted(set(kinds) - set(KINDS))
    if bad:
        raise ValueError(f"unknown learner programs {bad}; known: {', '.join(KINDS)}")
    widths = list(width_buckets(batch.shape[1]) if widths is None else widths)
    values, targets = abstract_targets(learner, state, batch)
    out = []
    for u, params, opt in ((learner.policy, state.policy, state.policy_opt),
                           (learner.value, state.value, state.value_opt)):
        if u is not None:
            out += _update_programs(learner, u, params, opt, batch, targets, widths, ref,
                                    kinds)
    if "targets" in kinds:
        out += _targets_programs(learner, state, batch, values, widths)
    return out


__all__ = ["KINDS", "abstract_targets", "row_group", "rows_per_group", "step_programs"]
