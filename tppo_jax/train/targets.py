"""The rollout-time critic pass and the targets (EGAE advantages, MC returns, masks), with the
critic's forward run as row groups, each at its own width bucket.

The forward over the whole ``[B, S]`` buffer made every row pay for the batch's longest one,
as the update did before its row groups (``update_plan``): on the long-tail task that pass
was ~40% of a grouped update. Causal attention makes ``V(s_t)`` of a row depend only on its
first ``t`` tokens, so cutting a row to any width that holds it leaves its values unchanged;
the groups' values are put back into a ``[B, S]`` array (zero past each group's width, where
every mask is zero) and ``compute_targets`` runs on it once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from tppo_jax.train.step import (
    StepConfig,
    batch_spec,
    group_values,
    placed,
    put_rows,
    targets_with_values,
)
from tppo_jax.train.update import take_rows
from tppo_jax.train.update_plan import RowGroup, max_group_rows, plan_minibatch


@dataclass(frozen=True)
class Targets:
    """Call ``targets(value_params, batch, lengths=...)`` -> the targets dict (``[B, S]``
    each, plus ``lam [B]``), equal to ``step.rollout_targets``.

    ``batch``: the rollout arrays ``compute_targets`` reads; ``lengths [B]``: columns each row
    uses (host ints; default: ``attn``'s row sums, a device sync).
    """

    cfg: StepConfig
    unit: int  # group rows are multiples of it (the batch axes' size)
    take: Callable
    values: Callable  # the one that compiles per group shape
    put: Callable
    finish: Callable
    blank: Callable  # zeros like ``attn [B, S]``, of a given dtype

    def plan(self, lengths: np.ndarray, width: int, rows: np.ndarray | None = None
             ) -> tuple[RowGroup, ...]:
        """Every row once (or ``rows``), longest first, in groups as one minibatch of the
        update holds (at most ``B / (minibatches x grad_accum)`` rows: the same activation
        budget)."""
        o, b = self.cfg.optim, len(lengths)
        rows = np.arange(b) if rows is None else np.asarray(rows)
        if not len(rows):
            return ()
        return plan_minibatch(rows, np.asarray(lengths), b, unit=self.unit, cap=width,
                              max_rows=max_group_rows(b, o.minibatches, o.grad_accum)).groups

    def __call__(self, value_params: Any, batch: dict[str, jax.Array], *,
                 lengths: np.ndarray | None = None, rows: np.ndarray | None = None
                 ) -> dict[str, jax.Array]:
        """``rows``: the only rows whose values any target reads (None: all); the others'
        values are left 0."""
        if lengths is None:
            lengths = np.asarray(jax.device_get(batch["attn"].sum(1)))
        values = None
        for g in self.plan(lengths, int(batch["tokens"].shape[1]), rows):
            part = self.values(value_params, self.take(batch, g.rows, g.valid, width=g.width))
            if values is None:  # made where the batch lives (sharded like a row array)
                values = self.blank(batch["attn"], part.dtype)
            values = self.put(values, part, g.rows, g.valid)
        if values is None:  # no row to score
            values = self.blank(batch["attn"], jnp.float32)
        return self.finish(values, batch)


def make_targets(graphdef: Any, cfg: StepConfig, *, mesh=None, params: Any = None) -> Targets:
    """The grouped targets pass; with ``mesh``, the critic's params in as placed now
    (``params``) and every row-indexed array split over the batch axes."""
    take = partial(take_rows, kind="targets")
    values = partial(group_values, graphdef)
    finish = partial(targets_with_values, cfg=cfg)
    if mesh is None:
        return Targets(cfg=cfg, unit=1, take=jax.jit(take, static_argnames="width"),
                       values=jax.jit(values), put=jax.jit(put_rows, donate_argnums=0),
                       finish=jax.jit(finish), blank=jax.jit(_blank, static_argnums=1))
    from tppo_jax.parallel.mesh import data_parallel_size

    rows, rep = batch_spec(mesh), NamedSharding(mesh, PartitionSpec())
    return Targets(
        cfg=cfg, unit=data_parallel_size(mesh),
        take=jax.jit(take, static_argnames="width", out_shardings=rows),
        values=jax.jit(values, in_shardings=(placed(params, mesh), rows), out_shardings=rows),
        put=jax.jit(put_rows, donate_argnums=0, in_shardings=(rows, rows, rep, rep),
                    out_shardings=rows),
        finish=jax.jit(finish, in_shardings=(rows, rows), out_shardings=rows),
        blank=jax.jit(_blank, static_argnums=1, out_shardings=rows))


def _blank(like: jax.Array, dtype: Any) -> jax.Array:
    return jnp.zeros(like.shape, dtype)
