"""Causal self-attention of the training forward, with a memory-efficient path per backend.

Layouts (the model's, so no transposes at the call site):
  q     [B, T, Hq, D]   queries (RoPE applied); ``Hq`` a multiple of ``Hkv`` (GQA)
  k, v  [B, S, Hkv, D]  keys and values; query ``i`` sits at key index ``q_offset + i``
  out   [B, T, Hq, D]   in ``q.dtype``

The mask is ``CausalMask``: query ``i`` may attend key ``j`` iff ``j <= q_offset + i`` and key
``j`` is valid (``kv_valid``: the trainer's right padding). A query with no such key (a padding
row) gets a uniform softmax over every key instead of NaNs, as ``MASK_VALUE`` gives.

``attention(q, k, v, mask, impl)`` dispatches on ``impl`` (``IMPLS``):
  "dense"    jax.numpy over the full ``[B, Hq, T, S]`` float32 scores (``gqa_attention``).
  "chunked"  blockwise online softmax over key blocks in ``lax.scan`` with a flash-style
             backward (``jax.custom_vjp``: the backward recomputes each block's scores from the
             saved softmax max and sum), so memory is ``O(B * Hq * T * block)`` in both passes. Any
             backend; equal to "dense" up to float rounding.
  "splash"   ``jax.experimental.pallas.ops.tpu.splash_attention`` (Mosaic TPU kernel; runs on
             CPU only in the Pallas interpreter, ``interpret=True``). Padding goes in as segment
             ids, so every real query sees exactly the keys "dense" gives it.
  "cudnn"    ``jax.nn.dot_product_attention(implementation="cudnn")`` (GPU, bf16/fp16, no
             query offset); padding as ``key_value_seq_lengths``, i.e. right padding only.
  "auto"     ``choice.choose_attention`` for the platform of the program's mesh
             (``choice.traced_on``: the learner's steps and the engine's prefill trace on
             theirs): splash on TPU where it can run (one device, or per shard on a project
             mesh; chunked otherwise), cudnn on GPU where it applies (chunked otherwise), and
             on CPU dense while ``T * S <= AUTO_DENSE_MAX`` (small shapes stay bit-identical
             to the dense path) and chunked beyond.
Softmax statistics are float32 in every implementation; "splash" scales q before the kernel
(the kernel applies no scale).
"""

from __future__ import annotations

import functools
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec

from tppo_jax.kernels.choice import (
    AUTO_DENSE_MAX,
    choose_attention,
    current_mesh,
    is_project_mesh,
    platform_of,
    program_mesh,
    traced_on,
)
from tppo_jax.parallel.mesh import named_sharding

# ``program_mesh`` under its former name; ``traced_on`` where the learner imports it.
attention_mesh = program_mesh
__all__ = ["AUTO_DENSE_MAX", "CausalMask", "attention", "attention_mesh", "gqa_attention",
           "kernel_mesh", "resolve_impl", "traced_on", "under_project_mesh"]

Impl = Literal["auto", "dense", "chunked", "splash", "cudnn"]
IMPLS: tuple[str, ...] = get_args(Impl)

# A large finite negative instead of -inf: a query whose keys are all masked (padding rows)
# then gets a uniform softmax instead of NaNs that would poison gradients through `where`.
MASK_VALUE = -1e30

DEFAULT_BLOCK = 512


@struct.dataclass
class CausalMask:
    """Causal mask with key padding, without the ``[B, T, S]`` array.

    Attributes:
      kv_valid: ``[B, S]`` bool, True for real keys; None = every key is real.
      q_offset: static int, the key index of query 0 (queries ``i`` sit at ``q_offset + i``).
    """

    kv_valid: jax.Array | None = None
    q_offset: int = struct.field(pytree_node=False, default=0)

    @classmethod
    def from_attention_mask(cls, attention_mask: jax.Array | None,
                            q_offset: int = 0) -> CausalMask:
        """From the trainer's ``[B, S]`` 0/1 (or bool) ``attention_mask`` (None = all real)."""
        valid = None if attention_mask is None else attention_mask.astype(bool)
        return cls(kv_valid=valid, q_offset=q_offset)

    def dense(self, b: int, t: int, s: int) -> jax.Array:
        """``[B, T, S]`` bool, True where query ``t`` may attend to key ``s``."""
        q_pos = self.q_offset + jnp.arange(t)[:, None]
        allowed = (jnp.arange(s)[None, :] <= q_pos)[None]
        if self.kv_valid is None:
            return jnp.broadcast_to(allowed, (b, t, s))
        return allowed & self.kv_valid.astype(bool)[:, None, :]


