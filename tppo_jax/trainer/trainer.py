"""Setting up a training run from its ``Config``: run dir and checkpoints, mesh, models,
data and prompts, optimizers, the rollout scheduler, the jitted steps on the mesh, grader,
metrics, and (``--resume``) the newest good checkpoint.

``setup()`` returns a ``Trainer`` (everything that stays fixed while training) and the
``TrainState`` the loop starts from; ``trainer/loop.py`` only reads the ``Trainer``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tppo_jax.config import Config, ConfigError, validate
from tppo_jax.data.pipeline import PromptPipeline
from tppo_jax.data.readers import MathExample
from tppo_jax.data.run_data import load_data, prompt_rows
from tppo_jax.eval.heldout import EvalEngines
from tppo_jax.learner import (
    Learner,
    LearnerConfig,
    TrainState,
    commit_to_mesh,
    policy_optimizer,
    value_optimizer,
)
from tppo_jax.models.lora import add_lora, lora_spec
from tppo_jax.models.tokenizer import Tokenizer
from tppo_jax.models.transformer import param_shardings, shard_model
from tppo_jax.models.value import ValueModel
from tppo_jax.parallel import multihost as mh
from tppo_jax.parallel.mesh import decode_mesh, layout_rules, make_mesh
from tppo_jax.rewards.grader import MathGrader
from tppo_jax.rollout.decode import SamplingParams
from tppo_jax.rollout.scheduler import TruncatedRolloutScheduler
from tppo_jax.trainer.checkpoint import Checkpointer, record_model
from tppo_jax.trainer.compile_watch import CompileWatch, enable_compile_cache
from tppo_jax.trainer.ema import with_ema
from tppo_jax.trainer.metrics import MetricsWriter
from tppo_jax.trainer.policy_view import policy_module
from tppo_jax.trainer.resume import restore
from tppo_jax.trainer.run_claim import claim_run_dir
from tppo_jax.trainer.run_config import run_config_text
from tppo_jax.trainer.run_dir import (
    RunDir,
    pull,
    resolve_run_dir,
    write_atomic,
)
from tppo_jax.trainer.trainable import (
    share_base,
    shares_base,
    trainable_keys,
    trained_part,
)
from tppo_jax.trainer.wandb_log import wandb_settings
from tppo_jax.trainer.warmstart import RUN_SUBDIR, run_warmstart

log = logging.getLogger(__name__)


@dataclass
class Models:
    tokenizer: Tokenizer
    policy_def: Any
    policy: Any  # pure dict of params (None once a TrainState holds them)
    value_def: Any
    value: Any
    tokenizer_file: Path


@dataclass
class Trainer:
    """A training run's parts, fixed once set up (what the updates change is ``TrainState``).
    The fields after ``progress`` are built by ``setup()`` from the ones before them."""

    cfg: Config
    rd: RunDir  # the run dir: rd.local (a bucket run's local staging copy)
    mesh: Any  # the training mesh
    decode_mesh: Any  # rollout's and eval's: ``mesh`` unless mesh.decode_tensor is set
    models: Models  # tokenizer and graph defs (the params live in TrainState)
    train_rows: list[MathExample]
    eval_rows: list[MathExample]
    encode: Callable[[MathExample], list[int]]
    pipeline: PromptPipeline
    sampling: SamplingParams
    decode_shardings: Any  # decode-layout param shardings, or None (train layout)
    ckpt: Checkpointer
    progress: bool
    sched: TruncatedRolloutScheduler = field(init=False)
    learner: Learner = field(init=False)
    watch: CompileWatch = field(init=False)  # compiles of the learner's row-group programs
    grader: MathGrader = field(init=False)
    metrics: MetricsWriter = field(init=False)
    start: int = 0  # the step the run (re)starts from
    eval_before: dict[str, Any] | None = None
    # The policy RL started from, for algo.kl_coef > 0 (else None): made before a resume
    # restores the trained params, so a resumed run keeps the same reference
    ref_policy: Any = None
    # The held-out eval's decode engines: compiled at the first eval, reused by every later one
    eval_engines: EvalEngines = field(default_factory=EvalEngines)

    @property
    def run_dir(self) -> Path:
        return self.rd.local

    @property
    def primary(self) -> bool:  # process 0 writes the run dir's files
        return mh.is_primary()


def setup(cfg: Config, run_dir: str | Path, *, resume: bool, progress: bool,
          stack: contextlib.ExitStack) -> tuple[Trainer, TrainState]:
    """Builds the run; everything that needs closing is closed by ``stack`` (the checkpoint
    manager first: a failed save's last reports come out before the run's stop message)."""
    validate(cfg, num_devices=jax.device_count(), num_processes=jax.process_count())
    enable_compile_cache(cfg.train.compile_cache)
    rd = resolve_run_dir(run_dir, cfg.checkpoint.dir)
    # Released last: after every file is closed.
    stack.callback(claim_run_dir(rd, resume, train_steps=cfg.train.steps))
    ckpt = Checkpointer(rd.checkpoints, every=cfg.checkpoint.every, keep=cfg.checkpoint.keep)
    try:
        out = _build(cfg, rd, ckpt, resume, progress, stack)
    except BaseException:
        ckpt.close()
        raise
    stack.callback(ckpt.close)
    return out


def _build(cfg: Config, rd: RunDir, ckpt: Checkpointer, resume: bool, progress: bool,
           stack: contextlib.ExitStack) -> tuple[Trainer, TrainState]:
    rd.local.mkdir(parents=True, exist_ok=True)
    primary = mh.is_primary()
    if resume:  # a bucket run's logs, so the resumed run appends to them (other hosts:
        pull(rd, only=None if primary else RUN_SUBDIR)  # only the warm-start they load)
    if primary:  # whole or not at all: a resume refuses a truncated config.yaml
        write_atomic(rd.local / "config.yaml", run_config_text(cfg))
    progress = progress and cfg.logging.progress
    m, r = cfg.mesh, cfg.rollout
    mesh = make_mesh({"data": m.data, "fsdp": m.fsdp, "tensor": m.tensor})
    dmesh = decode_mesh(mesh, m.decode_tensor) if m.decode_tensor else mesh
    rows = load_data(cfg)  # read and checked before a warm-start or model load costs time
    models = load_models(cfg, rd.local, progress, mesh)
    train_rows, eval_rows, encode = prompt_rows(cfg, models.tokenizer, rows)
    pipeline = PromptPipeline(train_rows, batch_size=1, seed=cfg.data.seed,
                              shard_index=jax.process_index(), shard_count=jax.process_count())
    run = Trainer(cfg, rd, mesh, dmesh, models, train_rows, eval_rows, encode, pipeline,
              SamplingParams(r.temperature, r.top_p, r.top_k), decode_shardings(cfg, models, dmesh),
              ckpt, progress)
    tx_p, tx_v = policy_optimizer(cfg.optim), value_optimizer(cfg.optim)
    keep_p, keep_v = trainable_keys(cfg)  # LoRA: AdamW states for the adapters alone
    state = TrainState(models.policy, models.value,
                       commit_to_mesh(tx_p.init(trained_part(models.policy, keep_p)), mesh),
                       commit_to_mesh(tx_v.init(trained_part(models.value, keep_v)), mesh))
    models.policy = models.value = None  # the params live in TrainState: no second copy
    state = with_ema(state, cfg)  # before a restore: the template of its checkpoint item
    # LoRA: the reference is the frozen base (adapters zeroed inside the loss): no copy
    copy_ref = cfg.algo.kl_coef > 0 and keep_p is None
    run.ref_policy = reference_copy(state.policy) if copy_ref else None
    run.sched = make_scheduler(run, state)
    if resume:
        state = restore(run, state)
    run.learner = Learner(models.policy_def, models.value_def, LearnerConfig.from_config(cfg),
                          mesh=mesh, state=state, trainable=(keep_p, keep_v))
    run.watch = CompileWatch(run.learner.compiled_fns())
    run.grader = MathGrader.from_config(cfg.reward, cfg.data.format)
    stack.callback(run.grader.close)
    # Rows past the restored step are dropped (logged again); nothing restored: none are.
    run.metrics = MetricsWriter(rd.local, tensorboard=cfg.logging.tensorboard,
                                resume_step=run.start or None, wandb=wandb_settings(cfg))
    stack.callback(run.metrics.close)
    return run, state


def reference_copy(params: Any) -> Any:
    """A copy of ``params`` in their shardings that the updates cannot touch (they donate
    the buffers of the params they replace)."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True), params)


