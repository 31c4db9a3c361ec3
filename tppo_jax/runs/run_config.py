"""A resumed run's config: the run's own ``config.yaml``, with command-line changes on top.

``tppo train --run-dir RUN --resume`` continues the run as it was configured, whatever
config file or defaults are around. ``config.yaml`` is read strictly: an empty, truncated
or unreadable file is refused in one line (falling back to defaults would warm-start and
train another model under the run's name). Changes are allowed where the checkpoint does
not fix the value (steps, eval cadence, learning rates, loss knobs, logging, the mesh:
Orbax restores into any sharding); keys that shape the tokenizer, the warm-start, the
model, the checkpointed state or the data order are refused in one line (``frozen``).
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from pathlib import Path
from typing import Any

from etils import epath

from tppo_jax.config import MAX_CONFIG_BYTES, Config, ConfigError, load_config, safe_load_yaml
from tppo_jax.config_checks import quote

log = logging.getLogger(__name__)

# The one list of what a resume may not change. Prefixes (ending in "." or "_") cover every
# key under them, present and future: the model (and its tokenizer), the data (rows, split,
# synthetic task, prompts), the warm-start and its teacher corpus; then single keys that
# shape the checkpointed slots and KV cache or the RNG/data order.
FROZEN_PREFIXES = ("model.", "data.", "train.warmstart_")
FROZEN_KEYS = (
    "rollout.prompts_per_step", "rollout.group_size", "rollout.max_prompt_len",
    "rollout.max_response_len", "rollout.window", "rollout.kv_policy", "rollout.kv_cache",
    "rollout.page_size", "rollout.num_pages", "train.seed",
)
# data.on_bad_row only decides whether a bad row stops the run; the rows kept are the same.
MUTABLE_IN_FROZEN = ("data.on_bad_row",)
SECTIONS = tuple(f.name for f in dataclasses.fields(Config))  # every section config.yaml has
# The last line of every config.yaml a run writes: a file without it was cut short (or
# written by a version before it, when a missing frozen key is refused all the same).
END_MARKER = "# end of the run's config\n"


def run_config_text(cfg: Config) -> str:
    """``RUN/config.yaml``'s text: the config, then ``END_MARKER``."""
    return cfg.to_yaml() + END_MARKER


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
    """Whether ``key`` (``section.name``) may not change in a resumed run."""
    if key in MUTABLE_IN_FROZEN:
        return False
    return key in FROZEN_KEYS or key.startswith(FROZEN_PREFIXES)


def _why(e: BaseException) -> str:
    text = getattr(e, "strerror", None) or getattr(e, "reason", None) or str(e)
    return " ".join(str(text or type(e).__name__).split())[:160]


def parse_run_config(text: str) -> tuple[dict[str, Any] | None, str | None]:
    """``(sections, None)`` when ``text`` can be a ``config.yaml`` the trainer wrote, else
    ``(None, why not)``: every section present as a non-empty mapping and the file ending
    with a newline, as ``to_yaml`` writes it. A truncation at a line end loses whole
    sections (or leaves the last one empty); one inside a line leaves no final newline.
    Parsed by the config's bounded YAML reader (no aliases)."""
    if not text.strip():
        return None, "is empty"
    if not text.endswith("\n"):
        return None, "ends inside a line (truncated?)"
    try:
        data = safe_load_yaml(text, "config.yaml")
    except ConfigError as e:
        return None, f"cannot be parsed ({str(e).removeprefix('config.yaml: ')})"
    if not isinstance(data, dict):
        return None, "is not a mapping of config sections (truncated or overwritten?)"
    missing = [s for s in SECTIONS if s not in data]
    if missing:
        return None, (f"has no {', '.join(missing)} section{'s' * (len(missing) > 1)} "
                      f"(truncated?)")
    empty = [s for s in SECTIONS if not isinstance(data[s], dict) or not data[s]]
    if empty:
        return None, f"has an empty or malformed {', '.join(empty)} section (truncated?)"
    return data, None


