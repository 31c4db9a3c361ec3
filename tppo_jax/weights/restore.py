"""A run's policy from its run directory: ``policy_from_run``, the one function ``tppo eval``,
``export``, ``serve`` and the benchmarks read a run's policy with.

Only the run directory is read: the policy is shaped from the model config and tokenizer the
run keeps (``warmstart/`` or ``model/``), and its params are the newest checkpoint whose policy
verifies (or the step asked for). A LoRA run's checkpoints hold only the adapters: the base is
rebuilt as the run started it and the adapters are joined back (folded in unless asked not
to). Imports beyond the standard library happen inside the functions, so the commands' help
stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tppo_jax.config_checks import ConfigError

if TYPE_CHECKING:
    from tppo_jax.config import Config
    from tppo_jax.models.tokenizer import Tokenizer
    from tppo_jax.runs.checkpoint import Checkpointer


@dataclass(frozen=True)
class LoadedPolicy:
    """A loaded policy and what it came from.

    ``cfg``/``step``: the run's config and checkpoint step (None for an HF folder; step 0:
    the run's starting policy); ``description``: how messages name it; ``ref``: what the user
    wrote."""

    model: Any
    tokenizer: Tokenizer
    tokenizer_file: Path
    description: str
    ref: str
    cfg: Config | None = None
    step: int | None = None


def is_run_dir(path: Path) -> bool:
    """A run directory of ours: its ``config.yaml`` beside the checkpoints."""
    return (path / "config.yaml").exists()


def run_config(run_dir: Path) -> Config:
    """A run directory's config, or a one-line error when ``run_dir`` is not one."""
    from tppo_jax.config import load_config

    if not is_run_dir(run_dir):
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml)")
    return load_config(run_dir / "config.yaml")


def policy_from_run(run_dir: Path, step: int | None = None, *, start: bool = False,
                    merge_lora: bool = True, ref: str | None = None) -> LoadedPolicy:
    """The policy of a run's checkpoint: ``step``'s, by default the newest whose policy
    verifies. ``start``: the policy the run started from (its warm-start or model, without
    adapters: what its eval before training scored) instead, as step 0. ``merge_lora``
    False: a LoRA run's policy with its adapters still apart (``tppo export`` writes them
    alone too). A run with no usable checkpoint (without ``start``), a step never saved or
    a damaged one is a one-line ``ConfigError``. ``ref``: what the user wrote (default:
    ``run_dir``)."""
    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    if start:
        if step is not None:
            raise ConfigError("--start and --step name different policies; give one")
        from tppo_jax.weights.start import start_policy

        tok, model, tok_file = start_policy(cfg, run_dir, progress=False)
        got = 0
    else:
        tok, model, got, tok_file = _checkpoint_policy(cfg, run_dir, step, merge_lora)
    return LoadedPolicy(model, tok, Path(tok_file),
                        f"{run_dir} (policy checkpoint of step {got})",
                        str(run_dir) if ref is None else ref, cfg, got)


def _checkpoint_policy(cfg: Config, run_dir: Path, step: int | None, merge_lora: bool
                       ) -> tuple[Tokenizer, Any, int, Path]:
    """``(tokenizer, policy, step, tokenizer file)`` of ``policy_from_run`` without
    ``start``."""
    from flax import nnx

    from tppo_jax.runs.checkpoint import Checkpointer, CheckpointError

    if step is None:
        require_checkpoint(run_dir, cfg)
    ckpt = Checkpointer(cfg.checkpoint.dir or run_dir / "checkpoints", every=0, keep=1000)
    try:
        if step is not None:
            require_step(ckpt, step)
        if cfg.model.lora_rank:  # adapters-only checkpoints: the base as the run started it
            tok, policy, got, tok_file = _lora_policy(cfg, run_dir, ckpt, step, merge_lora)
            return tok, policy, got or 0, tok_file
        tok, tok_file, pdef, template = _policy_template(cfg, run_dir, ckpt, step)
        # The newest (or the given) step whose policy files verify.
        found = ckpt.latest_good_item("policy", template, step)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    finally:
        ckpt.close()
    if found is not None:
        step, template = found
    return tok, nnx.merge(pdef, template), step or 0, tok_file


