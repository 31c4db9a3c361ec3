"""What the updates change and how: ``TrainState`` (the policy and value params, their
optimizer states and the number of completed steps) and the optimizers that step it (AdamW on
a warm-up schedule, the guarded step).

``TrainState`` is a pytree whose children are all arrays, ``step`` too (an int32 scalar, as
levanter's): its tree structure is the same at every step, so a function jitted over the whole
state compiles once, not once per step value. ``items()`` names its trees as the checkpoint
items they are saved as; the step is saved in the checkpoint's metadata.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from tppo_jax.config import OptimConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    policy: Any  # pure dict of the policy's params (mesh-sharded)
    value: Any  # pure dict of the value model's params (None: a critic-free run)
    policy_opt: Any  # optax state of the policy's optimizer
    value_opt: Any  # optax state of the critic's optimizer (None: critic-free)
    step: Any = 0  # completed steps: an int32 scalar array (a Python int is converted)

    def __post_init__(self) -> None:
        if isinstance(self.step, int):  # not while jax rebuilds the tree with other leaves
            self.step = jnp.asarray(self.step, jnp.int32)

    def items(self) -> dict[str, Any]:
        """The trees by checkpoint item name (the names existing checkpoints use); a
        critic-free run has no ``value`` / ``value_opt``."""
        trees = {"policy": self.policy, "value": self.value, "policy_opt": self.policy_opt,
                 "value_opt": self.value_opt}
        return {k: v for k, v in trees.items() if v is not None}

    @classmethod
    def from_items(cls, trees: dict[str, Any], step: int, mesh: Any) -> TrainState:
        """The state restored from checkpoint ``trees`` and the metadata's ``step``
        (optimizer leaves and the step put on ``mesh``)."""
        vopt = trees.get("value_opt")
        return cls(trees["policy"], trees.get("value"), commit_to_mesh(trees["policy_opt"], mesh),
                   None if vopt is None else commit_to_mesh(vopt, mesh),
                   commit_to_mesh(jnp.asarray(step, jnp.int32), mesh))


def commit_to_mesh(tree: Any, mesh: Any) -> Any:
    """Puts leaves that live off the mesh (optimizer step counts, restored scalars) on it,
    replicated; a jitted step refuses arguments committed to different device sets. Leaves
    must look exactly as the step's outputs will (a mesh sharding, committed): an uncommitted
    step count would make the first update's executable a cache entry of its own, compiled
    again on the second step."""
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def put(x):
        if (isinstance(x, jax.Array) and x.committed
                and isinstance(x.sharding, jax.sharding.NamedSharding)
                and x.sharding.mesh == mesh):
            return x
        return jax.device_put(x, rep)

    return jax.tree.map(put, tree)


def updates_per_step(optim: OptimConfig, epochs: int | None = None) -> int:
    """Optimizer updates one training step makes (when every minibatch has tokens): one per
    minibatch per epoch (``epochs``: default ``optim.epochs``; the critic's are
    ``optim.critic_epochs``). ``grad_accum`` splits a minibatch into micro-batches whose
    gradients make a single update, so it does not change the count."""
    return optim.minibatches * (optim.epochs if epochs is None else epochs)


def lr_schedule(lr: float, optim: OptimConfig, epochs: int | None = None,
                decay_steps: int = 0) -> optax.Schedule:
    """Linear warm-up over ``optim.warmup_steps`` *training steps*, then constant, or with
    ``decay_steps`` a cosine decay to 0 over that many training steps (then 0).

    The schedule's clock is optax's update count, so the warm-up is scaled to
    ``warmup_steps * updates_per_step`` updates (the paper's "20 warm-up steps" with 16
    minibatches is 320 updates, not 20). A minibatch with nothing to train on takes no update
    and does not advance the clock (see ``guarded_apply``).
    """
    ups = updates_per_step(optim, epochs)
    n = max(optim.warmup_steps * ups, 1)
    after = (optax.cosine_decay_schedule(lr, decay_steps * ups) if decay_steps > 0
             else optax.constant_schedule(lr))
    return optax.join_schedules([optax.linear_schedule(lr / n, lr, n), after], [n])


def scheduled_lrs(optim: OptimConfig, step: int) -> dict[str, float]:
    """The policy's and the critic's learning rates after training step ``step`` (1-based):
    the schedules of ``make_optimizer`` at ``step * updates_per_step`` updates (a skipped,
    empty minibatch would leave the real clock a little behind)."""
    p = lr_schedule(optim.policy_lr, optim, decay_steps=optim.policy_lr_decay_steps)
    v = lr_schedule(optim.value_lr, optim, optim.critic_epochs)
    return {"lr_policy": float(p(step * updates_per_step(optim))),
            "lr_value": float(v(step * updates_per_step(optim, optim.critic_epochs)))}


def make_optimizer(lr: float, optim: OptimConfig, epochs: int | None = None,
                   decay_steps: int = 0) -> optax.GradientTransformation:
    """AdamW on ``lr_schedule`` (``epochs`` passes per step, ``decay_steps``) after
    global-norm clipping."""
    parts = [optax.clip_by_global_norm(optim.grad_clip)] if optim.grad_clip > 0 else []
    parts.append(optax.adamw(lr_schedule(lr, optim, epochs, decay_steps), b1=optim.b1, b2=optim.b2,
                             eps=optim.eps, weight_decay=optim.weight_decay))
    return optax.chain(*parts)


def policy_optimizer(optim: OptimConfig) -> optax.GradientTransformation:
    """The policy's AdamW (``optim.policy_lr``, decayed over ``policy_lr_decay_steps``)."""
    return make_optimizer(optim.policy_lr, optim, decay_steps=optim.policy_lr_decay_steps)


def value_optimizer(optim: OptimConfig) -> optax.GradientTransformation:
    """The critic's AdamW (``optim.value_lr`` over ``critic_epochs`` passes a step)."""
    return make_optimizer(optim.value_lr, optim, optim.critic_epochs)


def guarded_apply(tx: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any,
                  loss: jax.Array, active: jax.Array) -> tuple[Any, Any, jax.Array]:
    """Applies the update only if the minibatch has tokens to train on (``active``) and its
    loss and grads are finite; else params *and* optimizer state stay as they were (no AdamW
    momentum step on a zero gradient, no tick of the learning-rate schedule).

    Returns ``(params, opt_state, skipped)``; ``skipped``: active but non-finite.
    """
    finite = jnp.isfinite(loss) & jnp.all(jnp.array(
        [jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    apply = finite & active
    safe = jax.tree.map(lambda g: jnp.where(apply, g, 0.0), grads)
    updates, new_opt = tx.update(safe, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)  # noqa
    return keep(new_params, params), keep(new_opt, opt_state), active & ~finite
