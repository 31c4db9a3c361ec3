"""TrainState: what the updates change -- the policy and value params, their optimizer
states, and the number of completed steps.

A pytree (the four trees are its children, ``step`` is static), so it can be mapped over
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

    def items(self) -> dict[str, Any]:
        """The trees by checkpoint item name (the names existing checkpoints use)."""
        return {"policy": self.policy, "value": self.value, "policy_opt": self.policy_opt,
                "value_opt": self.value_opt}

    @classmethod
    def from_items(cls, trees: dict[str, Any], step: int, mesh: Any) -> TrainState:
        """The state restored from checkpoint ``trees`` (optimizer leaves put on ``mesh``)."""
        return cls(trees["policy"], trees["value"], commit_to_mesh(trees["policy_opt"], mesh),
                   commit_to_mesh(trees["value_opt"], mesh), step)


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
