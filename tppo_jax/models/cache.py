"""Attention core and the KV-cache interface the decoder talks to.

The decoder never touches cache storage itself: during cached decoding each attention layer
hands its freshly projected (and RoPE-rotated) ``q, k, v`` to
``cache.update_and_attend(layer_idx, q, k, v, positions, valid)``, which stores ``k, v`` and
returns the attention output. The layers run as one ``lax.scan`` with the cache in its carry,
so ``layer_idx`` is a traced int32 scalar: storage is stacked ``[L, ...]`` and a layer's
write is an in-place scatter at its index. That one method is the whole contract, so the
rollout engine can swap ``DenseKVCache`` for a paged cache without changing the model.

Caches are pytrees (``flax.struct`` dataclasses) so a whole decode step jits, and every
method is functional: it returns a new cache instead of mutating.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from tppo_jax.kernels.attention import MASK_VALUE, gqa_attention
from tppo_jax.parallel.mesh import named_sharding


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """``gqa_attention`` for one query per row, reading the cache in its stored layout.

    A dot_general over ``[B, S, Hkv, D]`` has its batch axis (kv head) between S and D, so
    XLA transposes the whole layer's cache into a dot-friendly copy every step (seen in the
    optimized HLO on CPU). With one query per row the products are matrix-vector work that
    is bound by reading K and V, so multiply-and-reduce fusions that stream K and V once in
    place are the roofline form.

    Args: q ``[B, 1, Hq, D]``, k/v ``[B, S, Hkv, D]``, mask ``[B, 1, S]``.
    Returns: ``[B, 1, Hq, D]`` in ``q.dtype``.
    """
    b, _, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, 1, hkv, hq // hkv, d).astype(jnp.float32) * (1.0 / jnp.sqrt(d))
    scores = jnp.sum(qg * k.astype(jnp.float32)[:, :, :, None, :], axis=-1)  # [B, S, Hkv, G]
    scores = jnp.where(mask[:, 0, :, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=1)
    out = jnp.sum(probs[..., None] * v.astype(jnp.float32)[:, :, :, None, :], axis=1)
    return out.reshape(b, 1, hq, d).astype(q.dtype)


@runtime_checkable
class KVCache(Protocol):
    """What ``Transformer.forward_with_cache`` needs from a cache (dense or paged)."""

    def update_and_attend(
        self,
        layer_idx: jax.Array | int,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        positions: jax.Array,
        valid: jax.Array,
    ) -> tuple[jax.Array, KVCache]:
        """Stores this step's keys/values for layer ``layer_idx`` and attends.

        Args:
          layer_idx: the decoder layer, an int32 scalar (traced under the layer scan).
          q: ``[B, T, Hq, D]`` RoPE-rotated queries of the new tokens.
          k: ``[B, T, Hkv, D]`` RoPE-rotated keys of the new tokens.
          v: ``[B, T, Hkv, D]`` values of the new tokens.
          positions: ``[B, T]`` int32 absolute position of each new token in its sequence.
          valid: ``[B, T]`` bool; False tokens are neither stored nor meaningful as outputs.

        Returns:
          ``(out [B, T, Hq, D], new_cache)``: each query attends to every cached position
          ``<=`` its own (including the tokens written in this call).
        """
        ...

    def write(self, layer_idx: jax.Array | int, k: jax.Array, v: jax.Array,
              positions: jax.Array, valid: jax.Array) -> KVCache:
        """Stores keys/values ``[B, T, Hkv, D]`` for layer ``layer_idx`` without attending
        (a prefill from position 0 attends over its own tokens, not the cache)."""
        ...


@struct.dataclass
class DenseKVCache:
    """Contiguous per-sequence cache: slot ``s`` of row ``b`` holds position ``s``.

    Attributes:
      k: ``[L, B, S_max, Hkv, D]`` cached keys (RoPE already applied).
      v: ``[L, B, S_max, Hkv, D]`` cached values.
      lengths: ``[B]`` int32, one past the highest position written so far.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    # Logical axes per field, for sharding the cache with `parallel.mesh.named_sharding`.
    LOGICAL_AXES = ("layers", "batch", "seq", "kv_heads", "head_dim")

    @classmethod
    def init(
        cls,
        num_layers: int,
        batch: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: jnp.dtype = jnp.float32,
    ) -> DenseKVCache:
        """An empty cache able to hold ``max_len`` positions per row."""
        shape = (num_layers, batch, max_len, num_kv_heads, head_dim)
        return cls(
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
            lengths=jnp.zeros((batch,), jnp.int32),
        )

    @classmethod
    def init_on_mesh(cls, mesh: Mesh, num_layers: int, batch: int, max_len: int,
                     num_kv_heads: int, head_dim: int,
                     dtype: jnp.dtype = jnp.float32) -> DenseKVCache:
        """``init`` with every device allocating only its own shard (jit ``out_shardings``):
        the whole cache never sits on one device, and each host builds only its part."""
        shape = (num_layers, batch, max_len, num_kv_heads, head_dim)
        make = jax.jit(lambda: cls.init(num_layers, batch, max_len, num_kv_heads, head_dim,
                                        dtype), out_shardings=cls.layout(mesh, shape))
        return make()

    @classmethod
    def layout(cls, mesh: Mesh, shape: tuple[int, ...]) -> DenseKVCache:
        """The ``NamedSharding`` of each field for a cache of ``[L, B, S, kv_heads, head_dim]``
        on ``mesh``: rows over the batch axes, heads over ``tensor``."""
        kv = named_sharding(mesh, cls.LOGICAL_AXES, shape)
        return cls(kv, kv, named_sharding(mesh, ("batch",), (shape[1],)))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def update_and_attend(
        self,
        layer_idx: jax.Array | int,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        positions: jax.Array,
        valid: jax.Array,
    ) -> tuple[jax.Array, DenseKVCache]:
        """See ``KVCache.update_and_attend``."""
        positions = positions.astype(jnp.int32)
        new = self.write(layer_idx, k, v, positions, valid)
        layer_k, layer_v = new.k[layer_idx], new.v[layer_idx]
        # Slots <= the query position were all written by this sequence (prefix is contiguous),
        # so stale data from an earlier occupant of the row beyond that is never read.
        mask = jnp.arange(self.max_len)[None, None, :] <= positions[:, :, None]
        if q.shape[1] == 1:
            out = decode_attention(q, layer_k, layer_v, mask)
        else:
            out = gqa_attention(q, layer_k.astype(q.dtype), layer_v.astype(q.dtype), mask)
        return out, new

    def write(self, layer_idx: jax.Array | int, k: jax.Array, v: jax.Array,
              positions: jax.Array, valid: jax.Array) -> DenseKVCache:
        """See ``KVCache.write``."""
        s_max = self.max_len
        positions = positions.astype(jnp.int32)
        valid = valid.astype(bool)
        # Invalid tokens are routed to an out-of-range slot and dropped by the scatter, so
        # padding never overwrites cached entries of the real sequence.
        slot = jnp.where(valid, positions, s_max)
        rows = jnp.broadcast_to(jnp.arange(k.shape[0])[:, None], slot.shape)
        new_k = self.k.at[layer_idx, rows, slot].set(k.astype(self.k.dtype), mode="drop")
        new_v = self.v.at[layer_idx, rows, slot].set(v.astype(self.v.dtype), mode="drop")
        top = jnp.max(jnp.where(valid, positions + 1, 0), axis=1)
        return self.replace(k=new_k, v=new_v, lengths=jnp.maximum(self.lengths, top))

    def shard(self, mesh: Mesh) -> DenseKVCache:
        """Places k/v per ``LOGICAL_AXES`` (batch over data/fsdp, kv heads over tensor)."""
        kv = named_sharding(mesh, self.LOGICAL_AXES, self.k.shape)
        return self.replace(
            k=jax.device_put(self.k, kv),
            v=jax.device_put(self.v, kv),
            lengths=jax.device_put(self.lengths, named_sharding(mesh, ("batch",),
                                                                self.lengths.shape)),
        )

    def reset_rows(self, rows: jax.Array) -> DenseKVCache:
        """Frees rows (``[B]`` bool): their length goes back to 0 (storage is reused as is)."""
        return self.replace(lengths=jnp.where(rows, 0, self.lengths))
