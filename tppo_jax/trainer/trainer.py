"""The training run (docs/algorithm.md section 5): ``Trainer`` builds a run from its
``Config``, restores the newest good checkpoint, evaluates and fits::

    with Trainer(cfg, run_dir, resume=resume) as trainer:   # run dir, models, data, learner
        summary = trainer.fit()
            # evaluate (held out); pretrain the critic (VAPO, optional, off the clock)
            # each step: roll = collect()                  one window; grade what finished
            #            update(roll)                      learner.step: targets, both updates
            #            log(roll, update)                 metrics, sample completions
            #            checkpoint()                      on schedule, at the end, preemption
            # evaluate (held out)

Multi-host (``jax.distributed``): every process runs this same loop. Each host reads its
own shard of the prompts, keeps its own ``slots / P`` rollout slots and grades its own rows;
batches go to the updates as global arrays (``parallel.multihost``), metrics are summed over
hosts, and only process 0 writes logs and summaries. Stop decisions (preemption, time
budget, the eval cadence) are agreed by all hosts so no process leaves the loop alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh
from tqdm import tqdm

from tppo_jax.buckets import CompileWatch, enable_compile_cache
from tppo_jax.config import Config, validate
from tppo_jax.data.pipeline import PromptPipeline
from tppo_jax.data.readers import MathExample
from tppo_jax.data.run_data import load_data, prompt_rows
from tppo_jax.eval.diagnose import no_answer_warning
from tppo_jax.eval.heldout import EvalEngines, eval_record, evaluate
from tppo_jax.eval.protocol import run_protocol
from tppo_jax.learner import (
    Learner,
    LearnerConfig,
    TrainState,
)
from tppo_jax.learner.estimators import resolve_estimator
from tppo_jax.learner.init import init_state
from tppo_jax.parallel import multihost as mh
from tppo_jax.parallel.mesh import decode_mesh, make_mesh, reshard
from tppo_jax.rewards.custom import check_reward
from tppo_jax.rewards.grader import MathGrader, answer_format_for
from tppo_jax.rollout.decode import SamplingParams
from tppo_jax.rollout.scheduler import TruncatedRolloutScheduler
from tppo_jax.runs.checkpoint import Checkpointer, host_meta
from tppo_jax.runs.metrics import MetricsWriter
from tppo_jax.runs.run_claim import claim_run_dir
from tppo_jax.runs.run_config import check_resume, run_config_text
from tppo_jax.runs.run_dir import RunDir, mirror, pull, resolve_run_dir, write_atomic
from tppo_jax.runs.wandb_log import wandb_settings
from tppo_jax.trainer.collect import Rollout, collect, learn_from
from tppo_jax.trainer.hooks import StopOnSignal, TrainHooks, eval_due, nan_updates_from
from tppo_jax.trainer.step_log import Reshard, Update, step_metrics
from tppo_jax.trainer.value_pretrain import PretrainParts, pretrain_value
from tppo_jax.weights.params import (
    compute_copy,
    saved_items,
    trainable_keys,
    with_frozen,
)
from tppo_jax.weights.start import Models, decode_shardings, load_models, reference_copy
from tppo_jax.weights.warmstart import RUN_SUBDIR

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """Too many consecutive updates had a non-finite loss or gradient."""


# The loop's public names (its hooks and records live in hooks.py and step_log.py).
__all__ = ["TrainHooks", "Trainer", "TrainingDiverged", "Update", "eval_due",
           "nan_updates_from", "train"]


def train(cfg: Config, run_dir: str | Path, *, resume: bool = False, progress: bool = True,
          hooks: TrainHooks | None = None) -> dict[str, Any]:
    """Runs T-PPO; returns a summary (before/after held-out accuracy, steps, time), also
    written to ``summary.json`` once the last checkpoint is on disk.

    ``run_dir`` may be a bucket URL (``gs://...``): see ``runs/run_dir.py``.
    """
    with Trainer(cfg, run_dir, resume=resume, progress=progress) as trainer:
        summary = trainer.fit(hooks)
    trainer.write_summary(summary)
    return summary


class Trainer:
    """A training run. Building it validates the config, claims the run dir, freezes the
    config, builds the mesh, models, data, rollout scheduler, ``Learner``, grader and
    metrics, and (``resume``) restores the newest good checkpoint; ``state`` is the
    ``TrainState`` the updates change, everything else stays fixed. Close it (or use it as
    a context manager) to release the run dir: the checkpoint manager closes first, so a
    failed save's last reports come out before the run's stop message."""

    cfg: Config
    rd: RunDir  # the run dir (``run_dir``: its local copy; a bucket run's staging folder)
    ckpt: Checkpointer | None
    mesh: Mesh  # the training mesh
    decode_mesh: Mesh  # rollout's and eval's: ``mesh`` unless ``mesh.decode_tensor`` is set
    models: Models  # tokenizer and graph defs (the params live in ``state``)
    train_rows: list[MathExample]
    eval_rows: list[MathExample]
    encode: Callable[[MathExample], list[int]]  # a row's prompt tokens
    pipeline: PromptPipeline  # this host's prompt stream (its state is checkpointed)
    sampling: SamplingParams
    sched: TruncatedRolloutScheduler
    learner: Learner
    watch: CompileWatch
    grader: MathGrader
    metrics: MetricsWriter
    state: TrainState  # what the updates change
    start: int  # the step the run (re)started from
    eval_before: dict[str, Any] | None
    ref_policy: Any  # the KL reference (``algo.kl_coef > 0`` without LoRA), else None
    progress: bool

    def __init__(self, cfg: Config, run_dir: str | Path, *, resume: bool = False,
                 progress: bool = True) -> None:
        self._stack = contextlib.ExitStack()
        self.ckpt = None
        try:
            self._build(cfg, run_dir, resume, progress)
        except BaseException:
            if self.ckpt is not None:
                self.ckpt.close()
            self._stack.close()
            raise
        self._stack.callback(self.ckpt.close)  # closed first

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()

    @property
    def run_dir(self) -> Path:  # a bucket run's local staging copy
        return self.rd.local

    @property
    def primary(self) -> bool:  # process 0 writes the run dir's files
        return mh.is_primary()

    @property
    def step(self) -> int:
        """The steps completed (``state.step``, a device scalar, read to the host)."""
        return int(self.state.step)

    # -- building and restoring ---------------------------------------------------------

    def _build(self, cfg: Config, run_dir: str | Path, resume: bool, progress: bool) -> None:
        validate(cfg, num_devices=jax.device_count(), num_processes=jax.process_count())
        resolve_estimator(cfg.algo.advantage_baseline)  # a plugin: imported before the claim
        enable_compile_cache(cfg.train.compile_cache)
        self.cfg, self.start, self.eval_before = cfg, 0, None
        self.rd = rd = resolve_run_dir(run_dir, cfg.checkpoint.dir)
        # Released last: after every file is closed.
        self._stack.callback(claim_run_dir(rd, resume, train_steps=cfg.train.steps))
        self.ckpt = Checkpointer(rd.checkpoints, every=cfg.checkpoint.every,
                                 keep=cfg.checkpoint.keep)
        rd.local.mkdir(parents=True, exist_ok=True)
        if resume:  # the CLI's and the API's alike: no change the checkpoints forbid; then
            check_resume(rd.remote or rd.local, cfg)  # a bucket run's logs, so it appends
            pull(rd, only=None if self.primary else RUN_SUBDIR)  # (other hosts: warm-start)
        if self.primary:  # whole or not at all: a resume refuses a truncated config.yaml
            write_atomic(rd.local / "config.yaml", run_config_text(cfg))
        self.progress = progress and cfg.logging.progress
        m, r = cfg.mesh, cfg.rollout
        self.mesh = make_mesh({"data": m.data, "fsdp": m.fsdp, "tensor": m.tensor})
        # Rollout's and eval's mesh: the training mesh unless mesh.decode_tensor is set
        self.decode_mesh = decode_mesh(self.mesh, m.decode_tensor) if m.decode_tensor else self.mesh
        rows = load_data(cfg)  # read and checked before a warm-start or model load costs time
        check_reward(cfg.reward, rows[0][:1])  # reward.fn imported and called once: up front
        self.models, params = load_models(cfg, rd.local, self.progress, self.mesh)
        self.train_rows, self.eval_rows, self.encode = prompt_rows(cfg, self.models.tokenizer,
                                                                   rows)
        self.pipeline = PromptPipeline(self.train_rows, batch_size=1, seed=cfg.data.seed,
                                       shard_index=jax.process_index(),
                                       shard_count=jax.process_count())
        self.sampling = SamplingParams(r.temperature, r.top_p, r.top_k)
        # Decode-layout param shardings, or None: rollout reads the params as trained
        self.decode_shardings = decode_shardings(cfg, self.models.policy_def, params.policy,
                                                 self.decode_mesh)
        # The held-out eval's decode engines: compiled at the first eval, reused by the rest
        self.eval_engines = EvalEngines()
        keep_p, keep_v = trainable_keys(cfg)  # LoRA: AdamW states for the adapters alone
        # model.param_dtype: float32 masters (and AdamW moments) of a bfloat16 model; the
        # compile path lays out this same function's abstract result (learner/init.py)
        state = init_state(params.policy, params.value, LearnerConfig.from_config(cfg),
                           trainable=(keep_p, keep_v), mesh=self.mesh)
        del params  # the params live in TrainState from here: no second copy
        self.state = state  # before a restore: the template of its checkpoint
        # The policy RL started from, for algo.kl_coef > 0 (else None), made before a resume
        # restores the trained params so a resumed run keeps the same reference. LoRA: the
        # frozen base is the reference (adapters zeroed inside the loss): no copy.
        copy_ref = cfg.algo.kl_coef > 0 and keep_p is None
        self.ref_policy = (reference_copy(compute_copy(self.state.policy, cfg)) if copy_ref
                           else None)
        self.sched = self.scheduler()
        if resume:
            self.restore()
        self.learner = Learner(self.models.policy_def, self.models.value_def,
                               LearnerConfig.from_config(cfg), mesh=self.mesh,
                               state=self.state, trainable=(keep_p, keep_v))
        # Compiles of the learner's row-group programs, and of everything else while open
        self.watch = CompileWatch(self.learner.compiled_fns())
        self.grader = MathGrader.from_config(cfg.reward, cfg.data.format)
        self._stack.callback(self.grader.close)
        # Rows past the restored step are dropped (logged again); nothing restored: none are.
        self.metrics = MetricsWriter(rd.local, tensorboard=cfg.logging.tensorboard,
                                     resume_step=self.start or None, wandb=wandb_settings(cfg))
        self._stack.callback(self.metrics.close)
        self._skipped_in_a_row = 0  # consecutive steps with a skipped (non-finite) update

    def scheduler(self, *, window: int | None = None, pipeline: PromptPipeline | None = None,
                  seed: int | None = None) -> TruncatedRolloutScheduler:
        """A rollout scheduler sampling from ``state``'s policy; ``window`` / ``pipeline`` /
        ``seed`` replace the config's window, the run's prompt stream and ``train.seed``
        (value pretraining's full-length rollouts on a stream of their own)."""
        cfg = self.cfg
        r = cfg.rollout if window is None else dataclasses.replace(cfg.rollout, window=window)
        prompts = (b[0] for b in (self.pipeline if pipeline is None else pipeline))
        return TruncatedRolloutScheduler(
            self.policy_module(), prompts, self.encode, r, eos_ids=self.models.tokenizer.eos_ids,
            sampling=self.sampling, seed=cfg.train.seed if seed is None else seed,
            mesh=self.decode_mesh)

    def pretrain_parts(self) -> PretrainParts:
        """The run's parts value pretraining works with (``value_pretrain.py``)."""
        return PretrainParts(
            self.cfg, self.learner, self.mesh, self.train_rows,
            lambda window, pipeline, seed: self.scheduler(window=window, pipeline=pipeline,
                                                          seed=seed),
            self.collect, self.watch, self.run_dir, self.progress)

    def checkpoint_trees(self) -> dict[str, Any]:
        """Every tree a checkpoint holds, by item name (also the templates a restore reads
        into); with LoRA the models' items hold only what trains (``weights/params.py``)."""
        return {**saved_items(self.state.items(), self.cfg), **self.sched.checkpoint_items()}

    def checkpoint_meta(self) -> dict[str, Any]:
        """Each host's data iterator and scheduler state, gathered (process 0 writes it)."""
        return {"step": self.step, "eval_before": self.eval_before,
                "num_processes": jax.process_count(),
                "hosts": mh.gather_json({"data_state": self.pipeline.state_json(),
                                         "scheduler": self.sched.host_state()})}

    def restore(self) -> None:
        """The newest checkpoint whose manifest verifies (damaged ones are reported, set
        aside): params, optimizer states, data iterator and scheduler; nothing when there
        is none."""
        restored = self.ckpt.restore_latest(self.checkpoint_trees())
        if restored is None:
            return
        _, trees, meta = restored
        self.start = int(meta["step"])
        self.state = TrainState.from_items(with_frozen(trees, self.state.items(), self.cfg),
                                           self.start, self.mesh)
        host = host_meta(meta)
        self.pipeline.load_state_json(host["data_state"])
        self.sched.restore(trees, host["scheduler"])
        self.sched.set_policy(self.policy_module(), self.sched.policy_version)
        if "eval_before" in meta:
            self.eval_before = meta["eval_before"]
        log.info("resumed from step %d", self.start)

    # -- the policy, evaluated ----------------------------------------------------------

    def policy_module(self, state: TrainState | None = None) -> nnx.Module:
        """The policy rollouts and evals decode with (of ``state``, default the run's): the
        trained params, or (decode layout) a copy moved to the decode shardings."""
        return self._policy_module(self.state if state is None else state)[0]

    def _policy_module(self, state: TrainState) -> tuple[nnx.Module, Reshard | None]:
        """``policy_module``, and with a decode layout how long its reshard took and how many
        bytes it copied (``None`` in the training layout: nothing moves)."""
        # The decode copy is in model.dtype (cast from float32 masters)
        policy = compute_copy(state.policy, self.cfg)
        if self.decode_shardings is None:
            return nnx.merge(self.models.policy_def, policy), None
        t0 = time.perf_counter()
        params = jax.block_until_ready(reshard(policy, self.decode_shardings))
        moved = Reshard(time.perf_counter() - t0,
                        sum(x.nbytes for x in jax.tree.leaves(params)))
        return nnx.merge(self.models.policy_def, params), moved

    def evaluate(self) -> dict[str, Any]:
        """Held-out accuracy under the ``run`` protocol (``eval.protocol``): avg@k sampled
        as in training (the headline) and greedy, of the run's policy."""
        p = run_protocol(self.cfg)
        kw = dict(max_prompt_len=self.cfg.rollout.max_prompt_len, max_response_len=p.max_tokens,
                  mesh=self.decode_mesh, engines=self.eval_engines)
        tok, policy = self.models.tokenizer, self.policy_module()  # one reshard
        sampled = evaluate(policy, tok, self.eval_rows, self.encode, self.grader,
                           k=p.samples, sampling=p.sampling, seed=p.seed, **kw)
        greedy = evaluate(policy, tok, self.eval_rows, self.encode, self.grader, **kw)
        return eval_record(sampled, greedy, p.samples)

    def evaluate_before(self) -> dict[str, Any]:
        """The held-out eval before training: from the checkpoint or the run dir on a
        resume, else run now; written to ``eval_before.json``."""
        if self.eval_before is None:
            if self.start:
                self.eval_before = json.loads((self.run_dir / "eval_before.json").read_text())
            else:
                self.eval_before = self.evaluate()
                self.metrics.write_eval(self.step, "before", self.eval_before)
                self._warn_no_answer()
        if self.primary:
            (self.run_dir / "eval_before.json").write_text(json.dumps(self.eval_before))
        return self.eval_before

    def _warn_no_answer(self) -> None:
        """Warns when the starting policy's sampled answers almost never hold an answer the
        grader reads: every reward would be the no-answer one and the run would learn
        nothing."""
        fmt = answer_format_for(self.cfg.data.format, self.cfg.reward.answer_format)
        warn = no_answer_warning(self.eval_before.get("no_answer"), fmt)
        if warn and self.primary:
            log.warning("eval before training: %s", warn.removeprefix("warning: "))

    # -- fitting ------------------------------------------------------------------------

    def fit(self, hooks: TrainHooks | None = None) -> dict[str, Any]:
        """Evaluates, pretrains the critic (VAPO, off the clock), trains from ``start`` to
        ``train.steps`` (or the target accuracy, the time budget, a preemption), evaluates
        again; returns the run's summary."""
        hooks, cfg = hooks or TrainHooks(), self.cfg
        before = self.evaluate_before()
        self.state = pretrain_value(self.pretrain_parts(), self.state,  # value_pretrain_steps
                                    resumed=bool(self.start))
        t_start = time.time()
        bar = tqdm(range(self.start, cfg.train.steps), desc="T-PPO", dynamic_ncols=True,
                   disable=not (self.progress and self.primary), initial=self.start,
                   total=cfg.train.steps)
        # Wall-clock of training steps only (held-out evals excluded), continued on resume.
        train_time = float(self.metrics.last.get("train_time_s", 0.0))
        last_eval, preempted = train_time, False  # training wall-clock at the last eval
        # Open until the run closes: a SIGTERM during the last eval is not a kill.
        stopper = self._stack.enter_context(StopOnSignal())
        self._stack.enter_context(self.watch)
        for _ in bar:
            self.watch.reset()  # held-out evals between steps are not step time
            roll = self.collect()
            upd = self.update(roll, hooks)
            row = self.log(roll, upd, train_time)
            train_time += time.time() - roll.t0
            bar.set_postfix(reward=f"{row['reward_mean']:.2f}", fin=int(row["finished"]))
            target_hit, last_eval = self._maybe_evaluate(train_time, last_eval)
            preempted, time_up = self._stop_flags(stopper, train_time)
            stop = target_hit or time_up
            self.checkpoint(last=self.step == cfg.train.steps or stop or preempted)
            if preempted:
                log.warning("preempted: checkpoint saved at step %d", self.step)
                break
            if stop:
                log.info("stopping at step %d (target accuracy or time budget reached)",
                         self.step)
                break
        after = self.evaluate() if not preempted else None
        if after is not None:
            self.metrics.write_eval(self.step, "after", after)
        return {"eval_before": before, "eval_after": after,
                "steps": self.step, "preempted": preempted,
                "train_seconds": time.time() - t_start,
                "run_dir": self.rd.remote or str(self.run_dir)}

    def collect(self, sched: TruncatedRolloutScheduler | None = None) -> Rollout:
        """One rollout window over every slot (of ``sched``, default the run's), graded."""
        return collect(self.sched if sched is None else sched, self.models.tokenizer,
                       self.grader, self.cfg, self.watch)

    def update(self, roll: Rollout, hooks: TrainHooks | None = None) -> Update:
        """``Learner.step`` on the rollout (targets, then the policy's and the critic's
        updates; ``state.step`` goes one on), then the scheduler samples from the new
        policy and frees the finished rows' slots."""
        cfg, state = self.cfg, self.state
        step = self.step  # 0-based: the steps done so far
        edit = (None if hooks is None or hooks.before_update is None
                else partial(hooks.before_update, step))
        state, out, batch, rows = learn_from(
            self.learner, state, roll, cfg, self.mesh, step,
            first=step == 0 and not cfg.algo.value_pretrain_steps,  # else pretraining's step 0
            ref=self.ref_policy, edit_targets=edit,
            # no critic: nothing to warm up
            train_policy=step >= cfg.algo.critic_warmup_steps or state.value is None)
        pstats, vstats, adv = mh.tree_to_host((out.policy, out.value, out.advantages))
        vstats = {**vstats, **adv}
        skipped = (float(pstats.get("policy_skipped", 0.0))
                   + float(vstats.get("value_skipped", 0.0)))
        self._skipped_in_a_row = self._skipped_in_a_row + 1 if skipped else 0
        if self._skipped_in_a_row >= cfg.train.max_skipped_updates:
            raise TrainingDiverged(
                f"step {step + 1}: non-finite loss or gradient in {self._skipped_in_a_row} "
                f"consecutive steps (updates skipped, params unchanged); last checkpoint: "
                f"step {self.ckpt.latest_step()} in {self.ckpt.directory}")
        n_compiles, compile_s = self.watch.take()
        t_update = time.time() - roll.t0 - roll.t_roll - roll.t_grade
        width, nrows = batch.shape[1], len(rows.finished)
        # After warm-up a function that has compiled should only meet known shapes (the row
        # groups' (rows, width) pairs are bounded, so new ones become rare).
        late = [k for k, (n0, _) in self.watch.new_shapes().items()
                if n0 and step > self.start + 2]
        if late:
            log.warning("step %d: %s compiled a new shape (batch width %d, critic rows %d); "
                        "shapes so far: %s", step + 1, ", ".join(late), width, nrows,
                        self.watch.sizes())
        self.state = state
        policy, moved = self._policy_module(self.state)
        self.sched.set_policy(policy, step + 1)
        self.sched.release_finished(roll.rb.finished)
        return Update(pstats, vstats, width, nrows, out.policy_cells, out.value_cells,
                      n_compiles, compile_s, t_update, moved)

    def log(self, roll: Rollout, upd: Update, train_time: float = 0.0) -> dict[str, Any]:
        """Writes the step's metrics (``step_log.step_metrics``) and sample completions;
        returns the metrics row."""
        row = self.metrics.write(self.step, step_metrics(
            self.cfg, self.step, roll, upd, self.sched, self.watch, train_time))
        self.metrics.write_samples(self.step, roll.samples)
        return row

    def checkpoint(self, *, last: bool) -> None:
        """Saves on schedule and at the ``last`` step; a bucket run's files are mirrored
        after."""
        # Built only for a save: the host-state gather and slot upload are not free.
        if (last or self.ckpt.due(self.step)) and self.ckpt.save(
                self.step, self.checkpoint_trees(), self.checkpoint_meta(),
                force=True) and self.primary:
            mirror(self.rd)

    def write_summary(self, summary: dict[str, Any]) -> None:
        """``summary.json`` (process 0), then a bucket run's files are mirrored."""
        if self.primary:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            mirror(self.rd)

    def _maybe_evaluate(self, train_time: float, last_eval: float) -> tuple[bool, float]:
        """The held-out eval when ``eval_due``. Returns (it reached
        ``train.target_accuracy``, the training wall-clock of the last eval)."""
        tc = self.cfg.train
        # Every host decides on the primary's clock: the hosts must run the eval together.
        due = mh.max_over_hosts({"due": self.primary and eval_due(
            tc, self.step, train_time, last_eval)})["due"]
        if not due:
            return False, last_eval
        res = self.evaluate()  # identical on every host
        self.metrics.write(self.step, {f"eval_{k}": v for k, v in res.items()})
        self.metrics.write_eval(self.step, "during", res, loggers=False)
        return (tc.target_accuracy is not None and res["accuracy"] >= tc.target_accuracy,
                train_time)

    def _stop_flags(self, stopper: StopOnSignal, train_time: float) -> tuple[bool, bool]:
        """(preempted, time budget spent). The budget counts training wall-clock, held-out
        evals excluded. Clocks and signals differ per host: stop when any host says so, all
        together."""
        budget = self.cfg.train.time_budget_s
        flags = mh.max_over_hosts({
            "preempted": stopper.requested,
            "time_up": budget is not None and train_time >= budget})
        return bool(flags["preempted"]), bool(flags["time_up"])
