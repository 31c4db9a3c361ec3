"""A run's models: the tokenizer, the policy it starts from (warm-start, Hugging Face folder,
Hub id or GGUF file), the critic (``model.value_init``), their LoRA adapters and placement
on the mesh; the decode layout's shardings; a LoRA run's policy from its checkpoint (the
base rebuilt, the adapters restored and folded in) for ``tppo eval`` / ``export`` /
``serve``, so every reader gets a plain model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tppo_jax.config import Config, ConfigError
from tppo_jax.learner.estimators import needs_critic
from tppo_jax.models.lora import (
    add_lora,
    join_params,
    lora_spec,
    merge_lora,
    split_trainable,
)
from tppo_jax.models.tokenizer import Tokenizer
from tppo_jax.models.transformer import param_shardings, shard_model
from tppo_jax.models.value import ValueModel
from tppo_jax.parallel import multihost as mh
from tppo_jax.parallel.mesh import layout_rules
from tppo_jax.runs.checkpoint import Checkpointer, record_model
from tppo_jax.trainer.params import share_base, shares_base
from tppo_jax.trainer.warmstart import run_warmstart


@dataclass
class Models:
    tokenizer: Tokenizer
    policy_def: Any
    policy: Any  # pure dict of params (None once a TrainState holds them)
    value_def: Any  # None (and ``value``): a critic-free run (``estimators.needs_critic``)
    value: Any
    tokenizer_file: Path


def load_models(cfg: Config, run_dir: Path, progress: bool, mesh=None) -> Models:
    """The tokenizer, the policy (``load_policy``) and the critic (``model.value_init``; none
    when the estimator needs none); with ``model.lora_rank > 0`` each gets fresh adapters
    (the critic when ``model.value_lora``); then every param is placed on ``mesh``."""
    tok, policy, tok_file = load_policy(cfg, run_dir, progress, mesh)
    # From the plain policy: before its adapters
    critic = load_critic(cfg, policy, mesh) if needs_critic(cfg.algo) else None
    spec = lora_spec(cfg.model)
    if spec is not None:
        add_lora(policy, spec, seed=cfg.train.seed)
        if cfg.model.value_lora and critic is not None:
            add_lora(critic, spec, seed=cfg.train.seed + 1)
    if mesh is not None:  # params carry their named shardings from here on
        shard_model(policy, mesh)
        if critic is not None:
            shard_model(critic, mesh)
    pdef, pstate = nnx.split(policy)
    pparams = nnx.to_pure_dict(pstate)
    if critic is None:
        return Models(tok, pdef, pparams, None, None, tok_file)
    vdef, vstate = nnx.split(critic)
    vparams = nnx.to_pure_dict(vstate)
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


def decode_shardings(cfg: Config, models: Models, mesh: Any) -> Any:
    """The policy's param shardings in the decode layout (``mesh.decode_layout: decode``),
    else None: rollout then reads the params as the updates lay them out."""
    if cfg.mesh.decode_layout != "decode":
        return None
    return nnx.to_pure_dict(param_shardings(
        nnx.state(nnx.merge(models.policy_def, models.policy)), mesh,
        rules=layout_rules("decode")))


def reference_copy(params: Any) -> Any:
    """A copy of ``params`` in their shardings that the updates cannot touch (they donate
    the buffers of the params they replace)."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True), params)



def restore_lora_policy(cfg: Config, run_dir: Path, ckpt: Checkpointer, step: int | None,
                        *, merge: bool = True) -> tuple[Any, nnx.Module, int | None, Path]:
    """``(tokenizer, merged policy, step, tokenizer file)``: the adapters of ``step`` (default:
    the newest step whose policy verifies) on the run's base; with no checkpoint, the base
    itself (fresh adapters are zero) and step None. ``merge=False``: the policy with its
    adapters still apart (``tppo export`` writes them alone too). ``CheckpointError`` as
    ``Checkpointer.latest_good_item``."""
    spec = lora_spec(cfg.model)
    assert spec is not None, "not a LoRA run"
    tok, policy, tok_file = load_policy(cfg, run_dir, progress=False)
    graphdef, state = nnx.split(add_lora(policy, spec, seed=cfg.train.seed))
    adapters, frozen = split_trainable(nnx.to_pure_dict(state))
    found = ckpt.latest_good_item("policy", adapters, step)
    if found is not None:
        step, adapters = found
    model = nnx.merge(graphdef, join_params(adapters, frozen))
    return tok, merge_lora(model) if merge else model, step, tok_file
