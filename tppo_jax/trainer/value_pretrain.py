"""VAPO's value pretraining: before RL starts, the critic regresses on the Monte-Carlo
returns of the starting policy's complete responses, with the policy frozen.

Why: a critic that starts from the policy's backbone and a zero head predicts the same value
for every state, so EGAE's advantages are the outcome smeared over the last tokens of every
response, and the first policy updates push down the correct lines of a wrong solution as
hard as its mistake. VAPO trains the critic on a fixed policy first (lambda = 1 returns)
until it tells states apart.

The result depends only on the starting policy, the task and the critic's settings, not on
the method: it runs on synchronous full-length rollouts (window = L) whatever
``rollout.window`` is, on a prompt stream and sampling seed of its own, and is cached beside
the run dir (like the warm-start) under a key of everything that shapes it. T-PPO and PPO runs
of one seed load the same critic; neither pays for it in ``train.time_budget_s``. The critic's
optimizer state is not carried over: every run starts it fresh, whether it pretrained or
loaded the cache, so a loaded run equals the one that computed it.

It works with the run's parts passed in (``PretrainParts``: the learner, the mesh, a way to
make a scheduler and to collect a graded window), never the ``Trainer`` itself, and each of
its steps is the training loop's own sequence (``collect.learn_from``) with the policy frozen.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from tppo_jax.buckets import CompileWatch
from tppo_jax.config import Config
from tppo_jax.data.pipeline import PromptPipeline
from tppo_jax.data.readers import MathExample
from tppo_jax.learner import Learner
from tppo_jax.learner.state import TrainState
from tppo_jax.parallel import multihost as mh
from tppo_jax.rollout.scheduler import TruncatedRolloutScheduler
from tppo_jax.trainer.collect import Rollout, learn_from
from tppo_jax.weights.params import (
    copy_trained,
    model_key,
    rejoin,
    trainable_keys,
    trained_part,
)
from tppo_jax.weights.warmstart import keyed_data, warmstart_key

log = logging.getLogger(__name__)

CURVE = "value_pretrain.jsonl"  # one row per pretraining step, in the cache and the run dir
SEED_OFFSET = 7919  # its prompts and samples are not the run's first steps'

# The critic's own settings: the ones in the key (the policy-side knobs do not touch it).
_ALGO_KEYS = ("gamma", "lam_critic", "value_clip_low", "value_clip_high", "loss_aggregation",
              "value_pretrain_steps", "value_bias_init")
_OPTIM_KEYS = ("value_lr", "warmup_steps", "weight_decay", "b1", "b2", "eps", "grad_clip",
               "minibatches", "grad_accum", "epochs", "value_epochs")


@dataclass(frozen=True)
class PretrainParts:
    """The run's parts value pretraining works with.

    scheduler: ``(window, pipeline, seed) -> scheduler`` sampling from the run's policy;
    collect: one graded window of a scheduler; watch: the run's compile counter (the
    pretraining's compiles are taken off it, not counted as the first training step's);
    run_dir: where its curve is written (the cache sits beside it)."""

    cfg: Config
    learner: Learner
    mesh: Any
    train_rows: list[MathExample]
    scheduler: Callable[[int, PromptPipeline, int], TruncatedRolloutScheduler]
    collect: Callable[[TruncatedRolloutScheduler], Rollout]
    watch: CompileWatch
    run_dir: Path
    progress: bool


def pretrain_key(cfg: Config) -> str:
    """A hash of what the pretrained critic depends on: the starting policy (warm-start key or
    model path), task, reward, rollout shape with the window set to L, the critic's settings
    and ``train.seed``. Runs that differ only in ``rollout.window``, ``kv_policy`` or the
    policy's optimizer share it."""
    d = cfg.to_dict()
    rollout = dict(d["rollout"], window=cfg.rollout.max_response_len, kv_policy="keep")
    data = {k: v for k, v in keyed_data(cfg).items() if k != "eval_size"}
    start = warmstart_key(cfg) if cfg.model.source == "tiny" else cfg.model.path
    model = model_key(cfg, with_lora=True)  # a LoRA critic trains otherwise
    # "v": the cache's format; 2 = stacked decoder layers (a v1 cache holds per-layer params).
    blob = json.dumps({"start": start, "model": model, "data": data, "reward": d["reward"],
                       "rollout": rollout, "algo": {k: d["algo"][k] for k in _ALGO_KEYS},
                       "optim": {k: d["optim"][k] for k in _OPTIM_KEYS},
                       "seed": cfg.train.seed, "v": 2}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def pretrain_value(parts: PretrainParts, state: TrainState, *, resumed: bool = False
                   ) -> TrainState:
    """``state`` with its critic pretrained (``algo.value_pretrain_steps``; nothing on a
    ``resumed`` run or when 0). Single-host runs load or fill the cache beside the run dir
    (a run that finds another one filling it waits for it); multi-host runs pretrain in
    memory. A critic-free run (no ``state.value``) has nothing to pretrain."""
    cfg = parts.cfg
    if cfg.algo.value_pretrain_steps <= 0 or resumed:
        return state
    if state.value is None:
        log.info("algo.value_pretrain_steps: skipped (algo.advantage_baseline: %s needs no "
                 "critic)", cfg.algo.advantage_baseline)
        return state
    if jax.process_count() > 1:
        value, curve = _pretrain(parts, state)
        return _with_value(parts, state, value, curve, source="pretrained (multi-host, uncached)")
    cache = parts.run_dir.parent / f"value-pretrain-{pretrain_key(cfg)}"
    keep = trainable_keys(cfg)[1]  # LoRA: the cache holds what trains, not the base
    with _locked(cache):
        if not (cache / "DONE").exists():
            value, curve = _pretrain(parts, state)
            _save(cache, trained_part(value, keep), curve)
    value = rejoin(_restore(cache, trained_part(state.value, keep)), state.value, keep)
    curve = [json.loads(x) for x in (cache / CURVE).read_text().splitlines()]
    return _with_value(parts, state, value, curve, source=str(cache))


def _with_value(parts: PretrainParts, state: TrainState, value: Any,
                curve: list[dict[str, Any]], *, source: str) -> TrainState:
    if mh.is_primary():
        (parts.run_dir / CURVE).write_text("".join(json.dumps(r) + "\n" for r in curve))
    last = curve[-min(len(curve), 5):]
    log.info("value pretraining (%s): %d steps, explained variance %.3f -> %.3f (mean of the "
             "last %d)", source, len(curve), curve[0]["explained_variance"],
             float(np.mean([r["explained_variance"] for r in last])), len(last))
    return dataclasses.replace(state, value=value)


def _pretrain(parts: PretrainParts, state: TrainState) -> tuple[Any, list[dict[str, Any]]]:
    """``value_pretrain_steps`` critic-only steps on full-length rollouts of the frozen
    policy. Returns the critic's params and one row per step (its explained variance is the
    critic's before that step's update, on that step's new samples)."""
    cfg = parts.cfg
    pipeline = PromptPipeline(parts.train_rows, batch_size=1, seed=cfg.data.seed + SEED_OFFSET,
                              shard_index=jax.process_index(), shard_count=jax.process_count())
    sched = parts.scheduler(cfg.rollout.max_response_len, pipeline, cfg.train.seed + SEED_OFFSET)
    # Copies: the updates donate their inputs, and the run's own critic and (fresh)
    # optimizer state must survive for the run itself.
    value = copy_trained(state.value, trainable_keys(cfg)[1])  # LoRA: the base is shared
    opt = jax.tree.map(jnp.copy, state.value_opt)
    n, curve, t0 = cfg.algo.value_pretrain_steps, [], time.time()
    bar = tqdm(range(n), desc="value pretraining", dynamic_ncols=True,
               disable=not (parts.progress and mh.is_primary()))
    for i in bar:
        roll = parts.collect(sched)
        # Every step from the run's state (its step count too), with the critic's progress
        critic_only = dataclasses.replace(state, value=value, value_opt=opt)
        critic_only, out, _, _ = learn_from(parts.learner, critic_only, roll, cfg, parts.mesh,
                                            i + SEED_OFFSET, first=i == 0, train_policy=False)
        value, opt = critic_only.value, critic_only.value_opt
        stats = mh.tree_to_host(out.value)
        tot = mh.sum_over_hosts({"fin": len(roll.fin), "correct": roll.correct.sum()})
        row = {"step": i + 1, "explained_variance": float(stats.get("explained_variance", 0.0)),
               "value_loss": float(stats.get("value_loss", 0.0)),
               "accuracy": 100.0 * tot["correct"] / max(tot["fin"], 1.0),
               "finished": int(tot["fin"]),
               "seconds": time.time() - t0}
        curve.append(row)
        bar.set_postfix(ev=f"{row['explained_variance']:.2f}")
        sched.release_finished(roll.rb.finished)
    parts.watch.take()  # its compiles are not the first training step's
    return value, curve


@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[None]:
    """Holds an exclusive lock on ``cache``'s lock file: runs started side by side (T-PPO
    and PPO of one seed) pretrain once; the later one waits and loads the result."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    with open(cache.with_name(cache.name + ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _save(cache: Path, value: Any, curve: list[dict[str, Any]]) -> None:
    """The critic's params (Orbax) and the curve, then ``DONE``; a partial folder from a
    killed run is replaced."""
    import orbax.checkpoint as ocp

    if cache.exists():
        shutil.rmtree(cache)
    cache.mkdir(parents=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(cache.resolve() / "value", value)
        ckptr.wait_until_finished()
    (cache / CURVE).write_text("".join(json.dumps(r) + "\n" for r in curve))
    (cache / "DONE").write_text("ok")


def _restore(cache: Path, like: Any) -> Any:
    """The cached critic, placed as ``like`` (the run's critic) is."""
    import orbax.checkpoint as ocp

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            like)
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(cache.resolve() / "value", abstract)