def gqa_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query scaled dot-product attention under an explicit mask, softmax in float32.

    Args:
      q: ``[B, T, Hq, D]`` queries.
      k: ``[B, S, Hkv, D]`` keys; ``Hq`` must be a multiple of ``Hkv``.
      v: ``[B, S, Hkv, D]`` values.
      mask: ``[B, T, S]`` bool, True where query t may attend to key s.

    Returns:
      ``[B, T, Hq, D]`` in ``q.dtype``.
    """
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    # Query heads h*group .. h*group+group-1 share kv head h (HF repeat_kv order).
    qg = q.reshape(b, t, hkv, group, d)
    scores = jnp.einsum(
        "btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32
    ) * (1.0 / jnp.sqrt(jnp.float32(d)))
    scores = jnp.where(mask[:, None, None, :, :], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, t, hq, d).astype(q.dtype)


def resolve_impl(impl: str, q: jax.Array, k: jax.Array, mask: CausalMask,
                 platform: str | None = None) -> str:
    """The concrete implementation ``impl`` stands for in the program being traced
    (``choice.choose_attention`` on its mesh; ``platform``: that mesh's unless given)."""
    mesh = current_mesh()
    return choose_attention(impl, platform or platform_of(mesh), mesh, q.shape[1], k.shape[1],
                            _cudnn_applies(q, mask))


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: CausalMask,
              impl: str = "auto", *, block_size: int = DEFAULT_BLOCK,
              interpret: bool = False) -> jax.Array:
    """Causal GQA attention with key padding: ``q [B, T, Hq, D]``, ``k, v [B, S, Hkv, D]`` ->
    ``[B, T, Hq, D]`` in ``q.dtype``.

    Args:
      mask: which keys each query sees (``CausalMask``); ``q_offset + T <= S``.
      impl: one of ``IMPLS`` (module docstring).
      block_size: key block of "chunked" (and block size of "splash").
      interpret: "splash" only: run the kernel in the Pallas interpreter (any backend).
    """
    b, t, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    if hq % hkv or k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"attention shapes q {q.shape}, k {k.shape}, v {v.shape}: expected "
                         "q [B, T, Hq, D], k = v [B, S, Hkv, D] with Hq % Hkv == 0")
    if mask.q_offset + t > s:
        raise ValueError(f"attention: q_offset {mask.q_offset} + {t} queries > {s} keys")
    kind = resolve_impl(impl, q, k, mask)
    if kind == "dense":
        return gqa_attention(q, k, v, mask.dense(b, t, s))
    if kind == "chunked":
        valid = (jnp.ones((b, s), bool) if mask.kv_valid is None
                 else mask.kv_valid.astype(bool))
        return _chunked(q, k, v, valid, mask.q_offset, min(block_size, s))
    if kind == "splash":
        return _splash(q, k, v, mask, block_size, interpret)
    return _cudnn(q, k, v, mask)


# ------------------------------------------------------------------------------- chunked


