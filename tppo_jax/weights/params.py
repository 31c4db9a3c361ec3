"""Which params a run trains and what its checkpoints hold, with and without LoRA.

Without LoRA (``model.lora_rank: 0``) every param trains: the optimizers' states cover the
whole models and checkpoints hold them whole. With LoRA only the adapters train (and, with
``model.value_lora``, the critic's value head besides its adapters): the optimizer states cover
those alone, and the checkpoint items ``policy`` / ``value`` hold only them; the frozen base is
rebuilt from ``model.path`` (or the warm-start) and joined back on restore.

``TrainState`` always holds the full params (base + adapters) so rollout, evaluation and the
critic's forward read one tree; ``models.lora.split_trainable`` separates them where needed.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import jax
import jax.numpy as jnp

from tppo_jax.config import Config
from tppo_jax.learner.init import trained_part
from tppo_jax.models.lora import join_params, split_trainable
from tppo_jax.models.precision import cast_params, compute_dtype

# The critic's params that train in full under LoRA (models/value.py): its scalar head.
VALUE_HEAD = ("head", "head_bias")
# The model settings that only say how it is fine-tuned (not what it starts as).
LORA_SETTINGS = ("lora_rank", "lora_alpha", "lora_targets", "value_lora")


def model_key(cfg: Config, *, with_lora: bool) -> dict[str, Any]:
    """``cfg.model`` as a cache key hashes it. The LoRA settings join only with
    ``with_lora`` and LoRA on, so keys made before they existed (or with LoRA off) stay the
    same: the warm-start (a full-weight run of its own) never depends on them."""
    d = asdict(cfg.model)
    if d["param_dtype"] == "float32":  # the default joins no key: keys made before it stay
        del d["param_dtype"]
    if with_lora and cfg.model.lora_rank:
        return d
    return {k: v for k, v in d.items() if k not in LORA_SETTINGS}


def trainable_keys(cfg: Config) -> tuple[tuple[str, ...] | None, tuple[str, ...] | None]:
    """``(policy, value)``: None where every param trains; else the top-level params that
    train besides the adapters (``Learner``'s ``trainable``)."""
    m = cfg.model
    if not m.lora_rank:
        return None, None
    return (), (VALUE_HEAD if m.value_lora else None)


def shares_base(cfg: Config) -> bool:
    """Whether the critic's frozen backbone is the policy's own arrays: LoRA on both and a
    critic made from the policy (``value_init: policy``), so their bases are equal and
    neither changes; one copy of the weights in memory instead of two."""
    m = cfg.model
    return bool(m.lora_rank) and m.value_lora and m.value_init == "policy"


def share_base(policy: dict[str, Any], value: dict[str, Any]) -> dict[str, Any]:
    """``value`` params whose frozen backbone leaves are replaced by ``policy``'s (the same
    values, placed alike: ``shares_base``). Nothing donates a frozen leaf (the updates donate
    only what trains), so sharing them is safe."""
    base = split_trainable(policy["backbone"])[1]
    train, frozen = split_trainable(value, VALUE_HEAD)
    if jax.tree.structure(frozen["backbone"]) != jax.tree.structure(base):
        raise ValueError("the critic's backbone is not the policy's: cannot share the base")
    return join_params(train, {**frozen, "backbone": base})


def copy_trained(params: Any, keep: tuple[str, ...] | None) -> Any:
    """``params`` with the part that trains copied (new buffers an update may donate) and
    the frozen rest shared."""
    if keep is None:
        return jax.tree.map(jnp.copy, params)
    train, frozen = split_trainable(params, keep)
    return join_params(jax.tree.map(jnp.copy, train), frozen)


def saved_items(items: dict[str, Any], cfg: Config) -> dict[str, Any]:
    """``TrainState.items()`` as a checkpoint holds them: ``policy`` / ``value`` cut to their
    trained part (the optimizer states already cover only that); a critic-free run has no
    ``value``."""
    keep_p, keep_v = trainable_keys(cfg)
    out = dict(items, policy=trained_part(items["policy"], keep_p))
    if "value" in items:
        out["value"] = trained_part(items["value"], keep_v)
    return out


def with_frozen(trees: dict[str, Any], items: dict[str, Any], cfg: Config) -> dict[str, Any]:
    """Restored checkpoint ``trees`` with each model's frozen base joined back in from the
    run's current ``items`` (``saved_items``' inverse)."""
    out = dict(trees)
    for name, keep in zip(("policy", "value"), trainable_keys(cfg), strict=True):
        if name in trees:  # a critic-free run's have no "value"
            out[name] = rejoin(trees[name], items[name], keep)
    return out


def rejoin(part: Any, like: Any, keep: tuple[str, ...] | None) -> Any:
    """A model's trained ``part`` joined with the frozen rest of ``like`` (``part`` itself
    when ``keep`` is None: it is the whole model)."""
    return part if keep is None else join_params(part, split_trainable(like, keep)[1])


def compute_copy(params: Any, cfg: Config) -> Any:
    """``params`` in the dtype the model computes in (``model.dtype``): the decode copy of
    the policy and the KL reference; ``params`` itself when they are stored so already."""
    return cast_params(params, compute_dtype(cfg.model.dtype, cfg.model.param_dtype))
