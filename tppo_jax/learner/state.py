"""TrainState: what the updates change -- the policy and value params, their optimizer
states, the number of completed steps and (``optim.policy_ema``) the policy's average.

A pytree (the trees are its children, ``step`` is static), so it can be mapped over
like any other tree; ``items()`` names its trees as the checkpoint items they are saved as.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    policy: Any  # pure dict of the policy's params (mesh-sharded)
    value: Any  # pure dict of the value model's params
    policy_opt: Any  # optax state of the policy's optimizer
    value_opt: Any  # optax state of the critic's optimizer
    step: int = dataclasses.field(default=0, metadata={"static": True})  # completed steps
    # The moving average of the policy's trained params (optim.policy_ema; None: off)
    policy_ema: Any = None

    def items(self) -> dict[str, Any]:
        """The trees by checkpoint item name (the names existing checkpoints use)."""
        ema = {} if self.policy_ema is None else {"policy_ema": self.policy_ema}
        return {"policy": self.policy, "value": self.value, "policy_opt": self.policy_opt,
                "value_opt": self.value_opt, **ema}

    @classmethod
    def from_items(cls, trees: dict[str, Any], step: int, mesh: Any) -> TrainState:
        """The state restored from checkpoint ``trees`` (optimizer leaves put on ``mesh``)."""
        return cls(trees["policy"], trees["value"], commit_to_mesh(trees["policy_opt"], mesh),
                   commit_to_mesh(trees["value_opt"], mesh), step, trees.get("policy_ema"))


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
