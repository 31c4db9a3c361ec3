"""Paged attention over the KV pool of `tppo_jax.rollout.pages`.

Layouts (identical to the Pallas kernels jax ships, so no transposes on the hot path):
  q            [B, Hq, D]                 one decode query per sequence (GQA: Hq % Hkv == 0)
  k/v_pages    [Hkv, N, page_size, D]     the page pool
  lengths      [B] int32                  tokens visible to each query (cache incl. current)
  page_table   [B, max_pages] int32       pages of each sequence, in order (-1 allowed = none)

`paged_attention` dispatches on `impl`:
  "reference"   jax.numpy: gather pages, mask beyond length, fp32 softmax (any backend).
  "pallas_tpu"  jax.experimental.pallas.ops.tpu.paged_attention (Mosaic TPU kernel).
  "pallas_gpu"  jax.experimental.pallas.ops.gpu.paged_attention (Triton; shipped in jax 0.10.2).
  "pallas"      the Pallas kernel for jax.default_backend(); error on CPU unless interpret=True
                (then the TPU kernel runs in the Pallas TPU interpreter).
  "auto"        "pallas" on TPU/GPU, "reference" elsewhere.
Neither shipped kernel applies a softmax scale, so q is pre-multiplied by `scale` here.
Precision: the TPU kernel casts K/V to bf16 inside (fp32 softmax), so it matches the fp32
reference only to bf16 accuracy; the GPU kernel keeps the input dtype.

`paged_attention_prefill` (reference only) attends T new queries per sequence causally over the
cache; the new tokens' K/V must already be written with `pages.write_kv`.
"""

from __future__ import annotations

import contextlib
from typing import Literal

import jax
import jax.numpy as jnp

Array = jax.Array
Impl = Literal["auto", "reference", "pallas", "pallas_tpu", "pallas_gpu"]
_MASK = -1e30  # finite so an all-masked row gives zeros, not NaN


def _gather_pages(pages: Array, page_table: Array) -> Array:
    """[Hkv, N, ps, D] x [B, M] -> [B, Hkv, M*ps, D] (dense view of each sequence's cache)."""
    hkv, _, ps, d = pages.shape
    b, m = page_table.shape
    g = pages[:, jnp.maximum(page_table, 0)]  # [Hkv, B, M, ps, D]; -1 -> page 0, masked later
    return jnp.moveaxis(g.reshape(hkv, b, m * ps, d), 0, 1)


def _attend(q: Array, k: Array, v: Array, visible: Array, scale: float) -> Array:
    """GQA attention in fp32.

    q [B, Tq, Hq, D], k/v [B, Hkv, S, D], visible [B, Tq, S] bool -> [B, Tq, Hq, D] (q.dtype).
    """
    b, tq, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, tq, hkv, hq // hkv, d).astype(jnp.float32) * scale
    logits = jnp.einsum("bthgd,bhsd->bthgs", qg, k.astype(jnp.float32))
    mask = visible[:, :, None, None, :]
    logits = jnp.where(mask, logits, _MASK)
    p = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    p = jnp.where(mask, p, 0.0)  # rows with nothing visible -> all zeros, not uniform
    denom = jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    out = jnp.einsum("bthgs,bhsd->bthgd", p / denom, v.astype(jnp.float32))
    return out.reshape(b, tq, hq, d).astype(q.dtype)


def paged_attention_reference(
    q: Array,
    k_pages: Array,
    v_pages: Array,
    lengths: Array,
    page_table: Array,
    *,
    scale: float | None = None,
) -> Array:
    """Decode attention, pure jnp. Shapes: module docstring. Returns [B, Hq, D]."""
    d = q.shape[-1]
    scale = d**-0.5 if scale is None else scale
    k = _gather_pages(k_pages, page_table)
    v = _gather_pages(v_pages, page_table)
    visible = jnp.arange(k.shape[2])[None, None, :] < lengths[:, None, None]
    return _attend(q[:, None], k, v, visible, scale)[:, 0]