def read_run_config(path: epath.Path) -> tuple[str, dict[str, Any]]:
    """The text and sections of a run's ``config.yaml``; ``ConfigError`` (one line, naming
    the file) when it cannot be read or cannot be the config the run was started with."""
    data, problem = None, None
    try:
        with path.open("rb") as f:  # read no further than a config can be
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            problem = f"is over {MAX_CONFIG_BYTES} bytes (a config is a few KiB)"
        else:
            text = raw.decode("utf-8")
            data, problem = parse_run_config(text)
    except (OSError, UnicodeDecodeError) as e:
        problem = f"cannot be read ({_why(e)})"
    if data is not None:
        return text, data
    raise ConfigError(f"{path} {problem}: --resume needs the run's own config; restore the "
                      f"file (nothing was changed), or start a new --run-dir")


def _check_missing_keys(text: str, data: dict[str, Any], path: epath.Path,
                        warn: bool = True) -> None:
    """Keys a config.yaml lacks take their defaults (keys a run written by an older version
    did not have yet), said once each (``warn``). Without ``END_MARKER`` the file may be cut
    short at a line end inside its last section: a missing key that shapes the checkpoint,
    the warm-start or the data order (``frozen``) is then refused, not guessed."""
    have = set(_flat(data))
    missing = {k: v for k, v in _flat(Config().to_dict()).items() if k not in have}
    if not text.endswith(END_MARKER):
        lost = [k for k in missing if frozen(k)]
        if lost:
            more = f" and {len(lost) - 3} more" if len(lost) > 3 else ""
            raise ConfigError(f"{path} has no {', '.join(lost[:3])}{more} (truncated?): "
                              f"--resume needs the run's own config; restore the file "
                              f"(nothing was changed), or start a new --run-dir")
    for key, value in missing.items():
        if warn:
            log.warning("resume: %s has no %s: using its default %r", path, key, value)


def _saved_and_new(path: epath.Path, config: str | None, overrides: list[str], *,
                   warn: bool = True) -> tuple[Config, Config]:
    """The run's saved config, and ``config`` (default: the saved one) with ``overrides``."""
    text, data = read_run_config(path)
    _check_missing_keys(text, data, path, warn)
    with tempfile.TemporaryDirectory() as tmp:  # load_config reads local files
        local = Path(tmp) / "config.yaml"
        local.write_text(text)
        try:
            saved = load_config(local)
        except ConfigError as e:  # name the run's file, not the temporary copy
            raise ConfigError(f"{path}: {str(e).replace(str(local), str(path))}") from None
        return saved, load_config(config if config is not None else local, overrides)


def refuse_frozen(saved: Config, cfg: Config) -> dict[str, tuple[Any, Any]]:
    """The changes from ``saved`` to ``cfg``; ``ConfigError`` naming every frozen key
    among them (the one check of the CLI's ``--resume`` and the API's ``resume=True``)."""
    diff = changes(saved, cfg)
    refused = [f"{k} ({quote(a)} -> {quote(b)})" for k, (a, b) in diff.items() if frozen(k)]
    if refused:
        raise ConfigError(f"--resume cannot change {', '.join(refused)}: the run's checkpoints, "
                          f"warm-start and data order depend on it; start a new --run-dir "
                          f"instead")
    return diff


def check_resume(run_dir: str | Path, cfg: Config) -> None:
    """A resume of ``run_dir`` with ``cfg`` (the Trainer's check, whoever built ``cfg``):
    ``ConfigError`` when the run's ``config.yaml`` is damaged or ``cfg`` changes a frozen
    key. Nothing when the run has no ``config.yaml`` yet (a fresh start)."""
    path = epath.Path(run_dir) / "config.yaml"
    if path.exists():
        refuse_frozen(_saved_and_new(path, None, [], warn=False)[0], cfg)


def resume_config(run_dir: str, config: str | None, overrides: list[str]) -> Config | None:
    """The config a resume of ``run_dir`` runs with: the run's own, plus ``overrides`` (or
    the differences of ``config`` + ``overrides`` from it, when a config is named). None
    when the run dir has no ``config.yaml`` yet (a fresh start). Changes are logged; a
    change to a frozen key is a ``ConfigError`` naming every such key, and so is a
    ``config.yaml`` that is empty, truncated or unreadable."""
    path = epath.Path(run_dir) / "config.yaml"  # a local folder or a bucket URL
    if not path.exists():
        return None
    saved, cfg = _saved_and_new(path, config, overrides)
    diff = refuse_frozen(saved, cfg)
    for k, (a, b) in diff.items():
        log.info("resume: %s changed from %s to %s (run config: %s)", k, quote(a), quote(b),
                 path)
    if not diff:
        log.info("resume: with the run's own config (%s)", path)
    return cfg
