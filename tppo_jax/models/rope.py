"""Rotary position embeddings (RoPE): the inverse frequencies, HF ``rope_scaling`` applied
(``linear``, ``llama3``), and the rotation of queries and keys (HF rotate-half layout), in
float32 whatever the model's dtype."""

from __future__ import annotations

import math
from typing import Any, Protocol

import jax
import jax.numpy as jnp


class RopeSpec(Protocol):
    """What RoPE reads of a model's config (``transformer.ModelConfig``)."""

    @property
    def head_dim(self) -> int: ...

    @property
    def rope_theta(self) -> float: ...

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None: ...


def rope_inv_freq(cfg: RopeSpec) -> jax.Array:
    """``[D/2]`` float32 inverse frequencies, with HF-style ``rope_scaling`` applied."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    sc = cfg.rope_scaling_dict
    kind = None if sc is None else sc.get("rope_type", sc.get("type", "default"))
    if kind in (None, "default"):
        return inv
    factor = float(sc["factor"])
    if kind == "linear":
        # Linear interpolation divides positions by `factor`; same as dividing frequencies.
        return inv / factor
    if kind == "llama3":
        low = float(sc.get("low_freq_factor", 1.0))
        high = float(sc.get("high_freq_factor", 4.0))
        old_ctx = float(sc.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        # Long wavelengths are interpolated by `factor`, short ones kept, the band between
        # blended linearly in 1/wavelength (Llama 3.1 recipe).
        scaled = jnp.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return jnp.where(medium, blended, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: linear, llama3")


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates ``x [B, T, N, D]`` by ``positions [B, T]`` (HF rotate-half layout)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