def decode_shardings(cfg: Config, models: Models, mesh: Any) -> Any:
    """The policy's param shardings in the decode layout (``mesh.decode_layout: decode``),
    else None: rollout then reads the params as the updates lay them out."""
    if cfg.mesh.decode_layout != "decode":
        return None
    return nnx.to_pure_dict(param_shardings(
        nnx.state(nnx.merge(models.policy_def, models.policy)), mesh,
        rules=layout_rules("decode")))


def make_scheduler(run: Trainer, state: TrainState, *, window: int | None = None,
                   pipeline: PromptPipeline | None = None, seed: int | None = None
                   ) -> TruncatedRolloutScheduler:
    """The run's rollout scheduler; ``window``/``pipeline``/``seed`` replace the config's
    window, the run's prompt stream and ``train.seed`` (value pretraining's full-length
    rollouts on a stream of their own)."""
    r = run.cfg.rollout if window is None else replace(run.cfg.rollout, window=window)
    prompts = (b[0] for b in (run.pipeline if pipeline is None else pipeline))
    return TruncatedRolloutScheduler(
        policy_module(run, state), prompts, run.encode, r, eos_ids=run.models.tokenizer.eos_ids,
        sampling=run.sampling, seed=run.cfg.train.seed if seed is None else seed,
        mesh=run.decode_mesh)


