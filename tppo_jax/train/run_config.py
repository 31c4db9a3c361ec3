"""A resumed run's config: the run's own ``config.yaml``, with command-line changes on top.

``tppo train --run-dir RUN --resume`` continues the run as it was configured, whatever
config file or defaults are around. Changes are allowed where the checkpoint does not
fix the value (steps, eval cadence, learning rates, loss knobs, logging, the mesh: Orbax
restores into any sharding); keys that shape the checkpointed state or the data order
(model, rollout slots/lengths and cache layout, data, seeds, the warm-start) are refused
in one line.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

from etils import epath

from tppo_jax.config import Config, ConfigError, load_config

log = logging.getLogger(__name__)

# Whole sections, then single keys, that cannot change once a run has checkpoints.
FROZEN_SECTIONS = ("model", "data")
FROZEN_KEYS = (
    "rollout.prompts_per_step", "rollout.group_size", "rollout.max_prompt_len",
    "rollout.max_response_len", "rollout.window", "rollout.kv_policy", "rollout.kv_cache",
    "rollout.page_size", "rollout.num_pages", "train.seed", "train.warmstart_steps",
    "train.warmstart_lr", "train.warmstart_batch", "train.warmstart_batching",
)
MUTABLE_IN_FROZEN = ("data.on_bad_row",)


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "fields":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def changes(old: Config, new: Config) -> dict[str, tuple[Any, Any]]:
    """``{"section.key": (old, new)}`` for every value that differs."""
    a, b = _flat(old.to_dict()), _flat(new.to_dict())
    return {k: (a[k], b[k]) for k in a if a[k] != b[k]}


def frozen(key: str) -> bool:
    """Whether ``key`` may not change in a resumed run."""
    if key in MUTABLE_IN_FROZEN:
        return False
    return key in FROZEN_KEYS or key.split(".", 1)[0] in FROZEN_SECTIONS


def resume_config(run_dir: str, config: str | None, overrides: list[str]) -> Config | None:
    """The config a resume of ``run_dir`` runs with: the run's own, plus ``overrides`` (or
    the differences of ``config`` + ``overrides`` from it, when a config is named). None
    when the run dir has no ``config.yaml`` yet (a fresh start). Changes are logged; a
    change to a frozen key is a ``ConfigError`` naming every such key."""
    path = epath.Path(run_dir) / "config.yaml"  # a local folder or a bucket URL
    if not path.exists():
        return None
    with tempfile.TemporaryDirectory() as tmp:  # load_config reads local files
        local = Path(tmp) / "config.yaml"
        local.write_text(path.read_text())
        saved = load_config(local)
        cfg = load_config(config if config is not None else local, overrides)
    diff = changes(saved, cfg)
    refused = [f"{k} ({a!r} -> {b!r})" for k, (a, b) in diff.items() if frozen(k)]
    if refused:
        raise ConfigError(f"--resume cannot change {', '.join(refused)}: the run's checkpoints "
                          f"and data order depend on it; start a new --run-dir instead")
    for k, (a, b) in diff.items():
        log.info("resume: %s changed from %r to %r (run config: %s)", k, a, b, path)
    if not diff:
        log.info("resume: with the run's own config (%s)", path)
    return cfg
