"""A run's checkpoints: what each holds (``checkpoint_trees``, ``checkpoint_meta``) and the
resume from the newest good one (``restore``): params, optimizer states, data iterator and
the scheduler's slots, with this host's part of the metadata (``host_meta``)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import jax

from tppo_jax.config import ConfigError
from tppo_jax.learner.state import TrainState
from tppo_jax.parallel import multihost as mh
from tppo_jax.trainer.policy_view import policy_module
from tppo_jax.trainer.trainable import saved_items, with_frozen

if TYPE_CHECKING:
    from tppo_jax.trainer.trainer import Trainer

log = logging.getLogger(__name__)


def checkpoint_trees(run: Trainer, state: TrainState) -> dict[str, Any]:
    """Every tree a checkpoint holds, by item name (also the templates a restore reads into);
    with LoRA the models' items hold only what trains (``trainer/trainable.py``)."""
    return {**saved_items(state.items(), run.cfg), **run.sched.checkpoint_items()}


def checkpoint_meta(run: Trainer, step: int) -> dict[str, Any]:
    """Each host's data iterator and scheduler state, gathered (process 0 writes it)."""
    return {"step": step, "eval_before": run.eval_before, "num_processes": jax.process_count(),
            "hosts": mh.gather_json({"data_state": run.pipeline.state_json(),
                                     "scheduler": run.sched.host_state()})}


def restore(run: Trainer, state: TrainState) -> TrainState:
    """The newest checkpoint whose manifest verifies (damaged ones are reported, set aside):
    params, optimizer states, data iterator and scheduler; ``state`` when there is none."""
    restored = run.ckpt.restore_latest(checkpoint_trees(run, state))
    if restored is None:
        return state
    _, trees, meta = restored
    run.start = int(meta["step"])
    state = TrainState.from_items(with_frozen(trees, state.items(), run.cfg), run.start,
                                  run.mesh)
    host = host_meta(meta)
    run.pipeline.load_state_json(host["data_state"])
    run.sched.restore(trees, host["scheduler"])
    run.sched.set_policy(policy_module(run, state), run.sched.policy_version)
    if "eval_before" in meta:
        run.eval_before = meta["eval_before"]
    log.info("resumed from step %d", run.start)
    return state


def host_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """This host's part of a checkpoint's metadata (data iterator and scheduler state)."""
    if "hosts" not in meta:  # written by a single-host version without per-host state
        return meta
    n = int(meta.get("num_processes", len(meta["hosts"])))
    if n != jax.process_count():
        raise ConfigError(f"checkpoint at step {meta['step']} was written by {n} processes; "
                          f"this run has {jax.process_count()} (per-host data and rollout "
                          f"state cannot be re-split)")
    return meta["hosts"][jax.process_index()]