def load_models(cfg: Config, run_dir: Path, progress: bool, mesh=None) -> Models:
    """The tokenizer, the policy (``load_policy``) and the critic (``model.value_init``);
    with ``model.lora_rank > 0`` each gets fresh adapters (the critic when
    ``model.value_lora``); then every param is placed on ``mesh``."""
    tok, policy, tok_file = load_policy(cfg, run_dir, progress, mesh)
    critic = load_critic(cfg, policy, mesh)  # from the plain policy: before its adapters
    spec = lora_spec(cfg.model)
    if spec is not None:
        add_lora(policy, spec, seed=cfg.train.seed)
        if cfg.model.value_lora:
            add_lora(critic, spec, seed=cfg.train.seed + 1)
    if mesh is not None:  # params carry their named shardings from here on
        shard_model(policy, mesh)
        shard_model(critic, mesh)
    pdef, pstate = nnx.split(policy)
    vdef, vstate = nnx.split(critic)
    pparams, vparams = nnx.to_pure_dict(pstate), nnx.to_pure_dict(vstate)
    if shares_base(cfg):  # one frozen base for both models
        vparams = share_base(pparams, vparams)
    return Models(tok, pdef, pparams, vdef, vparams, tok_file)


def load_policy(cfg: Config, run_dir: Path, progress: bool, mesh=None
                ) -> tuple[Tokenizer, Any, Path]:
    """``(tokenizer, policy, tokenizer file)`` of the run's starting model, without adapters.
    Tiny default: warm-started (the run dir's own copy, else the cache in its parent).
    HF: loaded from disk. GGUF: converted once to an HF folder (cached in the run dir's
    parent), then as HF."""
    if cfg.model.source == "tiny":
        tok, policy, folder = run_warmstart(cfg, run_dir, progress=progress, mesh=mesh)
        return tok, policy, folder / "tokenizer.model"
    from tppo_jax.models.hf import from_pretrained

    path = model_folder(cfg, run_dir.parent)
    tok_file = next((p for p in (path / "tokenizer.json", path / "tokenizer.model")
                     if p.exists()), None)
    if tok_file is None:
        raise ConfigError(f"model.path {path}: no tokenizer.json or tokenizer.model found")
    tok = Tokenizer.load(tok_file)
    policy = from_pretrained(path, dtype=cfg.model.dtype, mesh=mesh,  # straight to shards
                             remat=cfg.model.remat, attention=cfg.model.attention)
    if mh.is_primary():  # the run's checkpoints then restore without model.path
        record_model(run_dir, path / "config.json", tok_file)
    return tok, policy, tok_file


def load_critic(cfg: Config, policy: Any, mesh=None) -> ValueModel:
    """The critic as ``model.value_init`` says: from ``policy``'s backbone (copied), from
    ``model.value_path``, or random."""
    if cfg.model.value_init == "path":
        from tppo_jax.models.hf import from_pretrained
        from tppo_jax.models.hub import resolve_model

        value_folder = resolve_model(cfg.model.value_path or "", "model.value_path")
        return ValueModel.from_policy(from_pretrained(value_folder, dtype=cfg.model.dtype,
                                                      mesh=mesh, remat=cfg.model.remat,
                                                      attention=cfg.model.attention))
    if cfg.model.value_init == "random":
        return ValueModel(policy.config, rngs=nnx.Rngs(cfg.train.seed + 1))
    # Sharing the (frozen) base: no transient copy of it either
    return ValueModel.from_policy(policy, seed=cfg.train.seed, copy=not shares_base(cfg))


def model_folder(cfg: Config, cache_root: Path) -> Path:
    """The HF folder of ``model.path``: as given, the snapshot of a Hub id in the HF cache
    (``models/hub.py``), or (``model.source: gguf``) the GGUF file's conversion in
    ``cache_root`` (process 0 converts; the others wait and read it)."""
    if cfg.model.source != "gguf":
        from tppo_jax.models.hub import resolve_model

        return Path(resolve_model(cfg.model.path or ""))
    from tppo_jax.models.gguf import GGUFError, cached_hf_folder, resolve_model_path

    try:
        gguf_file = resolve_model_path(cfg.model.path or "")
        if mh.is_primary():
            cached_hf_folder(gguf_file, cache_root)
        mh.barrier("gguf")
        return cached_hf_folder(gguf_file, cache_root)
    except GGUFError as e:
        raise ConfigError(str(e)) from None


