"""The T-PPO training loop (docs/algorithm.md section 5)::

    run, state = setup(cfg)                  # trainer/trainer.py: models, data, scheduler, resume
    evaluate (held out)
    pretrain the critic (optional)           # trainer/value_pretrain.py: VAPO, off the clock
    for each step:
        roll = collect(run)                  # one rollout window; grade the rows that finished
        state = update(run, state, roll)     # critic targets + EGAE -> policy and value updates
        log(run, state, roll, upd)           # metrics (summed over hosts), sample completions
        maybe_checkpoint(run, state)         # on schedule; at the end, preemption, time budget
    evaluate (held out)

Multi-host (``jax.distributed``): every process runs this same loop. Each host reads its
own shard of the prompts, keeps its own ``slots / P`` rollout slots and grades its own rows;
batches go to the updates as global arrays (``parallel.multihost``), metrics are summed over
hosts, and only process 0 writes logs and summaries. Stop decisions (preemption, time
budget) are agreed by all hosts so no process leaves the loop alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tppo_jax.config import Config, TrainConfig
from tppo_jax.learner import Targets, TrainState
from tppo_jax.learner.optim import scheduled_lrs
from tppo_jax.parallel import multihost as mh
from tppo_jax.trainer.batch import init_value_bias, learner_input
from tppo_jax.trainer.collect import Rollout, collect
from tppo_jax.trainer.ema import step_ema
from tppo_jax.trainer.evals import eval_before, heldout_eval
from tppo_jax.trainer.policy_view import Reshard, timed_policy_module
from tppo_jax.trainer.resume import checkpoint_meta, checkpoint_trees
from tppo_jax.trainer.run_dir import mirror
from tppo_jax.trainer.trainer import Trainer, setup
from tppo_jax.trainer.value_pretrain import pretrain_value

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """Too many consecutive updates had a non-finite loss or gradient."""


@dataclass
class TrainHooks:
    """Where a caller (a test, the CLI's fault injection) acts on a run.

    before_update: ``(step, targets) -> targets`` the updates of 0-based ``step`` train on.
    """

    before_update: Callable[[int, Targets], Targets] | None = None


def nan_updates_from(step: int) -> TrainHooks:
    """Fault injection: every update from (1-based) ``step`` on sees NaN advantages and
    returns (the reliability tests' divergence)."""
    def poison(i: int, targets: Targets) -> Targets:
        if i + 1 < step:
            return targets
        return targets.replace(advantages=targets.advantages * float("nan"),
                               returns=targets.returns * float("nan"))

    return TrainHooks(before_update=poison)


class _StopOnSignal:
    """SIGTERM (preemption) asks the loop to finish the current step, checkpoint, and exit."""

    def __init__(self) -> None:
        self.requested = False
        self._old = None

    def __enter__(self) -> _StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        log.warning("SIGTERM: finishing this step, saving a checkpoint, then exiting")
        self.requested = True

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


def train(cfg: Config, run_dir: str | Path, *, resume: bool = False, progress: bool = True,
          hooks: TrainHooks | None = None) -> dict[str, Any]:
    """Runs T-PPO; returns a summary (before/after held-out accuracy, steps, time).

    ``run_dir`` may be a bucket URL (``gs://...``): see ``trainer/run_dir.py``.
    """
    hooks = hooks or TrainHooks()
    with contextlib.ExitStack() as stack:
        run, state = setup(cfg, run_dir, resume=resume, progress=progress, stack=stack)
        before = eval_before(run, state)
        state = pretrain_value(run, state)  # VAPO; before the clock (algo.value_pretrain_steps)
        t_start = time.time()
        bar = tqdm(range(run.start, cfg.train.steps), desc="T-PPO", dynamic_ncols=True,
                   disable=not (run.progress and run.primary), initial=run.start,
                   total=cfg.train.steps)
        # Wall-clock of training steps only (held-out evals excluded), continued on resume.
        train_time = float(run.metrics.last.get("train_time_s", 0.0))
        skipped_in_a_row, preempted = 0, False
        last_eval = train_time  # training wall-clock at the last held-out eval
        stopper = stack.enter_context(_StopOnSignal())
        watch = stack.enter_context(run.watch)
        for step in bar:
            watch.reset()  # held-out evals between steps are not step time
            roll = collect(run)
            state, upd = update(run, state, roll, step, hooks, skipped_in_a_row)
            skipped_in_a_row = upd.skipped_in_a_row
            row = log_step(run, state, roll, upd, train_time)
            train_time += time.time() - roll.t0
            bar.set_postfix(reward=f"{row['reward_mean']:.2f}", fin=int(row["finished"]))
            target_hit, last_eval = maybe_evaluate(run, state, train_time, last_eval)
            preempted, time_up = stop_flags(run, stopper, train_time)
            stop = target_hit or time_up
            maybe_checkpoint(run, state, last=state.step == cfg.train.steps or stop or preempted)
            if preempted:
                log.warning("preempted: checkpoint saved at step %d", state.step)
                break
            if stop:
                log.info("stopping at step %d (target accuracy or time budget reached)",
                         state.step)
                break
        after = heldout_eval(run, state) if not preempted else None
        if after is not None:
            run.metrics.write_eval(state.step, "after", after)
        # With a policy average, the live policy's numbers too: what the average changed.
        live = (heldout_eval(run, state, live=True)
                if after is not None and state.policy_ema is not None else None)
    summary = {"eval_before": before, "eval_after": after,
               **({"eval_after_live": live} if live is not None else {}), "steps": state.step,
               "preempted": preempted, "train_seconds": time.time() - t_start,
               "run_dir": run.rd.remote or str(run.run_dir)}
    if run.primary:
        (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        mirror(run.rd)
    return summary


@dataclass
class Update:
    """What one step's updates report."""

    pstats: dict[str, Any]  # policy stats (empty during critic warm-up)
    vstats: dict[str, Any]
    width: int  # the batch's columns (a width bucket: the widest row group)
    value_rows: int  # rows the critic trained on (0: none finished anywhere)
    policy_cells: int  # rows x columns the policy's forward passes ran over (0: none)
    value_cells: int  # the same for the critic
    n_compiles: int  # update-side compiles and their seconds
    compile_s: float
    t_update: float
    skipped_in_a_row: int  # consecutive steps with a skipped (non-finite) update
    reshard: Reshard | None = None  # the policy's move to the decode layout (None: none)


def update(run: Trainer, state: TrainState, roll: Rollout, step: int, hooks: TrainHooks,
           skipped_in_a_row: int) -> tuple[TrainState, Update]:
    """``Learner.step`` on the rollout (targets, then the policy's and the critic's updates),
    then the scheduler samples from the new policy and frees the finished rows' slots."""
    cfg, rb, sched = run.cfg, roll.rb, run.sched
    if step == 0 and not cfg.algo.value_pretrain_steps:  # pretraining did it at its step 0
        state = dataclasses.replace(state, value=init_value_bias(run, state.value, roll))
    batch, rows = learner_input(run, roll, step)
    edit = None if hooks.before_update is None else partial(hooks.before_update, step)
    state, out = run.learner.step(state, batch, rows, ref=run.ref_policy, edit_targets=edit,
                                  train_policy=step >= cfg.algo.critic_warmup_steps)
    pstats, vstats, adv = mh.tree_to_host((out.policy, out.value, out.advantages))
    vstats = {**vstats, **adv}
    skipped = float(pstats.get("policy_skipped", 0.0)) + float(vstats["value_skipped"])
    skipped_in_a_row = skipped_in_a_row + 1 if skipped else 0
    if skipped_in_a_row >= cfg.train.max_skipped_updates:
        raise TrainingDiverged(
            f"step {step + 1}: non-finite loss or gradient in {skipped_in_a_row} "
            f"consecutive steps (updates skipped, params unchanged); last checkpoint: "
            f"step {run.ckpt.latest_step()} in {run.ckpt.directory}")
    n_compiles, compile_s = run.watch.take()
    t_update = time.time() - roll.t0 - roll.t_roll - roll.t_grade
    width, nrows = batch.shape[1], len(rows.finished)
    # After warm-up a function that has compiled should only meet known shapes (the row
    # groups' (rows, width) pairs are bounded, so new ones become rare).
    late = [k for k, (n0, _) in run.watch.new_shapes().items() if n0 and step > run.start + 2]
    if late:
        log.warning("step %d: %s compiled a new shape (batch width %d, critic rows %d); "
                    "shapes so far: %s", step + 1, ", ".join(late), width, nrows,
                    run.watch.sizes())
    state = step_ema(state, cfg)
    policy_view, moved = timed_policy_module(run, state)
    sched.set_policy(policy_view, step + 1)
    sched.release_finished(rb.finished)
    return state, Update(pstats, vstats, width, nrows, out.policy_cells, out.value_cells,
                         n_compiles, compile_s, t_update, skipped_in_a_row, moved)


def log_step(run: Trainer, state: TrainState, roll: Rollout, upd: Update,
             train_time: float) -> dict[str, Any]:
    """Writes the step's metrics (host-local counts summed over hosts, then turned into
    means) and sample completions; returns the metrics row."""
    rb, fin, pstats, vstats, watch = roll.rb, roll.fin, upd.pstats, upd.vstats, run.watch
    resp_len = rb.total_len - rb.prompt_len
    tot = mh.sum_over_hosts({
        "fin": len(fin), "reward": roll.reward[fin].sum(), "correct": roll.correct[fin].sum(),
        "resp_len": resp_len[fin].sum(), "rows": run.sched.B, "tokens": rb.window_len.sum(),
        "idle": roll.idle})
    top = mh.max_over_hosts({"resp_len": resp_len.max(), "window": rb.window_len.max()})
    counts = _merge_counts(mh.gather_json({k: int(v) for k, v in roll.counts.items()}))
    nfin = max(tot["fin"], 1.0)
    c_roll, c_upd, t0 = roll.c_roll, upd.compile_s, roll.t0
    row = run.metrics.write(state.step, {
        "reward_mean": tot["reward"] / nfin,
        "accuracy": 100.0 * tot["correct"] / nfin,  # percent, as every accuracy
        "finished_frac": tot["fin"] / tot["rows"],
        "finished": int(tot["fin"]),
        "response_len_mean": tot["resp_len"] / nfin,
        "response_len_max": int(top["resp_len"]),
        "occupancy": tot["tokens"] / max(1.0, run.cfg.rollout.slots * top["window"]),
        **scheduled_lrs(run.cfg.optim, state.step),
        "policy_loss": float(pstats.get("policy_loss", 0.0)),
        "value_loss": float(vstats["value_loss"]),
        **{k: float(v) for k, v in pstats.items() if k != "policy_loss"},
        **{k: float(v) for k, v in vstats.items() if k != "value_loss"},
        **{f"grade_{k}": v for k, v in counts.items()},
        "tokens": int(tot["tokens"]),
        "idle_slots": int(tot["idle"]),
        # Compile seconds are split out of the phase they happened in.
        "time_rollout_s": roll.t_roll - c_roll, "time_grading_s": roll.t_grade,
        "time_update_s": upd.t_update - c_upd, "time_compile_s": c_roll + c_upd,
        "compiles": roll.n_roll + upd.n_compiles, "compiles_total": watch.total_count,
        # What the updates ran on (the cost model's update tokens: rows x width).
        "update_width": upd.width,
        "value_rows": upd.value_rows,
        "policy_cells": upd.policy_cells,
        "value_cells": upd.value_cells,
        **{f"compiled_shapes_{k}": v for k, v in watch.sizes().items()},
        **({"reshard_s": upd.reshard.seconds, "reshard_gb": upd.reshard.bytes / 1e9}
           if upd.reshard is not None else {}),
        "tokens_per_s": tot["tokens"] / max(time.time() - t0, 1e-9),
        "train_time_s": train_time + (time.time() - t0),
    })
    run.metrics.write_samples(state.step, roll.samples)
    return row


def eval_due(tc: TrainConfig, step: int, train_time: float, last_eval: float) -> bool:
    """Whether a held-out eval follows ``step``: every ``eval_every`` steps, or once
    ``eval_every_s`` seconds of training wall-clock passed since the last one."""
    by_steps = bool(tc.eval_every) and step % tc.eval_every == 0
    return by_steps or (tc.eval_every_s > 0 and train_time - last_eval >= tc.eval_every_s)


def maybe_evaluate(run: Trainer, state: TrainState, train_time: float, last_eval: float
                   ) -> tuple[bool, float]:
    """The held-out eval when ``eval_due``. Returns (it reached ``train.target_accuracy``,
    the training wall-clock of the last eval)."""
    tc = run.cfg.train
    # Every host decides on the primary's clock: the hosts must run the eval together.
    due = mh.max_over_hosts({"due": run.primary and eval_due(tc, state.step, train_time,
                                                             last_eval)})["due"]
    if not due:
        return False, last_eval
    res = heldout_eval(run, state)  # identical on every host
    run.metrics.write(state.step, {f"eval_{k}": v for k, v in res.items()})
    run.metrics.write_eval(state.step, "during", res, loggers=False)
    return tc.target_accuracy is not None and res["accuracy"] >= tc.target_accuracy, train_time


def stop_flags(run: Trainer, stopper: _StopOnSignal, train_time: float) -> tuple[bool, bool]:
    """(preempted, time budget spent). The budget counts training wall-clock, held-out evals
    excluded. Clocks and signals differ per host: stop when any host says so, all together."""
    budget = run.cfg.train.time_budget_s
    flags = mh.max_over_hosts({
        "preempted": stopper.requested,
        "time_up": budget is not None and train_time >= budget})
    return bool(flags["preempted"]), bool(flags["time_up"])


def maybe_checkpoint(run: Trainer, state: TrainState, *, last: bool) -> None:
    """Saves on schedule and at the ``last`` step; a bucket run's files are mirrored after."""
    # Built only for a save: the host-state gather and slot upload are not free.
    if (last or run.ckpt.due(state.step)) and run.ckpt.save(
            state.step, checkpoint_trees(run, state), checkpoint_meta(run, state.step),
            force=True) and run.primary:
        mirror(run.rd)


def _merge_counts(per_host: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for counts in per_host:
        for k, v in counts.items():
            out[k] = out.get(k, 0) + int(v)
    return out
