"""A LoRA run's policy from its checkpoint, for ``tppo eval`` / ``export`` / ``serve``.

A LoRA run's checkpoints hold only the adapters (``trainer/trainable.py``): the base is rebuilt as
the run started it (``model.path``, or the run's warm-start), the adapters are restored onto
it and folded into its weights (``models.lora.merge_lora``), so every reader gets a plain
model: one decode path, and ``save_pretrained`` writes merged Hugging Face weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flax import nnx

from tppo_jax.config import Config
from tppo_jax.models.lora import add_lora, join_params, lora_spec, merge_lora, split_trainable
from tppo_jax.trainer.checkpoint import Checkpointer
from tppo_jax.trainer.ema import policy_item
from tppo_jax.trainer.trainer import load_policy


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
    found = ckpt.latest_good_item(policy_item(cfg), adapters, step)
    if found is not None:
        step, adapters = found
    model = nnx.merge(graphdef, join_params(adapters, frozen))
    return tok, merge_lora(model) if merge else model, step, tok_file
