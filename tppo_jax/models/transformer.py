"""Decoder-only transformer (Qwen2 / Llama family) in Flax NNX.

Layout conventions (JAX side; ``hf.py`` converts to/from HF's ``[out, in]``):

- embedding ``[V, H]``; lm head ``[H, V]`` (absent when embeddings are tied);
- q ``[H, Hq, D]``, k/v ``[H, Hkv, D]``, o ``[Hq, D, H]``; biases ``[Hq|Hkv, D]``;
- gate/up ``[H, I]``, down ``[I, H]``; norm scales ``[H]``.

Decoder layers are stacked: ``Backbone.layers`` is one ``DecoderLayer`` whose every parameter
has a leading ``[L]`` axis (logical axis ``layers``), e.g. q ``[L, H, Hq, D]``. Every forward
(training, prefill, decode) runs one ``jax.lax.scan`` over that axis, so a program holds one
layer's HLO whatever the depth (compile time and HLO size do not grow with ``L``);
``ModelConfig.unroll_layers`` unrolls it for XLA cost analysis, which counts a loop body once.

Every parameter is an ``nnx.Param`` whose ``out_sharding`` metadata holds *logical* axis names
from ``parallel.mesh.LOGICAL_RULES``; ``shard_model`` / ``create_model`` turn them into
NamedShardings. Eager sharding is off so building a model never needs a mesh.

Precision: params and activations use ``config.dtype``; RMSNorm statistics, RoPE
(``rope.py``), attention softmax and logits are float32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from tppo_jax.kernels.attention import (
    IMPLS,
    CausalMask,
    attention,
    kernel_mesh,
    under_project_mesh,
)
from tppo_jax.models.cache import DenseKVCache, KVCache
from tppo_jax.models.rope import apply_rope, rope_inv_freq
from tppo_jax.parallel.mesh import named_sharding

# ModelConfig.remat_policy -> jax.checkpoint policy (None = save nothing but the inputs).
REMAT_POLICIES = {"full": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}

# Every weight projection: name -> (the DecoderLayer attribute that owns it, its einsum
# "activations,weight->out"). ``project`` runs them; ``models/lora.py`` derives each LoRA
# adapter's shapes and einsums from the same strings.
PROJECTIONS: dict[str, tuple[str, str]] = {
    "q": ("attn", "bth,hnd->btnd"), "k": ("attn", "bth,hnd->btnd"),
    "v": ("attn", "bth,hnd->btnd"), "o": ("attn", "btnd,ndh->bth"),
    "gate": ("mlp", "bth,hi->bti"), "up": ("mlp", "bth,hi->bti"), "down": ("mlp", "bti,ih->bth"),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters (names follow HF ``config.json`` where they exist)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | tuple[tuple[str, Any], ...] | None = None
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    tie_embeddings: bool = False
    max_position_embeddings: int = 4096
    dtype: str = "float32"
    # Training-time option, not part of the HF config: recompute each decoder layer in the
    # backward pass (activation memory O(layers * B*T*H) instead of all intermediates).
    remat: bool = False
    # What a rematerialised layer keeps from its forward pass (only with remat=True):
    # "full" keeps only the layer input (recompute everything: ~8N FLOPs per token instead
    # of 6N); "dots" also keeps the outputs of the weight matmuls (jax's
    # dots_with_no_batch_dims_saveable: the backward recomputes only norms, activations and
    # attention, for O(layers * B*T*(4H + 2I)) more activation memory).
    remat_policy: str = "full"
    # Training-forward attention (``kernels/attention.py``): "auto" = splash on TPU, cuDNN on
    # GPU, dense on CPU for short sequences and chunked beyond. Cached decoding is unaffected.
    attention: str = "auto"
    # Unroll the scan over the stacked layers (one HLO copy per layer): same values, same
    # params; only for XLA cost analysis (``compiled.cost_analysis()`` counts a while-loop
    # body once, so a scanned model reports one layer's FLOPs and bytes).
    unroll_layers: bool = False

    def __post_init__(self) -> None:
        # Stored as sorted item tuples so the config is hashable (NNX keeps it as static
        # graph metadata, and jit caches on it); `rope_scaling_dict` gives the dict back.
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"remat_policy={self.remat_policy!r}; expected one of "
                             f"{sorted(REMAT_POLICIES)}")
        if self.attention not in IMPLS:
            raise ValueError(f"attention={self.attention!r}; expected one of {', '.join(IMPLS)}")

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @classmethod
    def tiny(cls, vocab_size: int = 128, **overrides: Any) -> ModelConfig:
        """~0.8M-parameter preset for CPU tests and the embedded default run."""
        base: dict[str, Any] = dict(
            vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_layers=4,
            num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-6,
            qkv_bias=True, tie_embeddings=True, max_position_embeddings=2048,
        )
        base.update(overrides)
        return cls(**base)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...],
           dtype: jnp.dtype, init: str = "normal") -> nnx.Param:
    """A Param carrying logical axes; ``init`` is 'normal' (std 0.02, HF default), 'ones' or
    'zeros'."""
    if init == "normal":
        value = (0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    elif init == "ones":
        value = jnp.ones(shape, dtype)
    else:
        value = jnp.zeros(shape, dtype)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def project(module: nnx.Module, name: str, x: jax.Array) -> jax.Array:
    """``x`` through ``module``'s weight ``name`` (einsum ``PROJECTIONS[name]``), plus the
    weight's LoRA update when ``module.lora`` holds an adapter for it (``models/lora.py``).
    Every forward (training, prefill, decode) goes through here, so adapters apply to all."""
    y = jnp.einsum(PROJECTIONS[name][1], x, getattr(module, name)[...])
    adapters = module.lora
    if adapters is not None and name in adapters:
        y = y + adapters[name](x).astype(y.dtype)
    return y


class RMSNorm(nnx.Module):
    """``x * rsqrt(mean(x^2) + eps) * scale``, statistics in float32."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype, *, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = _param(rngs, (dim,), ("norm",), dtype, "ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        # HF casts back to the activation dtype before scaling; match it for bf16 parity.
        return self.scale[...] * xf.astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE and optional q/k/v bias."""

    lora: nnx.Dict | None = None  # name -> LoRA adapter, set by models/lora.add_lora

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        h, hq, hkv, d, dt = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                             cfg.jnp_dtype)
        self.q = _param(rngs, (h, hq, d), ("embed", "heads", "head_dim"), dt)
        self.k = _param(rngs, (h, hkv, d), ("embed", "kv_heads", "head_dim"), dt)
        self.v = _param(rngs, (h, hkv, d), ("embed", "kv_heads", "head_dim"), dt)
        self.o = _param(rngs, (hq, d, h), ("heads", "head_dim", "embed"), dt)
        self.qkv_bias = cfg.qkv_bias
        self.impl = cfg.attention
        if cfg.qkv_bias:
            self.q_bias = _param(rngs, (hq, d), ("heads", "head_dim"), dt, "zeros")
            self.k_bias = _param(rngs, (hkv, d), ("kv_heads", "head_dim"), dt, "zeros")
            self.v_bias = _param(rngs, (hkv, d), ("kv_heads", "head_dim"), dt, "zeros")

    def _qkv(self, x: jax.Array, positions: jax.Array, inv_freq: jax.Array):
        q, k, v = project(self, "q", x), project(self, "k", x), project(self, "v", x)
        if self.qkv_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def __call__(self, x: jax.Array, positions: jax.Array, mask: CausalMask,
                 inv_freq: jax.Array) -> jax.Array:
        """``x [B, T, H]`` -> ``[B, T, H]``; ``mask`` over the T keys."""
        q, k, v = self._qkv(x, positions, inv_freq)
        return project(self, "o", attention(q, k, v, mask, self.impl))

    def with_cache(self, x: jax.Array, positions: jax.Array, valid: jax.Array,
                   inv_freq: jax.Array, cache: KVCache, layer_idx: jax.Array,
                   prefill: bool = False):
        """Cached variant: the cache stores k/v and does the attention (``layer_idx``: this
        layer's index into the cache's stacked ``[L, ...]`` storage, an int32 scalar).
        ``prefill`` (static): the tokens start at position 0, so they attend over
        themselves with the training attention (``impl``: splash on TPU) and the cache only
        stores their k/v: no ``[B, T, max_len]`` scores over the cache's full length."""
        q, k, v = self._qkv(x, positions, inv_freq)
        if prefill:
            # the kernel is chosen for the program's mesh (``kernels.choice.traced_on``: the
            # engine traces its prefill on it), as the learner's steps choose theirs
            out = attention(q, k, v, CausalMask.from_attention_mask(valid), self.impl)
            return project(self, "o", out), cache.write(layer_idx, k, v, positions, valid)
        out, cache = cache.update_and_attend(layer_idx, q, k, v, positions, valid)
        return project(self, "o", out), cache


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate x) * up x)``."""

    lora: nnx.Dict | None = None  # name -> LoRA adapter, set by models/lora.add_lora

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        h, i, dt = cfg.hidden_size, cfg.intermediate_size, cfg.jnp_dtype
        self.gate = _param(rngs, (h, i), ("embed", "mlp"), dt)
        self.up = _param(rngs, (h, i), ("embed", "mlp"), dt)
        self.down = _param(rngs, (i, h), ("mlp", "embed"), dt)

    def __call__(self, x: jax.Array) -> jax.Array:
        g, u = project(self, "gate", x), project(self, "up", x)
        return project(self, "down", jax.nn.silu(g) * u)


class DecoderLayer(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dt = cfg.jnp_dtype
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x, positions, mask, inv_freq):
        x = x + self.attn(self.attn_norm(x), positions, mask, inv_freq)
        return x + self.mlp(self.mlp_norm(x))

    def with_cache(self, x, positions, valid, inv_freq, cache, layer_idx, prefill=False):
        a, cache = self.attn.with_cache(self.attn_norm(x), positions, valid, inv_freq, cache,
                                        layer_idx, prefill)
        x = x + a
        return x + self.mlp(self.mlp_norm(x)), cache


def _default_positions(tokens: jax.Array) -> jax.Array:
    b, t = tokens.shape
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))


def stacked_layers(cfg: ModelConfig, rngs: nnx.Rngs) -> DecoderLayer:
    """``cfg.num_layers`` decoder layers as one ``DecoderLayer`` whose parameters have a
    leading ``[L]`` axis (logical axis ``layers``); layer ``i`` draws its own init keys."""

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs: nnx.Rngs) -> DecoderLayer:
        return DecoderLayer(cfg, rngs=rngs)

    return make(rngs)


class Backbone(nnx.Module):
    """Embedding + decoder layers (stacked, scanned) + final norm; shared by the policy and
    the value model."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"),
                            cfg.jnp_dtype)
        self.layers = stacked_layers(cfg, rngs)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.jnp_dtype, rngs=rngs)

    def scan_layers(self, step: Callable[[DecoderLayer, Any, jax.Array], Any], carry: Any, *,
                    remat: bool = False) -> Any:
        """``carry`` through every layer in order: ``carry = step(layer_i, carry, i)`` with
        ``layer_i`` the per-layer module and ``i`` its int32 index, as one ``lax.scan`` over
        the stacked params (unrolled with ``config.unroll_layers``). ``remat``: each layer
        is a ``jax.checkpoint`` under ``config.remat_policy`` (the backward pass keeps the
        carry per layer and recomputes the rest)."""
        cfg = self.config
        graphdef, state = nnx.split(self.layers)

        # Unrolled under a mesh, nothing pins the hidden states between layers (a scan's
        # carry keeps one layout): the partitioner may replicate the rows; keep them split.
        pin = cfg.unroll_layers and under_project_mesh()

        def body(c: Any, xs: tuple[Any, jax.Array]) -> tuple[Any, None]:
            layer_state, i = xs
            c = step(nnx.merge(graphdef, layer_state), c, i)
            if pin and isinstance(c, jax.Array) and c.ndim == 3:
                c = jax.lax.with_sharding_constraint(c, named_sharding(
                    kernel_mesh(), ("batch",), c.shape[:1]))
            return c, None

        if remat:
            body = jax.checkpoint(body, policy=REMAT_POLICIES[cfg.remat_policy],
                                  prevent_cse=False)
        carry, _ = jax.lax.scan(body, carry, (state, jnp.arange(cfg.num_layers,
                                                                dtype=jnp.int32)),
                                unroll=cfg.unroll_layers)
        return carry

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 attention_mask: jax.Array | None = None) -> jax.Array:
        """``tokens [B, T]`` -> final-normed hidden states ``[B, T, H]`` (config dtype).

        Attention is causal by index with padded keys (``attention_mask == 0``) masked out,
        i.e. right padding; ``positions`` default to ``0..T-1`` and only drive RoPE.
        """
        positions = _default_positions(tokens) if positions is None else positions
        mask = CausalMask.from_attention_mask(attention_mask)
        inv_freq = rope_inv_freq(self.config)
        x = jnp.take(self.embed[...], tokens, axis=0)
        x = self.scan_layers(lambda layer, h, _: layer(h, positions, mask, inv_freq), x,
                             remat=self.config.remat)
        return self.final_norm(x)

    def with_cache(self, tokens: jax.Array, positions: jax.Array, cache: KVCache,
                   valid: jax.Array, prefill: bool = False) -> tuple[jax.Array, KVCache]:
        """Cached forward of new tokens ``[B, T]`` -> (hidden ``[B, T, H]``, new cache).

        The cache rides in the scan's carry: each layer scatters its new k/v into the stacked
        ``[L, ...]`` storage at its index in place, so no step copies the cache. ``prefill``:
        see ``Attention.with_cache``."""
        inv_freq = rope_inv_freq(self.config)
        x = jnp.take(self.embed[...], tokens, axis=0)

        def step(layer: DecoderLayer, c: tuple[jax.Array, KVCache], i: jax.Array):
            return layer.with_cache(c[0], positions, valid, inv_freq, c[1], i, prefill)

        x, cache = self.scan_layers(step, (x, cache))
        return self.final_norm(x), cache


