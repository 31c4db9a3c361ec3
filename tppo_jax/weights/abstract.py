"""The models shape-only: the same constructors a run builds them with (``start.py``'s
``with_adapters`` and ``split_models``) under ``nnx.eval_shape``, so no weights are made.

``abstract_models`` is what the compile path builds a config's programs from (params laid
out on a mesh of abstract devices by their logical axes); ``abstract_policy`` is the template
a run's checkpoint is restored into (``restore.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from tppo_jax.config import Config
from tppo_jax.learner.estimators import needs_critic
from tppo_jax.models.transformer import ModelConfig, Transformer, param_shardings
from tppo_jax.models.value import ValueModel
from tppo_jax.weights.start import split_models, with_adapters


def abstract_policy(config_json: Path, dtype: str) -> tuple[Any, Any]:
    """``(graphdef, template)`` of the policy an HF ``config.json`` describes: shapes and
    dtypes only (on this host's first device), for restoring a checkpoint into."""
    from tppo_jax.models.hf import config_from_hf

    mcfg = config_from_hf(json.loads(Path(config_json).read_text()), dtype)
    pdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(mcfg, rngs=nnx.Rngs(0))))
    dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev),
                            nnx.to_pure_dict(state))
    return pdef, template


def abstract_models(cfg: Config, mesh: Any, mc: ModelConfig) -> dict[str, Any]:
    """The policy and the critic of a run of ``cfg`` with model config ``mc``, as
    ``start.load_models`` builds them (LoRA adapters, the critic where the estimator needs
    one, a shared base), shape-only: ``{"policy": (graphdef, params), "value": (graphdef,
    params) or (None, None), "policy_state": the policy's abstract ``nnx.State``, "config":
    mc}``, params a pure dict of ``ShapeDtypeStruct``s laid out on ``mesh`` by their logical
    axes."""
    critic = needs_critic(cfg.algo)

    def make() -> tuple[Any, Any]:
        policy = Transformer(mc, rngs=nnx.Rngs(cfg.train.seed))
        value = ValueModel(mc, rngs=nnx.Rngs(cfg.train.seed + 1)) if critic else None
        return with_adapters(cfg, policy, value)

    policy, value = nnx.eval_shape(make)
    pstate = nnx.state(policy)
    _place(policy, mesh)
    if value is not None:
        _place(value, mesh)
    pdef, vdef, params = split_models(cfg, policy, value)
    return {"policy": (pdef, params.policy), "value": (vdef, params.value),
            "policy_state": pstate, "config": mc}


def _place(model: Any, mesh: Any) -> None:
    """Each abstract param of ``model`` as a ``ShapeDtypeStruct`` in its sharding on
    ``mesh`` (in place), as ``shard_model`` places a real one."""
    state = nnx.state(model)
    placed = jax.tree.map(
        lambda v, s: v.replace(jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype,
                                                    sharding=s)),
        state, param_shardings(state, mesh), is_leaf=lambda x: isinstance(x, nnx.Variable))
    nnx.update(model, placed)
