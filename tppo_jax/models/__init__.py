"""Model layer: NNX decoder (Qwen2/Llama), value model, KV-cache interface, HF I/O, tokenizer."""

from tppo_jax.kernels.attention import gqa_attention
from tppo_jax.models.cache import DenseKVCache, KVCache
from tppo_jax.models.hf import config_from_hf, config_to_hf, from_pretrained, save_pretrained
from tppo_jax.models.tokenizer import Tokenizer, train_sentencepiece
from tppo_jax.models.transformer import (
    Backbone,
    ModelConfig,
    Transformer,
    create_model,
    param_shardings,
    shard_model,
)
from tppo_jax.models.value import ValueModel

__all__ = [
    "Backbone",
    "DenseKVCache",
    "KVCache",
    "ModelConfig",
    "Tokenizer",
    "Transformer",
    "ValueModel",
    "config_from_hf",
    "config_to_hf",
    "create_model",
    "from_pretrained",
    "gqa_attention",
    "param_shardings",
    "save_pretrained",
    "shard_model",
    "train_sentencepiece",
]
