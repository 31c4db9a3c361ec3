"""The T-PPO training loop (docs/algorithm.md section 5), composed from the pieces below it.

``train()`` reads top to bottom: set up (warm-start, models, optimizers, scheduler,
grader, checkpoints), evaluate, then per step: rollout window -> grade finished rows ->
critic targets + EGAE -> independent policy and value updates -> free finished slots ->
log -> checkpoint; evaluate again at the end.

Multi-host (``jax.distributed``): every process runs this same loop. Each host reads its
own shard of the prompts, keeps its own ``slots / P`` rollout slots and grades its own rows;
batches go to the updates as global arrays (``parallel.multihost``), metrics are summed over
hosts, and only process 0 writes logs and summaries. Stop decisions (preemption, time
budget) are agreed by all hosts so no process leaves the loop alone.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from tppo_jax.config import Config, ConfigError, validate
from tppo_jax.data.pipeline import PromptPipeline
from tppo_jax.data.prompts import prompt_builder
from tppo_jax.data.readers import MathExample, read_examples
from tppo_jax.models.tokenizer import Tokenizer
from tppo_jax.models.transformer import param_shardings, shard_model
from tppo_jax.models.value import ValueModel
from tppo_jax.parallel import multihost as mh
from tppo_jax.parallel.mesh import data_parallel_size, layout_rules, make_mesh, reshard
from tppo_jax.rewards.math import MathGrader, answer_format_for, overlong_penalty
from tppo_jax.rollout.decode import SamplingParams
from tppo_jax.rollout.scheduler import RolloutBatch, TruncatedRolloutScheduler
from tppo_jax.train.checkpoint import Checkpointer, record_model
from tppo_jax.train.evaluate import evaluate
from tppo_jax.train.metrics import MetricsWriter
from tppo_jax.train.run_dir import mirror, pull, resolve_run_dir
from tppo_jax.train.shapes import CompileWatch, bucket_rows, bucket_width, enable_compile_cache
from tppo_jax.train.step import (
    StepConfig,
    make_optimizer,
    on_mesh,
    policy_update,
    rollout_targets,
    value_update,
)
from tppo_jax.train.warmstart import RUN_SUBDIR, run_warmstart, synthetic_task

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """Too many consecutive updates had a non-finite loss or gradient."""


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


@dataclass
class Models:
    tokenizer: Tokenizer
    policy_def: Any
    policy: dict
    value_def: Any
    value: dict
    tokenizer_file: Path


def load_models(cfg: Config, run_dir: Path, progress: bool, mesh=None) -> Models:
    """Tiny default: warm-started (the run dir's own copy, else the cache in its parent).
    HF: loaded from disk. GGUF: converted once to an HF folder (cached in the run dir's
    parent), then as HF."""
    if cfg.model.source == "tiny":
        tok, policy, folder = run_warmstart(cfg, run_dir, progress=progress, mesh=mesh)
        tok_file = folder / "tokenizer.model"
    else:
        from tppo_jax.models.hf import from_pretrained

        path = model_folder(cfg, run_dir.parent)
        tok_file = next((p for p in (path / "tokenizer.json", path / "tokenizer.model")
                         if p.exists()), None)
        if tok_file is None:
            raise ConfigError(f"model.path {path}: no tokenizer.json or tokenizer.model found")
        tok = Tokenizer.load(tok_file)
        policy = from_pretrained(path, dtype=cfg.model.dtype, mesh=mesh,  # straight to shards
                                 remat=cfg.model.remat)
        if mh.is_primary():  # the run's checkpoints then restore without model.path
            record_model(run_dir, path / "config.json", tok_file)
    if cfg.model.value_init == "path":
        from tppo_jax.models.hf import from_pretrained

        critic = ValueModel.from_policy(from_pretrained(cfg.model.value_path or "",
                                                        dtype=cfg.model.dtype, mesh=mesh,
                                                        remat=cfg.model.remat))
    elif cfg.model.value_init == "random":
        critic = ValueModel(policy.config, rngs=nnx.Rngs(cfg.train.seed + 1))
    else:
        critic = ValueModel.from_policy(policy, seed=cfg.train.seed)
    if mesh is not None:  # params carry their named shardings from here on
        shard_model(policy, mesh)
        shard_model(critic, mesh)
    pdef, pstate = nnx.split(policy)
    vdef, vstate = nnx.split(critic)
    return Models(tok, pdef, nnx.to_pure_dict(pstate), vdef, nnx.to_pure_dict(vstate), tok_file)


def model_folder(cfg: Config, cache_root: Path) -> Path:
    """The HF folder of ``model.path``: as given, or (``model.source: gguf``) its conversion
    in ``cache_root`` (process 0 converts; the others wait and read it)."""
    if cfg.model.source != "gguf":
        return Path(cfg.model.path or "")
    from tppo_jax.models.gguf import GGUFError, cached_hf_folder, resolve_model_path

    try:
        gguf_file = resolve_model_path(cfg.model.path or "")
        if mh.is_primary():
            cached_hf_folder(gguf_file, cache_root)
        mh.barrier("gguf")
        return cached_hf_folder(gguf_file, cache_root)
    except GGUFError as e:
        raise ConfigError(str(e)) from None


def load_data(cfg: Config) -> tuple[list[MathExample], list[MathExample]]:
    """(train, held-out) rows; prompts are built from them by ``data/prompts.py``."""
    d = cfg.data
    if d.source == "synthetic":
        task = synthetic_task(cfg)
        return task.sample(20000, "train"), task.sample(d.eval_size, "test")
    rows, report = read_examples(d.source, format=d.format, fields=d.fields or None,
                                 on_bad_row=d.on_bad_row)
    if report.num_bad:
        log.warning("data: skipped %d bad rows of %s", report.num_bad, d.source)
    if len(rows) <= d.eval_size:
        raise ConfigError(f"data.source {d.source} has {len(rows)} rows; need more than "
                          f"data.eval_size={d.eval_size}")
    return rows[:-d.eval_size], rows[-d.eval_size:]


def make_grader(cfg: Config) -> MathGrader:
    """The outcome grader as ``cfg.reward`` configures it (answer format per data format)."""
    rc = cfg.reward
    kw = {} if rc.error is None else {"error_reward": rc.error}
    return MathGrader(num_workers=rc.workers, item_timeout_s=rc.item_timeout_s,
                      batch_deadline_s=rc.batch_deadline_s,
                      max_tasks_per_child=rc.max_tasks_per_child,
                      correct_reward=rc.correct, wrong_reward=rc.wrong,
                      no_answer_reward=rc.no_answer, crash_retries=rc.crash_retries,
                      answer_format=answer_format_for(cfg.data.format, rc.answer_format),
                      mv_timeout_s=rc.verify_timeout_s, **kw)


def sample_rows(tok: Tokenizer, rb: RolloutBatch, rows: np.ndarray, texts: list[str],
                reward: np.ndarray, reasons: list[str], n: int) -> list[dict[str, Any]]:
    """The first ``n`` finished rows as readable records (prompt, completion, grade)."""
    out = []
    for j, i in enumerate(rows[:n]):
        prompt = tok.decode(rb.tokens[i, :int(rb.prompt_len[i])], skip_special=False)
        out.append({"prompt": prompt, "completion": texts[j], "answer": rb.examples[i].answer,
                    "reward": float(reward[i]), "reason": reasons[j]})
    return out


def batch_arrays(rb: RolloutBatch, reward: np.ndarray, correct: np.ndarray, mesh,
                 token_rewards: np.ndarray | None = None,
                 shuffle: np.ndarray | None = None) -> dict[str, jax.Array]:
    """The rollout as device arrays, split over the mesh's batch axes (global arrays of
    every host's rows when there are several processes).

    Columns are cut to the longest row (over all hosts) rounded up to a width bucket
    (``shapes.bucket_width``): the updates then cost what the batch needs, not the full
    buffer, and only a handful of widths ever compile. ``shuffle`` (``[B, epochs]`` random
    keys) orders the rows of each epoch's minibatches.
    """
    longest = mh.max_over_hosts({"len": int(rb.total_len.max())})["len"]
    width = bucket_width(int(longest), rb.tokens.shape[1])
    attn = np.arange(width)[None] < rb.total_len[:, None]
    arrays = {"tokens": rb.tokens[:, :width], "attn": attn, "prompt_len": rb.prompt_len,
              "window_start": rb.window_start, "window_len": rb.window_len,
              "finished": rb.finished, "reward": reward.astype(np.float32),
              "correct": correct.astype(bool),
              "sample_logprobs": rb.sample_logprobs[:, :width]}
    if token_rewards is not None:
        arrays["token_rewards"] = token_rewards[:, :width]
    if shuffle is not None:
        arrays["shuffle"] = shuffle.astype(np.float32)
    return {k: mh.host_to_global(v, mesh) for k, v in arrays.items()}


def value_rows(finished: np.ndarray, mesh, unit: int) -> jax.Array | None:
    """Global indices of the rows the critic trains on: this host's finished rows, padded with
    unfinished ones (value mask 0) to a row bucket agreed by all hosts; None when no host has
    a finished row (the critic update is then skipped, not run on nothing)."""
    fin = np.flatnonzero(finished)
    need = int(mh.max_over_hosts({"fin": len(fin)})["fin"])
    if need == 0:
        return None
    b, p = len(finished), jax.process_count()
    # Host-local bucket whose global total (x P hosts) still splits into `unit` parts.
    r = bucket_rows(need, b, max(unit // math.gcd(unit, p), 1))
    rows = np.concatenate([fin, np.flatnonzero(~finished)])[:r]
    return mh.host_to_global((rows + jax.process_index() * b).astype(np.int32), mesh)


def step_process_rewards(cfg: Config, tok: Tokenizer, rb: RolloutBatch, rows: np.ndarray
                         ) -> tuple[np.ndarray, float]:
    """Dense ``[B, S]`` process rewards for finished ``rows`` and their all-steps-valid rate."""
    from tppo_jax.rewards.process import process_rewards, step_token_ends
    from tppo_jax.rewards.step_verifier import verify_solution

    out = np.zeros(rb.tokens.shape, np.float32)
    valid = []
    for i in rows:
        ids = rb.response_tokens(int(i))
        text = tok.decode(ids)
        rep = verify_solution(text)
        valid.append(rep.all_valid)
        ends = step_token_ends(rep, text, tok, ids)
        pr = process_rewards([rep], [ends], [len(ids)], mode=cfg.reward.process,
                             penalty=cfg.reward.process_penalty,
                             step_bonus=cfg.reward.process_bonus, num_tokens=len(ids))
        a = int(rb.prompt_len[i])
        out[i, a:a + len(ids)] = pr[0]
    return out, float(np.mean(valid)) if valid else 0.0


def _on_mesh(tree: Any, mesh) -> Any:
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


def train(cfg: Config, run_dir: str | Path, *, resume: bool = False,
          progress: bool = True) -> dict[str, Any]:
    """Runs T-PPO; returns a summary (before/after held-out accuracy, steps, time).

    ``run_dir`` may be a bucket URL (``gs://...``): see ``train/run_dir.py``.
    """
    validate(cfg, num_devices=jax.device_count(), num_processes=jax.process_count())
    enable_compile_cache(cfg.train.compile_cache)
    rd = resolve_run_dir(run_dir, cfg.checkpoint.dir)
    run_dir = rd.local
    ckpt = Checkpointer(rd.checkpoints, every=cfg.checkpoint.every, keep=cfg.checkpoint.keep)
    if ckpt.latest_step() is not None and not resume:
        ckpt.close()
        raise ConfigError(f"{ckpt.directory} already has checkpoints: pass --resume to "
                          f"continue the run, or choose a new --run-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    primary = mh.is_primary()  # process 0 writes the run dir's files
    if resume:  # a bucket run's logs, so the resumed run appends to them (other hosts:
        pull(rd, only=None if primary else RUN_SUBDIR)  # only the warm-start they load)
    if primary:
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
    r, a = cfg.rollout, cfg.algo

    progress = progress and cfg.logging.progress
    m = cfg.mesh
    mesh = make_mesh({"data": m.data, "fsdp": m.fsdp, "tensor": m.tensor})
    models = load_models(cfg, run_dir, progress, mesh)
    tok = models.tokenizer
    train_rows, eval_rows = load_data(cfg)
    prompter = prompt_builder(cfg, tok)
    encode = lambda e: prompter.ids(e, tok)  # noqa: E731
    # A truncated prompt loses its question, so over-long prompts are skipped, not cut.
    fits = [e for e in train_rows if len(encode(e)) <= r.max_prompt_len]
    if len(fits) < len(train_rows):
        log.warning("data: skipped %d of %d prompts longer than rollout.max_prompt_len=%d",
                    len(train_rows) - len(fits), len(train_rows), r.max_prompt_len)
    if not fits:
        raise ConfigError(f"every prompt is longer than rollout.max_prompt_len="
                          f"{r.max_prompt_len} tokens")
    train_rows = fits
    eval_rows = [e for e in eval_rows if len(encode(e)) <= r.max_prompt_len] or eval_rows
    pipeline = PromptPipeline(train_rows, batch_size=1, seed=cfg.data.seed,
                              shard_index=jax.process_index(), shard_count=jax.process_count())
    prompts = (b[0] for b in pipeline)
    sampling = SamplingParams(r.temperature, r.top_p, r.top_k)
    scfg = StepConfig(algo=a, optim=cfg.optim, window=min(r.window, r.max_response_len),
                      temperature=r.temperature if r.temperature > 0 else 1.0)
    tx_p = make_optimizer(cfg.optim.policy_lr, cfg.optim)
    tx_v = make_optimizer(cfg.optim.value_lr, cfg.optim)
    opt_p = _on_mesh(tx_p.init(models.policy), mesh)
    opt_v = _on_mesh(tx_v.init(models.value), mesh)
    decode_shardings = None
    if cfg.mesh.decode_layout == "decode":
        decode_shardings = nnx.to_pure_dict(param_shardings(
            nnx.state(nnx.merge(models.policy_def, models.policy)), mesh,
            rules=layout_rules("decode")))

    def policy_model() -> nnx.Module:
        """The policy for rollout and eval: the trained params, or (decode layout) a copy
        moved to the decode shardings by one explicit reshard."""
        params = models.policy
        if decode_shardings is not None:
            params = reshard(params, decode_shardings)
        return nnx.merge(models.policy_def, params)

    sched = TruncatedRolloutScheduler(
        policy_model(), prompts, encode, slots=r.slots, group_size=r.group_size,
        max_prompt_len=r.max_prompt_len, max_response_len=r.max_response_len, window=r.window,
        eos_ids=tok.eos_ids, sampling=sampling, kv_policy=r.kv_policy, seed=cfg.train.seed,
        mesh=mesh, kv_cache=r.kv_cache, page_size=r.page_size, num_pages=r.num_pages)

    def ckpt_trees() -> dict[str, Any]:
        # Slots are host state: saved as one global array of every host's rows.
        slots = {k: mh.host_to_global(v, mesh) for k, v in sched.state.to_dict().items()}
        return {"policy": models.policy, "value": models.value, "policy_opt": opt_p,
                "value_opt": opt_v, "slots": slots, "kv_cache": sched.cache_state()}

    def ckpt_meta(step: int) -> dict[str, Any]:
        # Each host's data iterator and scheduler state, gathered (process 0 writes it).
        return {"step": step, "eval_before": before, "num_processes": jax.process_count(),
                "hosts": mh.gather_json({
                    "data_state": pipeline.state_json(),
                    "scheduler": {k: v for k, v in sched.state_dict().items()
                                  if k != "slots"}})}

    start, meta = 0, None
    # The newest checkpoint whose manifest verifies (damaged ones are reported, set aside).
    restored = ckpt.restore_latest(ckpt_trees()) if resume else None
    if restored is not None:
        _, trees, meta = restored
        models.policy, models.value = trees["policy"], trees["value"]
        opt_p, opt_v = _on_mesh(trees["policy_opt"], mesh), _on_mesh(trees["value_opt"], mesh)
        host = _host_meta(meta)
        pipeline.load_state_json(host["data_state"])
        sched.set_policy(policy_model(), host["scheduler"]["policy_version"])
        sched.load_state_dict({**host["scheduler"], "slots": trees["slots"]})
        sched.restore_cache(trees["kv_cache"])
        start = int(meta["step"])
        log.info("resumed from step %d", start)
    # The jitted steps, with the params' and optimizer states' shardings declared in and out.
    targets_fn = on_mesh(rollout_targets, mesh, models.value_def, models.value, cfg=scfg)
    policy_fn = on_mesh(policy_update, mesh, models.policy_def, models.policy, opt_p,
                        tx=tx_p, cfg=scfg)
    value_fn = on_mesh(value_update, mesh, models.value_def, models.value, opt_v,
                       tx=tx_v, cfg=scfg)

    # The critic's rows must still split into minibatches x micro-batches x batch-axis ways.
    row_unit = cfg.optim.minibatches * cfg.optim.grad_accum * data_parallel_size(mesh)
    watch = CompileWatch({"rollout_targets": targets_fn, "policy_update": policy_fn,
                          "value_update": value_fn})
    grader = make_grader(cfg)
    metrics = MetricsWriter(run_dir, tensorboard=cfg.logging.tensorboard,
                            resume_step=start if resume else None)
    def ev() -> dict[str, float]:
        """Held-out accuracy: avg@k sampled as in training (the headline) and greedy."""
        kw = dict(max_prompt_len=r.max_prompt_len, max_response_len=r.max_response_len)
        k = cfg.train.eval_samples
        sampled = evaluate(policy_model(), tok, eval_rows, encode, grader, k=k,
                           sampling=sampling, seed=cfg.train.seed, mesh=mesh, **kw)
        greedy = evaluate(policy_model(), tok, eval_rows, encode, grader, mesh=mesh, **kw)
        return {"accuracy": sampled[f"avg@{k}"], "greedy_accuracy": greedy["avg@1"],
                **sampled, **{f"greedy_{n}": v for n, v in greedy.items()}}

    if meta is not None and "eval_before" in meta:
        before = meta["eval_before"]
    elif start:
        before = json.loads((run_dir / "eval_before.json").read_text())
    else:
        before = ev()
    if primary:
        (run_dir / "eval_before.json").write_text(json.dumps(before))
    t_start = time.time()
    bar = tqdm(range(start, cfg.train.steps), desc="T-PPO", disable=not (progress and primary),
               dynamic_ncols=True, initial=start, total=cfg.train.steps)
    last_step = start
    # Wall-clock of training steps only (held-out evals excluded), continued on resume.
    train_time = float(metrics.last.get("train_time_s", 0.0))
    skipped_in_a_row = 0
    # Fault injection for the reliability tests: TPPO_FAULT_NAN_FROM_STEP=N makes every
    # update from step N on see NaN advantages and returns.
    fault = os.environ.get("TPPO_FAULT_NAN_FROM_STEP")
    fault_step = int(fault) if fault else None
    preempted = False
    stopper = _StopOnSignal()
    try:
        stopper.__enter__()
        watch.__enter__()
        for step in bar:
            watch.reset()  # held-out evals between steps are not step time
            t0 = time.time()
            rb = sched.step()
            idle = int((~sched.state.live).sum())  # paged pool short: slots left empty
            t_roll = time.time() - t0
            fin = np.flatnonzero(rb.finished)
            reward = np.zeros(sched.B, np.float32)  # this host's rows
            correct = np.zeros(sched.B, bool)
            counts: dict[str, int] = {}
            samples: list[dict[str, Any]] = []
            if len(fin):
                texts = [tok.decode(rb.response_tokens(i)) for i in fin]
                g = grader.grade(texts, [rb.examples[i].answer for i in fin])
                reward[fin], correct[fin], counts = g.rewards, g.correct, g.counts
                if cfg.reward.overlong_buffer > 0:  # DAPO soft overlong punishment
                    reward[fin] += overlong_penalty(
                        (rb.total_len - rb.prompt_len)[fin], r.max_response_len,
                        cfg.reward.overlong_buffer, cfg.reward.overlong_penalty)
                samples = sample_rows(tok, rb, fin, texts, reward, g.reasons,
                                      cfg.logging.samples_per_step)
            token_rewards, steps_valid = None, None
            if cfg.reward.process != "none" and len(fin):
                token_rewards, steps_valid = step_process_rewards(cfg, tok, rb, fin)
            t_grade = time.time() - t0 - t_roll
            n_roll, c_roll = watch.take()  # rollout-side compiles (decode shapes)
            arrays = batch_arrays(rb, reward, correct, mesh, token_rewards,
                                  shuffle=_shuffle_keys(cfg, step, sched.B))
            targets = targets_fn(models.value, arrays)
            train_batch = {**arrays, **targets}
            if fault_step is not None and step + 1 >= fault_step:
                train_batch["advantages"] = train_batch["advantages"] * float("nan")
                train_batch["returns"] = train_batch["returns"] * float("nan")
            # Dispatched back to back: neither update waits for the other's result.
            pstats: dict[str, Any] = {}
            if step >= a.critic_warmup_steps:
                models.policy, opt_p, pstats = policy_fn(models.policy, opt_p, train_batch)
            vrows = value_rows(rb.finished, mesh, row_unit)
            vstats: dict[str, Any] = {"value_loss": 0.0, "value_skipped": 0.0}
            if vrows is not None:  # the critic trains on finished rows only
                models.value, opt_v, vstats = value_fn(models.value, opt_v,
                                                       {**train_batch, "value_rows": vrows})
            pstats, vstats = mh.tree_to_host((pstats, vstats))  # replicated scalars
            skipped = float(pstats.get("policy_skipped", 0.0)) + float(vstats["value_skipped"])
            skipped_in_a_row = skipped_in_a_row + 1 if skipped else 0
            if skipped_in_a_row >= cfg.train.max_skipped_updates:
                raise TrainingDiverged(
                    f"step {step + 1}: non-finite loss or gradient in {skipped_in_a_row} "
                    f"consecutive steps (updates skipped, params unchanged); last checkpoint: "
                    f"step {ckpt.latest_step()} in {ckpt.directory}")
            n_comp, c_upd = watch.take()
            t_update = time.time() - t0 - t_roll - t_grade
            # After warm-up a function that has compiled should only meet known shapes.
            late = [k for k, (n0, _) in watch.new_shapes().items() if n0 and step > start + 2]
            if late:
                log.warning("step %d: %s compiled a new shape (width %d, critic rows %s); "
                            "shapes so far: %s", step + 1, ", ".join(late),
                            arrays["tokens"].shape[1],
                            None if vrows is None else vrows.shape[0], watch.sizes())
            sched.set_policy(policy_model(), step + 1)
            sched.release_finished(rb.finished)
            # Host-local counts summed over hosts, then turned into means.
            resp_len = rb.total_len - rb.prompt_len
            tot = mh.sum_over_hosts({
                "fin": len(fin), "reward": reward[fin].sum(), "correct": correct[fin].sum(),
                "resp_len": resp_len[fin].sum(), "rows": sched.B, "tokens": rb.window_len.sum(),
                "idle": idle, "steps_valid": (steps_valid or 0.0) * len(fin)})
            top = mh.max_over_hosts({"resp_len": resp_len.max(), "window": rb.window_len.max()})
            counts = _merge_counts(mh.gather_json({k: int(v) for k, v in counts.items()}))
            nfin = max(tot["fin"], 1.0)
            row = metrics.write(step + 1, {
                "reward_mean": tot["reward"] / nfin,
                "accuracy": tot["correct"] / nfin,
                "finished_frac": tot["fin"] / tot["rows"],
                "finished": int(tot["fin"]),
                "response_len_mean": tot["resp_len"] / nfin,
                "response_len_max": int(top["resp_len"]),
                "occupancy": tot["tokens"] / max(1.0, r.slots * top["window"]),
                "policy_loss": float(pstats.get("policy_loss", 0.0)),
                "value_loss": float(vstats["value_loss"]),
                **{k: float(v) for k, v in pstats.items() if k != "policy_loss"},
                **{k: float(v) for k, v in vstats.items() if k != "value_loss"},
                **{f"grade_{k}": v for k, v in counts.items()},
                **({"steps_all_valid_frac": tot["steps_valid"] / nfin}
                   if steps_valid is not None else {}),
                "tokens": int(tot["tokens"]),
                "idle_slots": int(tot["idle"]),
                # Compile seconds are split out of the phase they happened in.
                "time_rollout_s": t_roll - c_roll, "time_grading_s": t_grade,
                "time_update_s": t_update - c_upd, "time_compile_s": c_roll + c_upd,
                "compiles": n_roll + n_comp, "compiles_total": watch.total_count,
                # What the updates ran on (the cost model's update tokens: rows x width).
                "update_width": int(arrays["tokens"].shape[1]),
                "value_rows": 0 if vrows is None else int(vrows.shape[0]),
                **{f"compiled_shapes_{k}": v for k, v in watch.sizes().items()},
                "tokens_per_s": tot["tokens"] / max(time.time() - t0, 1e-9),
                "train_time_s": train_time + (time.time() - t0),
            })
            metrics.write_samples(step + 1, samples)
            train_time += time.time() - t0
            bar.set_postfix(reward=f"{row['reward_mean']:.2f}", fin=int(tot["fin"]))
            last_step = step + 1
            target_hit = False
            tc = cfg.train
            if tc.eval_every and (step + 1) % tc.eval_every == 0:
                res = ev()  # identical on every host
                metrics.write(step + 1, {f"eval_{k}": v for k, v in res.items()})
                target_hit = (tc.target_accuracy is not None
                              and res["accuracy"] >= tc.target_accuracy)
            # Clocks and signals differ per host: stop when any host says so, all together.
            flags = mh.max_over_hosts({
                "preempted": stopper.requested,
                "time_up": tc.time_budget_s is not None
                and time.time() - t_start >= tc.time_budget_s})
            preempted = bool(flags["preempted"])
            stop = target_hit or bool(flags["time_up"])
            is_last = step + 1 == cfg.train.steps or stop or preempted
            # Built only for a save: the host-state gather and slot upload are not free.
            if (is_last or ckpt.due(step + 1)) and ckpt.save(
                    step + 1, ckpt_trees(), ckpt_meta(step + 1), force=True) and primary:
                mirror(rd)
            if preempted:
                log.warning("preempted: checkpoint saved at step %d", step + 1)
                break
            if stop:
                log.info("stopping at step %d (target accuracy or time budget reached)", step + 1)
                break
        after = ev() if not preempted else None
    finally:
        watch.__exit__()
        stopper.__exit__()
        ckpt.close()
        metrics.close()
        grader.close()
    summary = {"eval_before": before, "eval_after": after, "steps": last_step,
               "preempted": preempted, "train_seconds": time.time() - t_start,
               "run_dir": rd.remote or str(run_dir)}
    if primary:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        mirror(rd)
    return summary


def _shuffle_keys(cfg: Config, step: int, rows: int) -> np.ndarray:
    """``[rows, epochs]`` random keys ordering this host's rows in each epoch's minibatches;
    a pure function of (seed, step, host), so a resumed run replays the same minibatches."""
    rng = np.random.default_rng([cfg.train.seed, step, jax.process_index(), 0x5EED])
    return rng.random((rows, cfg.optim.epochs), dtype=np.float32)


def _host_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """This host's part of a checkpoint's metadata (data iterator and scheduler state)."""
    if "hosts" not in meta:  # written by a single-host version without per-host state
        return meta
    n = int(meta.get("num_processes", len(meta["hosts"])))
    if n != jax.process_count():
        raise ConfigError(f"checkpoint at step {meta['step']} was written by {n} processes; "
                          f"this run has {jax.process_count()} (per-host data and rollout "
                          f"state cannot be re-split)")
    return meta["hosts"][jax.process_index()]


def _merge_counts(per_host: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for counts in per_host:
        for k, v in counts.items():
            out[k] = out.get(k, 0) + int(v)
    return out