def _policy_template(cfg: Config, run_dir: Path, ckpt: Checkpointer, step: int | None
                     ) -> tuple[Tokenizer, Path, Any, Any]:
    """``(tokenizer, tokenizer file, graph def, params template)`` of a full-weight run's
    policy: shape-only from the model files the run dir keeps; the starting policy itself
    when the run has no checkpoint yet, or predates run dirs keeping their model files."""
    from tppo_jax.models.tokenizer import Tokenizer
    from tppo_jax.runs.checkpoint import MODEL_SUBDIR, run_model_files
    from tppo_jax.weights.abstract import abstract_policy
    from tppo_jax.weights.warmstart import RUN_SUBDIR

    files = run_model_files(run_dir, (RUN_SUBDIR, MODEL_SUBDIR))
    if files is not None and (step is not None or ckpt.latest_step() is not None):
        pdef, template = abstract_policy(files[0], cfg.model.dtype)
        return Tokenizer.load(files[1]), Path(files[1]), pdef, template
    from tppo_jax.weights.start import load_models

    models, params = load_models(cfg, run_dir, progress=False)
    return models.tokenizer, models.tokenizer_file, models.policy_def, params.policy


def _lora_policy(cfg: Config, run_dir: Path, ckpt: Checkpointer, step: int | None,
                 merge: bool) -> tuple[Tokenizer, Any, int | None, Path]:
    """``(tokenizer, policy, step, tokenizer file)``: the adapters of ``step`` (default: the
    newest step whose policy verifies) on the run's base, folded in with ``merge``; with no
    checkpoint, the base itself (fresh adapters are zero) and step None."""
    from flax import nnx

    from tppo_jax.models.lora import add_lora, join_params, lora_spec, merge_lora, split_trainable
    from tppo_jax.weights.start import start_policy

    spec = lora_spec(cfg.model)
    tok, policy, tok_file = start_policy(cfg, run_dir, progress=False)
    graphdef, state = nnx.split(add_lora(policy, spec, seed=cfg.train.seed))
    adapters, frozen = split_trainable(nnx.to_pure_dict(state))
    found = ckpt.latest_good_item("policy", adapters, step)
    if found is not None:
        step, adapters = found
    model = nnx.merge(graphdef, join_params(adapters, frozen))
    return tok, merge_lora(model) if merge else model, step, tok_file


def require_checkpoint(run_dir: Path, cfg: Config) -> None:
    """Refuses, in one line, a run with no checkpoint to load (none written, every one set
    aside as damaged, or a relative ``checkpoint.dir`` read from another working
    directory), before anything loads or creates a folder."""
    from tppo_jax.runs.checkpoint import checkpoint_path, listed_steps

    folder = checkpoint_path(cfg.checkpoint.dir or run_dir / "checkpoints")
    steps, damaged = listed_steps(folder)
    if steps:
        return
    if damaged:
        why = f"{folder} holds only checkpoints set aside as damaged ({', '.join(damaged)})"
    elif not folder.exists():
        why = f"no checkpoint folder {folder}"
    else:
        why = f"{folder} has no checkpoint"
    if cfg.checkpoint.dir and "://" not in cfg.checkpoint.dir and not Path(
            cfg.checkpoint.dir).is_absolute():
        why += f" (checkpoint.dir {cfg.checkpoint.dir!r} is relative to where the run started)"
    raise ConfigError(f"{run_dir} has no usable checkpoint: {why}; pass --start to use the "
                      f"run's starting policy")


def require_step(ckpt: Checkpointer, step: int) -> None:
    """Refuses a ``--step`` that was never saved (naming those that were), rather than
    reporting it as a damaged checkpoint."""
    saved = sorted(ckpt.mngr.all_steps())
    if step not in saved:
        shown = saved[-20:]  # one line: the newest, when a run keeps many
        have = ", ".join(map(str, shown)) if saved else "none"
        have = f"..., {have}" if len(saved) > len(shown) else have
        raise ConfigError(f"no checkpoint of step {step} in {ckpt.directory} "
                          f"(saved steps: {have})")