def _blocks(x: jax.Array, block: int, fill) -> jax.Array:
    """``[B, S, ...]`` -> ``[nb, B, block, ...]``, padded with ``fill`` to a whole block."""
    b, s = x.shape[:2]
    nb = -(-s // block)
    pad = [(0, 0), (0, nb * block - s)] + [(0, 0)] * (x.ndim - 2)
    x = jnp.pad(x, pad, constant_values=fill)
    return jnp.moveaxis(x.reshape(b, nb, block, *x.shape[2:]), 1, 0)


def _block_scores(qg, kb, valid_b, start, q_offset, s, scale):
    """Scores of one key block: ``qg [B, T, Hkv, G, D]``, ``kb [B, C, Hkv, D]``,
    ``valid_b [B, C]`` -> ``[B, Hkv, G, T, C]`` float32; masked keys get ``MASK_VALUE`` as in
    the dense path, keys past ``s`` (block padding) get -inf so they are no keys at all.
    Also returns ``allowed [B, 1, 1, T, C]``: where a score is a real one."""
    t, c = qg.shape[1], kb.shape[1]
    sc = jnp.einsum("btkgd,bckd->bkgtc", qg, kb, preferred_element_type=jnp.float32) * scale
    key = start + jnp.arange(c)
    allowed = (key[None, :] <= q_offset + jnp.arange(t)[:, None])[None] & valid_b[:, None, :]
    allowed = allowed[:, None, None]
    sc = jnp.where(allowed, sc, MASK_VALUE)
    return jnp.where((key < s)[None, None, None, None, :], sc, -jnp.inf), allowed


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _chunked(q, k, v, valid, q_offset: int, block: int):
    """``attention``'s "chunked": ``valid [B, S]`` bool; ``q_offset``, ``block`` static."""
    return _chunked_fwd(q, k, v, valid, q_offset, block)[0]


def _chunked_fwd(q, k, v, valid, q_offset, block):
    b, t, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    qg = q.reshape(b, t, hkv, g, d)
    kb, vb, validb = _blocks(k, block, 0), _blocks(v, block, 0), _blocks(valid, block, False)
    starts = jnp.arange(kb.shape[0]) * block

    def step(carry, xs):
        m, denom, acc = carry
        kj, vj, valj, start = xs
        sc, _ = _block_scores(qg, kj, valj, start, q_offset, s, scale)
        m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(sc - m_new[..., None])
        denom = denom * corr + jnp.sum(p, axis=-1)
        pv = jnp.einsum("bkgtc,bckd->bkgtd", p.astype(v.dtype), vj,
                        preferred_element_type=jnp.float32)
        return (m_new, denom, acc * corr[..., None] + pv), None

    stats = (b, hkv, g, t)
    init = (jnp.full(stats, -jnp.inf, jnp.float32), jnp.zeros(stats, jnp.float32),
            jnp.zeros((*stats, d), jnp.float32))
    (m, denom, acc), _ = jax.lax.scan(step, init, (kb, vb, validb, starts))
    out_g = acc / denom[..., None]  # [B, Hkv, G, T, D]
    out = jnp.moveaxis(out_g, 3, 1).reshape(b, t, hq, d).astype(q.dtype)
    # max and sum kept apart: in a row with every key masked, m is MASK_VALUE and
    # m + log(denom) would round back to m in float32
    return out, (q, k, v, valid, out, m, denom)


def _chunked_bwd(q_offset, block, res, dout):
    q, k, v, valid, out, m, denom = res
    b, t, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    qg = q.reshape(b, t, hkv, g, d)
    do = dout.reshape(b, t, hkv, g, d).astype(jnp.float32)
    delta = jnp.einsum("btkgd,btkgd->bkgt", do, out.reshape(b, t, hkv, g, d)
                       .astype(jnp.float32))
    kb, vb, validb = _blocks(k, block, 0), _blocks(v, block, 0), _blocks(valid, block, False)
    starts = jnp.arange(kb.shape[0]) * block

    def step(dq, xs):
        kj, vj, valj, start = xs
        sc, allowed = _block_scores(qg, kj, valj, start, q_offset, s, scale)
        p = jnp.exp(sc - m[..., None]) / denom[..., None]  # [B, Hkv, G, T, C]
        dv = jnp.einsum("bkgtc,btkgd->bckd", p, do)
        dp = jnp.einsum("btkgd,bckd->bkgtc", do, vj.astype(jnp.float32))
        # a masked score is a constant: no gradient flows into q or k through it
        ds = jnp.where(allowed, p * (dp - delta[..., None]) * scale, 0.0)
        dq = dq + jnp.einsum("bkgtc,bckd->btkgd", ds, kj.astype(jnp.float32))
        dk = jnp.einsum("bkgtc,btkgd->bckd", ds, qg.astype(jnp.float32))
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(step, jnp.zeros((b, t, hkv, g, d), jnp.float32),
                                (kb, vb, validb, starts))

    def unblock(x):  # [nb, B, C, Hkv, D] -> [B, S, Hkv, D]
        return jnp.moveaxis(x, 0, 1).reshape(b, -1, hkv, d)[:, :s]

    return (dq.reshape(b, t, hq, d).astype(q.dtype), unblock(dk).astype(k.dtype),
            unblock(dv).astype(v.dtype), None)


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


# -------------------------------------------------------------------------------- splash


def kernel_mesh() -> Any:
    """The mesh of the program being traced (``choice.traced_on``), or None."""
    return current_mesh()


def under_project_mesh() -> bool:
    """Whether tracing runs on a (data, fsdp, tensor) mesh (``choice.traced_on``)."""
    return is_project_mesh(current_mesh())


def _splash(q, k, v, mask: CausalMask, block_size: int, interpret: bool) -> jax.Array:
    """Splash attention. On a mesh with the project's axes (``kernel_mesh``) it
    runs per shard in ``shard_map`` (rows over the batch axes, heads over the head axes): the
    partitioner cannot split a Mosaic kernel by itself."""
    valid = jnp.ones(k.shape[:2], bool) if mask.kv_valid is None else mask.kv_valid.astype(bool)
    mesh = kernel_mesh()
    if not under_project_mesh() or mesh.size == 1:
        return _splash_local(q, k, v, valid, mask.q_offset, block_size, interpret)
    row = named_sharding(mesh, ("batch",), valid.shape[:1]).spec[0]
    heads = named_sharding(mesh, ("heads",), q.shape[2:3]).spec[0]
    if heads != named_sharding(mesh, ("kv_heads",), k.shape[2:3]).spec[0]:
        heads = None  # q and kv heads must split alike for each shard's GQA groups
    qkv = PartitionSpec(row, None, heads, None)
    local = functools.partial(_splash_local, q_offset=mask.q_offset, block_size=block_size,
                              interpret=interpret)
    return jax.shard_map(local, mesh=mesh, in_specs=(qkv, qkv, qkv, PartitionSpec(row, None)),
                         out_specs=qkv, check_vma=False)(q, k, v, valid)


def _splash_local(q, k, v, valid, q_offset: int, block_size: int, interpret: bool
                  ) -> jax.Array:
    """Splash attention on one shard, vmapped over rows; ``T`` and ``S`` padded to a block."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    b, t, hq, d = q.shape
    s = k.shape[1]
    block = min(block_size, max(128, -(-max(t, s) // 128) * 128))
    tp, sp = -(-t // block) * block, -(-s // block) * block
    # Every query is segment 1 and a key is 1 iff valid: a query then sees exactly its valid
    # causal keys. Block padding is segment 0 on the key side and cut from the output.
    kv_seg = jnp.pad(valid.astype(jnp.int32), ((0, 0), (0, sp - s)))
    q_seg = jnp.ones((b, tp), jnp.int32)
    heads = sa.MultiHeadMask([sa.CausalMask((tp, sp), offset=q_offset)] * hq)
    sizes = sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                          block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                          block_q_dq=block, block_kv_dq=block)
    kernel = sa.make_splash_mha(heads, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                mask_value=MASK_VALUE, interpret=interpret)
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    qh = jnp.pad((q.astype(jnp.float32) * scale).astype(q.dtype),
                 ((0, 0), (0, tp - t), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    kh = jnp.pad(k, ((0, 0), (0, sp - s), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    vh = jnp.pad(v, ((0, 0), (0, sp - s), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    out = jax.vmap(lambda qq, kk, vv, qs, ks: kernel(qq, kk, vv, segment_ids=sa.SegmentIds(
        q=qs, kv=ks)))(qh, kh, vh, q_seg, kv_seg)
    return out.transpose(0, 2, 1, 3)[:, :t].astype(q.dtype)


# --------------------------------------------------------------------------------- cudnn


def _cudnn_applies(q: jax.Array, mask: CausalMask) -> bool:
    return q.dtype in (jnp.bfloat16, jnp.float16) and mask.q_offset == 0


def _cudnn(q, k, v, mask: CausalMask) -> jax.Array:
    """cuDNN flash attention; right padding as per-row key lengths."""
    if not _cudnn_applies(q, mask):
        raise ValueError(f"attention impl 'cudnn' needs bf16/fp16 inputs and no query offset "
                         f"(got {q.dtype}, q_offset={mask.q_offset}); use 'chunked'")
    lengths = None
    if mask.kv_valid is not None:
        lengths = jnp.sum(mask.kv_valid.astype(jnp.int32), axis=1)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, key_value_seq_lengths=lengths,
                                        implementation="cudnn")
