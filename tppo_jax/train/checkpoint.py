"""Orbax checkpoints: ``policy``/``value`` params and their optimizer states as separate
items, plus the trainer state (step, RNG, data-iterator state, scheduler slots).

Multi-host: every process calls ``save``/``restore`` with global arrays; Orbax writes each
shard once from the host that holds it, and process 0 writes the JSON metadata."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath

from tppo_jax.parallel.multihost import global_to_host, tree_to_host

log = logging.getLogger(__name__)


def all_finite(tree: Any) -> bool:
    """True when every floating-point leaf of ``tree`` is finite. Reduced on device, so
    params sharded over several hosts are checked without gathering them."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
    if not leaves:
        return True
    ok = jax.jit(lambda xs: jnp.all(jnp.stack([jnp.isfinite(x).all() for x in xs])))(leaves)
    return bool(global_to_host(ok))


def checkpoint_path(directory: str | Path) -> epath.Path:
    """A local directory (made absolute) or a bucket URL such as ``gs://b/run/checkpoints``,
    which Orbax writes directly: on a pod every host must write to one shared place."""
    s = str(directory)
    return epath.Path(s) if "://" in s else epath.Path(Path(s).absolute())

# kv_cache: the scheduler's cache of unfinished rows, so a resumed run continues exactly
# as an uninterrupted one would (with kv_policy=keep it holds old-policy keys/values).
ITEMS = ("policy", "value", "policy_opt", "value_opt", "slots", "kv_cache")


class Checkpointer:
    """Saves every ``every`` steps (and on demand), keeps the last ``keep``."""

    def __init__(self, directory: str | Path, *, every: int, keep: int) -> None:
        self.directory = checkpoint_path(directory)
        self.every = every
        self.mngr = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        )

    def latest_step(self) -> int | None:
        return self.mngr.latest_step()

    def due(self, step: int) -> bool:
        """Whether ``step`` is a scheduled save (every ``every`` steps)."""
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, trees: dict[str, Any], meta: dict[str, Any], *,
             force: bool = False) -> bool:
        """Saves if due (or ``force``); never saves non-finite params (returns False)."""
        if not (force or self.due(step)):
            return False
        bad = [k for k in ("policy", "value") if not all_finite(trees[k])]
        if bad:
            log.error("checkpoint at step %d skipped: non-finite values in %s", step, bad)
            return False
        args = {k: ocp.args.StandardSave(trees[k]) for k in ITEMS}
        args["meta"] = ocp.args.JsonSave(meta)
        self.mngr.save(step, args=ocp.args.Composite(**args), force=force)
        self.mngr.wait_until_finished()
        return True

    def restore(self, step: int, templates: dict[str, Any]) -> tuple[dict[str, Any], dict]:
        """Restores into the structure (and shardings) of ``templates``."""
        args = {k: ocp.args.StandardRestore(templates[k]) for k in ITEMS}
        args["meta"] = ocp.args.JsonRestore()
        out = self.mngr.restore(step, args=ocp.args.Composite(**args))
        trees = {k: out[k] for k in ITEMS}
        trees["slots"] = tree_to_host(trees["slots"])  # this host's rows, as numpy
        return trees, out["meta"]

    def restore_item(self, step: int, name: str, template: Any) -> Any:
        """Restores one item (e.g. ``policy`` for evaluation or export)."""
        out = self.mngr.restore(step, args=ocp.args.Composite(
            **{name: ocp.args.StandardRestore(template)}))
        return out[name]

    def close(self) -> None:
        self.mngr.close()