def paged_attention_prefill(
    q: Array,
    k_pages: Array,
    v_pages: Array,
    lengths: Array,
    page_table: Array,
    q_positions: Array,
    *,
    scale: float | None = None,
) -> Array:
    """Multi-token (prefill / chunked decode) attention against the cache, pure jnp.

    Args:
      q: [B, T, Hq, D] queries of the new tokens.
      k_pages, v_pages: [Hkv, N, page_size, D] pool, already holding the new tokens' K/V.
      lengths: [B] int32 tokens in the cache (prefix + new).
      page_table: [B, max_pages] int32.
      q_positions: [B, T] int32 absolute position of each query; negative = padding.
    Returns:
      [B, T, Hq, D]; query t sees key positions s with s <= q_positions[t] and s < lengths.
      Padding queries return zeros.
    """
    d = q.shape[-1]
    scale = d**-0.5 if scale is None else scale
    k = _gather_pages(k_pages, page_table)
    v = _gather_pages(v_pages, page_table)
    s = jnp.arange(k.shape[2])[None, None, :]
    visible = (s <= q_positions[:, :, None]) & (s < lengths[:, None, None])
    return _attend(q, k, v, visible, scale)


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(x for x in range(1, min(n, cap) + 1) if n % x == 0)


def _pallas_tpu(q, k_pages, v_pages, lengths, page_table, interpret: bool) -> Array:
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as kernel

    # The kernel needs pages_per_sequence % pages_per_compute_block == 0.
    ppcb = _largest_divisor_at_most(page_table.shape[1], 8)
    ctx = pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext()
    with ctx:
        return kernel(q, k_pages, v_pages, lengths, page_table, pages_per_compute_block=ppcb)


def _pallas_gpu(q, k_pages, v_pages, lengths, page_table, interpret: bool) -> Array:
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as kernel

    # k_splits must divide pages_per_sequence, and pages_per_compute_block the partition.
    m = page_table.shape[1]
    k_splits = _largest_divisor_at_most(m, 16)
    ppcb = _largest_divisor_at_most(m // k_splits, 8)
    return kernel(
        q,
        k_pages,
        v_pages,
        page_table,
        lengths,
        k_splits=k_splits,
        pages_per_compute_block=ppcb,
        interpret=interpret,
    )


def resolve_impl(impl: Impl, interpret: bool = False) -> str:
    """Map "auto"/"pallas" to a concrete implementation for the current backend."""
    backend = jax.default_backend()
    if impl == "auto":
        impl = "pallas" if backend in ("tpu", "gpu") else "reference"
    if impl == "pallas":
        if backend == "tpu":
            return "pallas_tpu"
        if backend == "gpu":
            return "pallas_gpu"
        if interpret:
            return "pallas_tpu"
        raise ValueError(
            f"no Pallas paged-attention kernel for backend {backend!r}; "
            "use impl='reference' or interpret=True"
        )
    if impl not in ("reference", "pallas_tpu", "pallas_gpu"):
        raise ValueError(f"unknown impl {impl!r}")
    return impl


def paged_attention(
    q: Array,
    k_pages: Array,
    v_pages: Array,
    lengths: Array,
    page_table: Array,
    *,
    scale: float | None = None,
    impl: Impl = "auto",
    interpret: bool = False,
) -> Array:
    """Decode attention of one query per sequence over its paged cache.

    Args:
      q: [B, Hq, D]; k_pages, v_pages: [Hkv, N, page_size, D]; lengths: [B] int32;
      page_table: [B, max_pages] int32 (-1 entries are treated as page 0 and must lie beyond
      `lengths`). scale: softmax scale, default D**-0.5. impl / interpret: see module docstring.
    Returns:
      [B, Hq, D] in q.dtype; rows with length 0 are zeros.
    """
    impl = resolve_impl(impl, interpret)
    if impl == "reference":
        return paged_attention_reference(q, k_pages, v_pages, lengths, page_table, scale=scale)
    d = q.shape[-1]
    scale = d**-0.5 if scale is None else scale
    # Kernels take no scale: fold it into q (in fp32, then back to the input dtype).
    qs = (q.astype(jnp.float32) * scale).astype(q.dtype)
    lengths = lengths.astype(jnp.int32)
    table = jnp.maximum(page_table, 0).astype(jnp.int32)
    fn = _pallas_tpu if impl == "pallas_tpu" else _pallas_gpu
    out = fn(qs, k_pages, v_pages, lengths, table, interpret)
    # Kernels' behaviour at length 0 is unspecified; pin it to zeros like the reference.
    return jnp.where((lengths > 0)[:, None, None], out, 0).astype(q.dtype)
