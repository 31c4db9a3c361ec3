"""Paged attention over the KV pool of `tppo_jax.rollout.pages`.

Layouts (identical to the Pallas kernels jax ships, so no transposes on the hot path):
  q            [B, Hq, D]                 one decode query per sequence (GQA: Hq % Hkv == 0)
  k/v_pages    [Hkv, N, page_size, D]     the page pool
  lengths      [B] int32                  tokens visible to each query (cache incl. current)
  page_table   [B, max_pages] int32       pages of each sequence, in order (-1 allowed = none)

`paged_attention` dispatches on `impl`:
  "reference"   jax.numpy: gather pages, mask beyond length, fp32 softmax (any backend).
  "pallas_tpu"  jax.experimental.pallas.ops.tpu.paged_attention (Mosaic TPU kernel), with each
                KV group's query heads zero-padded to a multiple of 8 (the kernel's query block
                is [G, D] and Mosaic needs G % 8 == 0: Qwen's groups are 7, 6, 5) and one call
                per slot chunk whose page table fits SMEM (``slot_chunks``).
  "pallas_gpu"  jax.experimental.pallas.ops.gpu.paged_attention (Triton; shipped in jax 0.10.2).
  "pallas"      the Pallas kernel for the program's platform (``kernels.choice``); error on CPU
                unless interpret=True (then the TPU kernel runs in the Pallas TPU interpreter).
  "auto"        "pallas" on TPU/GPU, "reference" elsewhere.
The platform is the program's (``kernels.choice.current_platform``: its mesh's devices),
never the tracing machine's; on a mesh of several devices the kernel runs per shard
(``mesh=``), as Mosaic kernels cannot be partitioned.
Neither shipped kernel applies a softmax scale, so q is pre-multiplied by `scale` here.
Precision: the TPU kernel casts K/V to bf16 inside (fp32 softmax), so it matches the fp32
reference only to bf16 accuracy; the GPU kernel keeps the input dtype.

`paged_attention_prefill` (reference only) attends T new queries per sequence causally over the
cache; the new tokens' K/V must already be written with `pages.write_kv`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

from tppo_jax.kernels.choice import choose_paged, current_platform

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


# Bytes of page table one TPU kernel call scalar-prefetches into SMEM (1 MiB per core,
# shared with the lengths and the kernel's own scalars): the batch is cut into slot chunks
# whose tables fit.
SMEM_TABLE_BYTES = 512 * 1024
# The kernel's query block is one KV group's query heads [G, D]: Mosaic needs G % 8 == 0.
GROUP_MULTIPLE = 8


def slot_chunks(batch: int, pages_per_slot: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]``: even slot chunks whose ``[chunk, pages_per_slot]`` int32
    page table fits ``SMEM_TABLE_BYTES``."""
    most = max(1, SMEM_TABLE_BYTES // (4 * pages_per_slot))
    n = -(-batch // most)
    size = -(-batch // n)
    return [(i, min(i + size, batch)) for i in range(0, batch, size)]


def _tpu_kernel_call(q: Array, k_pages: Array, v_pages: Array, lengths: Array,
                     page_table: Array, ppcb: int) -> Array:
    """One ``pallas_call`` of the body of jax's TPU paged-attention kernel
    (``paged_flash_attention_kernel_inline_seq_dim``; no quantization, no megacore) with
    ``q [B, Hkv * G, D]``, ``G % 8 == 0``. jax's own wrapper blocks the softmax statistics
    ``[B, Hq, 1]`` as ``[G, D]``, which Mosaic refuses unless ``D % 128 == 0``; here they are
    blocked ``[G, 1]`` (the kernel broadcasts them along D)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention_kernel as pak

    b, hq, d = q.shape
    hkv, _, page_size, _ = k_pages.shape
    g = hq // hkv
    m = page_table.shape[1]
    q_spec = pl.BlockSpec((None, g, d), lambda core, i, h, *_: (i, h, 0))
    stat_spec = pl.BlockSpec((None, g, 1), lambda core, i, h, *_: (i, h, 0))
    buf = lambda x: pltpu.VMEM((2, ppcb, page_size, d), x.dtype)  # noqa: E731 (double buffer)
    kernel = functools.partial(
        pak.paged_flash_attention_kernel_inline_seq_dim, pages_per_sequence=m, batch_size=b,
        pages_per_compute_block=ppcb, mask_value=pak.DEFAULT_MASK_VALUE,
        attn_logits_soft_cap=None, megacore_mode=None)
    out, _, _ = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,  # lengths, page table, buffer index, init flag
            in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY), None,
                      pl.BlockSpec(memory_space=pl.ANY), None],
            out_specs=[q_spec, stat_spec, stat_spec],
            grid=(1, b, hkv),
            scratch_shapes=(buf(k_pages), None, buf(v_pages), None,
                            pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA((2,)))),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((b, hq, 1), jnp.float32),
                   jax.ShapeDtypeStruct((b, hq, 1), jnp.float32)],
        name="tppo_paged_attention",
    )(lengths, page_table.reshape(-1), jnp.zeros((1,), jnp.int32), jnp.ones((1,), jnp.int32),
      q, k_pages, None, v_pages, None)
    return out


def _pallas_tpu(q, k_pages, v_pages, lengths, page_table, interpret: bool) -> Array:
    """The TPU paged-attention kernel on one shard: each KV group's query heads padded to a
    multiple of 8 (zero queries, cut from the output), one call per slot chunk."""
    from jax.experimental.pallas import tpu as pltpu

    b, hq, d = q.shape
    hkv = k_pages.shape[0]
    g = hq // hkv
    gp = -(-g // GROUP_MULTIPLE) * GROUP_MULTIPLE
    qp = jnp.pad(q.reshape(b, hkv, g, d), ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    # Mosaic multiplies like dtypes only: q in the pool's (the output goes back to q's)
    qp = qp.reshape(b, hkv * gp, d).astype(k_pages.dtype)
    # The kernel needs pages_per_sequence % pages_per_compute_block == 0.
    ppcb = _largest_divisor_at_most(page_table.shape[1], 8)
    ctx = pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext()
    # The kernel's matmuls at the TPU's native precision: Mosaic cannot emulate an fp32
    # ("highest") contraction of these tiles (a caller's global setting must not reach it).
    with ctx, jax.default_matmul_precision("default"):
        outs = [_tpu_kernel_call(qp[lo:hi], k_pages, v_pages, lengths[lo:hi],
                                 page_table[lo:hi], ppcb)
                for lo, hi in slot_chunks(b, page_table.shape[1])]
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
    return out.reshape(b, hkv, gp, d)[:, :, :g].reshape(b, hq, d).astype(q.dtype)


def _per_shard(fn: Callable, mesh: Any, q: Array, k_pages: Array, v_pages: Array,
               lengths: Array, page_table: Array) -> Array:
    """``fn`` (a Mosaic kernel, which the partitioner cannot split) run per shard of ``mesh``
    in ``shard_map``: slots over the batch axes, KV heads (with their query heads) over the
    head axes when both head counts divide; the pool's pages whole on every shard."""
    from jax.sharding import PartitionSpec as P

    from tppo_jax.parallel.mesh import named_sharding

    row = named_sharding(mesh, ("batch",), q.shape[:1]).spec[0]
    heads = named_sharding(mesh, ("heads",), q.shape[1:2]).spec[0]
    if heads != named_sharding(mesh, ("kv_heads",), k_pages.shape[:1]).spec[0]:
        heads = None  # q and kv heads must split alike for each shard's GQA groups
    return jax.shard_map(fn, mesh=mesh,
                         in_specs=(P(row, heads, None), P(heads, None, None, None),
                                   P(heads, None, None, None), P(row), P(row, None)),
                         out_specs=P(row, heads, None), check_vma=False)(
        q, k_pages, v_pages, lengths, page_table)


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


def resolve_impl(impl: Impl, interpret: bool = False, platform: str | None = None) -> str:
    """The concrete implementation ``impl`` stands for in the program being traced
    (``choice.choose_paged`` for its mesh's platform, or ``platform``)."""
    return choose_paged(impl, platform or current_platform(), interpret)


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
    mesh: Any = None,
) -> Array:
    """Decode attention of one query per sequence over its paged cache.

    Args:
      q: [B, Hq, D]; k_pages, v_pages: [Hkv, N, page_size, D]; lengths: [B] int32;
      page_table: [B, max_pages] int32 (-1 entries are treated as page 0 and must lie beyond
      `lengths`). scale: softmax scale, default D**-0.5. impl / interpret: see module docstring.
      mesh: the program's mesh when the call is not already per shard (a pool that is not
        split): a Pallas kernel then runs per shard in ``shard_map`` over it.
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
    fn = functools.partial(_pallas_tpu if impl == "pallas_tpu" else _pallas_gpu,
                           interpret=interpret)
    if mesh is not None and mesh.size > 1:
        out = _per_shard(fn, mesh, qs, k_pages, v_pages, lengths, table)
    else:
        out = fn(qs, k_pages, v_pages, lengths, table)
    # Kernels' behaviour at length 0 is unspecified; pin it to zeros like the reference.
    return jnp.where((lengths > 0)[:, None, None], out, 0).astype(q.dtype)