class Transformer(nnx.Module):
    """Causal LM: ``Backbone`` + (tied or separate) LM head."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.backbone = Backbone(cfg, rngs=rngs)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"),
                                  cfg.jnp_dtype)

    def lm_head_weight(self) -> jax.Array:
        """``[H, V]`` output projection (the transposed embedding when tied)."""
        if self.config.tie_embeddings:
            return self.backbone.embed[...].T
        return self.lm_head[...]

    def logits_from_hidden(self, hidden: jax.Array) -> jax.Array:
        """``hidden [..., H]`` -> float32 logits ``[..., V]``."""
        return jnp.einsum("...h,hv->...v", hidden, self.lm_head_weight(),
                          preferred_element_type=jnp.float32)

    def hidden_states(self, tokens: jax.Array, positions: jax.Array | None = None,
                      attention_mask: jax.Array | None = None) -> jax.Array:
        """Final-normed hidden states ``[B, T, H]``; see ``Backbone.__call__``."""
        return self.backbone(tokens, positions, attention_mask)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 attention_mask: jax.Array | None = None) -> jax.Array:
        """``tokens [B, T]`` -> float32 logits ``[B, T, V]`` (causal, right padding)."""
        return self.logits_from_hidden(self.hidden_states(tokens, positions, attention_mask))

    def init_cache(self, batch: int, max_len: int, mesh: Mesh | None = None) -> DenseKVCache:
        """An empty ``DenseKVCache`` (``[L, batch, max_len, Hkv, D]``) for this model; with a
        mesh, created directly in its sharded layout."""
        c = self.config
        args = (c.num_layers, batch, max_len, c.num_kv_heads, c.head_dim, c.jnp_dtype)
        if mesh is not None:
            return DenseKVCache.init_on_mesh(mesh, *args)
        return DenseKVCache.init(*args)

    def forward_with_cache(self, tokens: jax.Array, positions: jax.Array, cache: KVCache, *,
                           valid: jax.Array, prefill: bool = False
                           ) -> tuple[jax.Array, KVCache]:
        """Prefill or decode step through a KV cache.

        Args:
          tokens: ``[B, T]`` new tokens (T = prompt bucket for prefill, 1 for decode).
          positions: ``[B, T]`` their absolute positions.
          cache: any ``KVCache`` (dense or paged).
          valid: ``[B, T]`` bool; invalid tokens are not cached and their logits are junk.
          prefill: static; every row's tokens start at position 0 (``positions`` is
            ``0..T-1``): they attend over themselves, and the cache is only written.

        Returns:
          ``(logits [B, T, V] float32, new_cache)``.
        """
        hidden, cache = self.backbone.with_cache(tokens, positions, cache, valid, prefill)
        return self.logits_from_hidden(hidden), cache


# --------------------------------------------------------------------------- sharding


def _is_param(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def param_shardings(tree: Any, mesh: Mesh, rules: dict | None = None) -> Any:
    """Replaces every Variable of an ``nnx.State`` (concrete or abstract) by its NamedSharding,
    derived from the Variable's logical ``out_sharding`` axes (under ``rules``, default
    ``LOGICAL_RULES``; ``layout_rules("decode")`` gives the decode layout)."""

    def one(var: nnx.Variable):
        axes = var.get_metadata().get("out_sharding") or (None,) * len(var.shape)
        if rules is None:
            return named_sharding(mesh, axes, var.shape)
        return named_sharding(mesh, axes, var.shape, rules=rules)

    return jax.tree.map(one, tree, is_leaf=_is_param)


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Places every parameter of ``model`` per its logical axes (in place; returns ``model``)."""
    state = nnx.state(model)
    shardings = param_shardings(state, mesh)
    placed = jax.tree.map(
        lambda v, s: v.replace(jax.device_put(v.get_value(), s)), state, shardings,
        is_leaf=_is_param,
    )
    nnx.update(model, placed)
    return model


def create_model(cfg: ModelConfig, *, seed: int = 0, mesh: Mesh | None = None,
                 cls: type[nnx.Module] = Transformer) -> nnx.Module:
    """Builds ``cls(cfg)``; with a mesh, initialises each param directly in its sharding
    (jit with out_shardings) so no device ever holds the full model."""
    if mesh is None:
        return cls(cfg, rngs=nnx.Rngs(seed))
    abstract = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(seed)))
    graphdef, abs_state = nnx.split(abstract)
    out_shardings = param_shardings(abs_state, mesh)

    @jax.jit
    def init():
        state = nnx.state(cls(cfg, rngs=nnx.Rngs(seed)))
        values = jax.tree.map(lambda v: v.get_value(), state, is_leaf=_is_param)
        return jax.lax.with_sharding_constraint(values, out_shardings)

    values = init()
    state = jax.tree.map(lambda v, x: v.replace(x), abs_state, values, is_leaf=_is_param)
    return nnx.merge(graphdef, state)
