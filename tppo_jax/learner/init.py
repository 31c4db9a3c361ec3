"""The ``TrainState`` a run starts from, and the same state as abstract arrays.

``init_state`` is what the trainer calls on the loaded models: the params that train stored
in ``LearnerConfig.param_dtype`` (float32 masters of a bfloat16 model,
``models/precision.py``), the frozen LoRA base as loaded, and AdamW states over what trains.
``abstract_state`` is ``jax.eval_shape`` of that same function on abstract params, laid out
as a run places them: the compile path's state, so the two cannot drift.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax

from tppo_jax.learner.losses import LearnerConfig
from tppo_jax.learner.state import (
    TrainState,
    commit_to_mesh,
    policy_optimizer,
    value_optimizer,
)
from tppo_jax.models.lora import join_params, split_trainable
from tppo_jax.models.precision import cast_params
from tppo_jax.programs import on_mesh, sds

Trainable = tuple[tuple[str, ...] | None, tuple[str, ...] | None]


def trained_part(params: Any, keep: tuple[str, ...] | None) -> Any:
    """The part of ``params`` that trains (all of it when ``keep`` is None; else the LoRA
    adapters and the top-level params ``keep`` names, ``models.lora.split_trainable``)."""
    return params if keep is None else split_trainable(params, keep)[0]


def master_params(params: Any, keep: tuple[str, ...] | None, param_dtype: str | None) -> Any:
    """A model's params as the ``TrainState`` stores them: the part that trains in
    ``param_dtype`` (None: as they are), the frozen LoRA base as loaded (LoRA adapters are
    float32 already). Abstract ``ShapeDtypeStruct`` params are cast alike."""
    if param_dtype is None:
        return params
    train, frozen = (params, None) if keep is None else split_trainable(params, keep)
    train = cast_params(train, param_dtype)
    return train if frozen is None else join_params(train, frozen)


def init_state(policy: Any, value: Any, cfg: LearnerConfig, *,
               trainable: Trainable = (None, None), mesh: Any = None) -> TrainState:
    """The state training starts from: the policy's and the critic's params (pure dicts;
    ``value`` None for a critic-free estimator) as masters (``master_params``) and their
    optimizers' fresh states over what trains (``trainable``: ``Learner``'s). With ``mesh``
    the leaves that live off it (the optimizers' step counts, the state's step) are put on
    it, replicated (``commit_to_mesh``), as a jitted step hands them back."""
    keep_p, keep_v = trainable
    pm = master_params(policy, keep_p, cfg.param_dtype)
    vm = None if value is None else master_params(value, keep_v, cfg.param_dtype)
    popt = policy_optimizer(cfg.optim).init(trained_part(pm, keep_p))
    vopt = None if vm is None else value_optimizer(cfg.optim).init(trained_part(vm, keep_v))
    step = jnp.asarray(0, jnp.int32)
    if mesh is not None:
        popt = commit_to_mesh(popt, mesh)
        vopt = None if vopt is None else commit_to_mesh(vopt, mesh)
        step = commit_to_mesh(step, mesh)
    return TrainState(pm, vm, popt, vopt, step)


def _placed_like(shapes: Any, params: Any) -> Any:
    """Abstract ``shapes`` of a params tree in the shardings of ``params`` (same tree)."""
    return jax.tree.map(lambda s, p: sds(s, getattr(p, "sharding", None)), shapes, params)


def _placed_opt(tx: optax.GradientTransformation, shapes: Any, params: Any, mesh: Any
                ) -> Any:
    """An optimizer state's abstract ``shapes``: each param-shaped leaf (AdamW's m and v) in
    its param's sharding, the rest (step counts) replicated (``commit_to_mesh``)."""
    placed = optax.tree_map_params(tx, lambda s, p: sds(s, p.sharding), shapes, params,
                                   transform_non_params=lambda s: s)
    return on_mesh(placed, mesh)


def abstract_state(policy: Any, value: Any, cfg: LearnerConfig, *,
                   trainable: Trainable = (None, None), mesh: Any = None) -> TrainState:
    """``init_state`` as abstract arrays (``jax.eval_shape``: nothing is allocated), from
    abstract ``policy`` / ``value`` params laid out on ``mesh``: the params keep their
    layout (a dtype cast does not move a shard), the optimizers' moments take their
    param's, the rest is replicated."""
    shapes = jax.eval_shape(partial(init_state, cfg=cfg, trainable=trainable), policy, value)
    keep_p, keep_v = trainable
    pm = _placed_like(shapes.policy, policy)
    vm = None if value is None else _placed_like(shapes.value, value)
    popt = _placed_opt(policy_optimizer(cfg.optim), shapes.policy_opt, trained_part(pm, keep_p),
                       mesh)
    vopt = (None if vm is None else
            _placed_opt(value_optimizer(cfg.optim), shapes.value_opt, trained_part(vm, keep_v),
                        mesh))
    rest = on_mesh(shapes, mesh)  # whatever else the state holds (its step), replicated
    return dataclasses.replace(rest, policy=pm, value=vm, policy_opt=popt, value_opt=vopt)
