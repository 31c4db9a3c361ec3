"""Value model (critic): the decoder backbone plus a scalar head per token.

``values[b, t]`` is V(s_t) read at the position whose hidden state *predicts* token t+1,
i.e. the same indexing as the policy's logits (docs/algorithm.md section 1). The critic never shares
parameters (or buffers) with the policy: ``from_policy`` copies the backbone arrays -- except
under LoRA, where both bases are frozen and one copy serves both (``copy=False``,
``weights/params.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tppo_jax.models.transformer import Backbone, ModelConfig, Transformer


class ValueModel(nnx.Module):
    """``Backbone`` + linear head ``[H] -> scalar`` (float32 output)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, head_init_std: float = 0.0):
        """Fresh critic with its own random backbone.

        Args:
          head_init_std: std of the head weight; 0 (default) starts every value at 0 so
            value pretraining starts from a neutral critic.
        """
        self.config = cfg
        self.backbone = Backbone(cfg, rngs=rngs)
        w = head_init_std * jax.random.normal(rngs.params(), (cfg.hidden_size,), jnp.float32)
        # The head stays float32 even for bf16 backbones: it is tiny and values need precision.
        self.head = nnx.Param(w, out_sharding=("embed",), eager_sharding=False)
        self.head_bias = nnx.Param(jnp.zeros((), jnp.float32), out_sharding=(),
                                   eager_sharding=False)

    @classmethod
    def from_policy(cls, policy: Transformer, *, seed: int = 0, head_init_std: float = 0.0,
                    copy: bool = True) -> ValueModel:
        """Critic initialised from a policy's backbone (weights copied, same shardings;
        ``copy=False``: the policy's own arrays, for a frozen LoRA base)."""
        cfg = policy.config
        abstract = nnx.eval_shape(
            lambda: cls(cfg, rngs=nnx.Rngs(seed), head_init_std=head_init_std))
        model = nnx.merge(*nnx.split(abstract))
        # `.copy()` gives new buffers (same sharding) so donating the policy's params in a
        # jitted update can never invalidate the critic's.
        backbone_state = nnx.state(policy.backbone)
        if copy:
            backbone_state = jax.tree.map(lambda x: x.copy(), backbone_state)
        nnx.update(model.backbone, backbone_state)
        head = head_init_std * jax.random.normal(jax.random.key(seed), (cfg.hidden_size,))
        model.head.set_value(jnp.asarray(head, jnp.float32))
        model.head_bias.set_value(jnp.zeros((), jnp.float32))
        return model

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 attention_mask: jax.Array | None = None) -> jax.Array:
        """``tokens [B, T]`` -> values ``[B, T]`` float32 (causal, right padding)."""
        hidden = self.backbone(tokens, positions, attention_mask)
        return jnp.einsum("bth,h->bt", hidden.astype(jnp.float32), self.head[...]) + \
            self.head_bias[...]
