"""Which rows each optimizer step trains on, and at which column width (host bookkeeping).

A rollout's rows are long-tailed: a few reach the full buffer while most stop within a
window or two, and self-attention's cost grows with the square of the width. So each
minibatch is split into *row groups*, longest rows first: each group runs at the width
bucket its longest row needs, and the gradients of a minibatch's groups add up to the
minibatch's gradient exactly (the losses divide by the whole minibatch's token count, see
``algo.aggregate``'s ``denom``).

Shapes stay few: widths are ``buckets.width_buckets`` and each width has one row count
(``group_rows``; padding rows carry no mask), so a run compiles one group shape per width
bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tppo_jax.buckets import bucket_width

# A row group holds at most (minibatch rows x GROUP_COLUMNS) token cells, or one row: at the
# shortest widths a whole minibatch, at the longest a row or two. Fewer cells per group would
# mean more, smaller dispatches; more would let short rows ride along at long widths.
GROUP_COLUMNS = 64


@dataclass(frozen=True)
class RowGroup:
    """Rows run together at one width: ``rows [R]`` global row indices (padding repeats a
    row), ``valid [R]`` (False on padding), ``width`` columns."""

    rows: np.ndarray
    valid: np.ndarray
    width: int


@dataclass(frozen=True)
class Minibatch:
    """One optimizer step: ``weight [B]`` (1.0 on its rows; the loss denominators are
    counted over these) and the row groups whose gradients it sums."""

    weight: np.ndarray
    groups: tuple[RowGroup, ...]


def max_group_rows(batch: int, minibatches: int, grad_accum: int) -> int:
    """The most rows a group holds: one minibatch's rows over ``grad_accum`` (the activation
    memory of one group at a time), always from the whole batch's size ``batch``."""
    return max(-(-batch // (minibatches * grad_accum)), 1)


def group_rows(width: int, max_rows: int, unit: int) -> int:
    """Rows of every group ``width`` columns wide: ``max_rows * GROUP_COLUMNS // width``,
    between 1 and ``max_rows``, rounded up to a multiple of ``unit`` (the mesh's batch ways).
    One row count per width: a run compiles one group shape per width bucket."""
    r = max(1, min(max_rows, max_rows * GROUP_COLUMNS // width))
    return -(-r // unit) * unit


def plan_minibatch(rows: np.ndarray, lengths: np.ndarray, batch: int, *, max_rows: int,
                   unit: int, cap: int) -> Minibatch:
    """The row groups of one minibatch: its rows longest first, each group the next
    ``group_rows(w)`` of them at the width bucket ``w`` of the longest (so a group's shorter
    rows fill room its width pays for anyway); the last group is padded."""
    weight = np.zeros(batch, np.float32)
    weight[rows] = 1.0
    order = rows[np.argsort(-lengths[rows], kind="stable")]
    groups, i = [], 0
    while i < len(order):
        w = bucket_width(int(lengths[order[i]]), cap)
        r = group_rows(w, max_rows, unit)
        chunk = order[i:i + r]
        i += r
        pad = np.full(r - len(chunk), chunk[0], np.int64)
        groups.append(RowGroup(np.concatenate([chunk, pad]).astype(np.int32),
                               np.arange(r) < len(chunk), w))
    return Minibatch(weight, tuple(groups))


def plan_update(lengths: np.ndarray, *, minibatches: int, epochs: int, grad_accum: int,
                unit: int, cap: int, shuffle: np.ndarray | None = None,
                rows: np.ndarray | None = None) -> list[Minibatch]:
    """Every optimizer step of one update, in order: ``epochs`` passes, each over
    ``minibatches`` near-equal splits of ``rows`` (default: all) ordered by that epoch's
    ``shuffle`` keys (``[B, epochs]``; the given order without them).

    Args:
      lengths: ``[B]`` columns each row uses (prompt + response so far).
      grad_accum: a group holds at most ``ceil(B / (minibatches * grad_accum))`` rows
        (``max_rows``: activation memory of one group at a time).
      unit: row counts are multiples of it (the batch axes' size on the mesh).
      cap: the widest width (the token buffer's).
    Returns ``epochs * minibatches`` minibatches (one with no rows has no groups).
    """
    b = len(lengths)
    rows = np.arange(b) if rows is None else np.asarray(rows, np.int64)
    # Group sizes come from the whole batch's minibatch size even when ``rows`` is a subset
    # (the critic's finished rows, a different count every step): one shape per width.
    max_rows = max_group_rows(b, minibatches, grad_accum)
    out = []
    for e in range(epochs):
        order = rows if shuffle is None else rows[np.argsort(shuffle[rows, e], kind="stable")]
        for part in np.array_split(order, minibatches):
            out.append(plan_minibatch(part, lengths, b, max_rows=max_rows, unit=unit, cap=cap))
    return out


def plan_cells(plan: list[Minibatch]) -> int:
    """Token cells (rows x columns, padding included) a plan's forward passes run over."""
    return sum(g.rows.size * g.width for mb in plan for g in mb.groups)
