"""Typed run configuration: building a ``Config`` from YAML and overrides.

A config is a tree of frozen dataclasses (``config_schema``: every key and its default,
re-exported here), loaded from YAML (``configs/*.yaml``) and overridden from the command line
as ``section.key=value``. Every value is validated before anything compiles
(``config_checks``); errors name the key (and the closest valid key for typos) in one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from tppo_jax.config_checks import ConfigError, quote, quote_name, validate
from tppo_jax.config_schema import (  # re-exported: callers import the sections from here
    AlgoConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    MeshConfig,
    ModelSettings,
    OptimConfig,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
)

__all__ = ["AlgoConfig", "CheckpointConfig", "Config", "ConfigError", "DataConfig",
           "LoggingConfig", "MeshConfig", "ModelSettings", "OptimConfig", "RewardConfig",
           "RolloutConfig", "TrainConfig", "configs_dir", "from_dict", "load_config",
           "parse_override", "read_config_file", "resolve_config_path", "safe_load_yaml",
           "validate"]


# ---- building from dicts --------------------------------------------------------------


def _closest(name: str, options: list[str], prefix: str = "") -> str:
    match = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    if match:
        return f"; did you mean {prefix + match[0]!r}?"
    return f"; valid keys: {', '.join(options)}"


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Checks ``value`` against the annotation ``tp`` (and converts ints to floats)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: {quote(value)} is not one of {list(args)}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: invalid value {quote(value)}")
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {quote(value)}")
        bad = next((k for k, v in value.items() if not isinstance(v, str)), None)
        if bad is not None:  # coerced, a number or a list would be a path that is no key
            raise ConfigError(f"{where}.{bad} must be a field name (text, dotted for nested "
                              f"keys), got {quote(value[bad])}")
        return {str(k): v for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {quote(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {quote(value)}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "3e-5" (no dot) as a string
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: expected a number, got {quote(value)}")
        try:
            out = float(value)
        except OverflowError:  # an int too large for a float
            out = math.inf
        if not math.isfinite(out):  # NaN slips through every `<`/`>` check in validate()
            raise ConfigError(f"{where}: expected a finite number, got {quote(value)}")
        return out
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {quote(value)}")
        return value
    return value


# Keys that were measured and removed (docs/log.md): a config that sets one to anything but
# its old default is refused in one line; its old default (written into every run dir's
# config.yaml before the removal) is read as absent, so those runs still resume.
REMOVED_KEYS: dict[str, tuple[Any, str]] = {
    "algo.detach_prefix": (False, "the policy update trains the whole prefix"),
    "algo.policy_trains": ("window", "the policy trains every live row's current window"),
    "algo.group_siblings": ("step", "the group baseline reads same-step siblings"),
    "algo.blame_from_first_error": (False, "advantages cover the whole window"),
    "algo.kl_estimator": ("k3", "the KL to the reference is the k3 estimate"),
    "reward.process": ("none", "rewards are outcome rewards"),
    "reward.process_penalty": (-0.5, "rewards are outcome rewards"),
    "reward.process_bonus": (0.05, "rewards are outcome rewards"),
    "optim.policy_ema": (0.0, "a run's result is its live policy"),
}


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {quote(data)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if path in REMOVED_KEYS:
            default, now = REMOVED_KEYS[path]
            if value == default:
                continue
            raise ConfigError(f"{path} was removed (measured and switched off; docs/log.md): "
                              f"{now}; drop the key")
        if key not in names:
            prefix = f"{where}." if where else ""
            hint = _closest(str(key), names, prefix)
            raise ConfigError(f"unknown config key {quote_name(path)}{hint}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            # An empty YAML section (None) means defaults; `model=0` or `model=[]` is an error.
            kwargs[key] = _build(tp, {} if value is None else value, path)
        else:
            kwargs[key] = _coerce(value, tp, path)
    return cls(**kwargs)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "fields":
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def parse_override(text: str) -> dict[str, Any]:
    """``"rollout.window=64"`` -> ``{"rollout": {"window": 64}}`` (value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override {quote(text)} must look like section.key=value")
    key, raw = text.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"override {quote(text)} has an empty key")
    value = safe_load_yaml(raw, f"override {quote_name(key)}") if raw.strip() else ""
    node: dict[str, Any] = {parts[-1]: value}
    for p in reversed(parts[:-1]):
        node = {p: node}
    return node


# ---- a bounded YAML reader ------------------------------------------------------------

MAX_CONFIG_BYTES = 1 << 20  # a config is a few KiB; anything near this is not one


class _NoAliasLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` without aliases and without duplicate keys. ``*name`` repeats a
    node, and repeats of repeats (a "billion laughs") grow a few hundred bytes into gigabytes;
    no config needs them. A key given twice in one mapping (two ``rollout:`` sections) would
    silently keep only the second."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _YamlRefused(f"line {event.start_mark.line + 1}: YAML aliases "
                               f"({quote('*' + str(event.anchor), 20)}) are not supported")
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in first:
                        raise _YamlRefused(f"duplicate key {quote_name(str(key))} at lines "
                                           f"{first[key]} and {line}")
                    first[key] = line
                except TypeError:  # an unhashable key: the base class refuses it
                    continue
        return super().construct_mapping(node, deep=deep)


class _YamlRefused(Exception):
    pass


def safe_load_yaml(text: str, where: str) -> Any:
    """``yaml.safe_load`` with aliases and duplicate keys refused; any failure is a one-line
    ``ConfigError`` that starts with ``where`` (the file, or the override's key)."""
    try:
        return yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader subclass
    except _YamlRefused as e:
        raise ConfigError(f"{where}: {e}") from None
    except (yaml.YAMLError, ValueError, RecursionError) as e:
        # ReaderError (e.g. a NUL byte) has no .problem; ValueError: an int over Python's
        # 4300-digit limit; RecursionError: nesting too deep for the YAML parser.
        why = getattr(e, "problem", None) or str(e) or type(e).__name__
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        why = " ".join(str(why).split())[:200]  # one line
        raise ConfigError(f"{where}: invalid YAML{at} ({why})") from None


def read_config_text(path: Path) -> str:
    """A config file's text: at most ``MAX_CONFIG_BYTES`` of UTF-8 (read no further, so a
    pipe such as ``--config <(...)`` works and ``/dev/zero`` is refused)."""
    try:
        if path.is_dir():
            raise ConfigError(f"config file {quote_name(str(path))} is a directory")
        with path.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read config file {quote_name(str(path))}: "
                          f"{e.strerror or type(e).__name__}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {quote_name(str(path))} is over {MAX_CONFIG_BYTES} bytes; "
                          f"a config is a few KiB")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {quote_name(str(path))} is not UTF-8 (byte {e.start + 1})"
                          ) from None


def configs_dir() -> Path:
    """The shipped configs: the ``tppo_jax.configs`` package folder (``configs/`` links to it)."""
    import tppo_jax.configs as pkg

    return Path(pkg.__file__).parent


def looks_like_path(name: str | Path) -> bool:
    """Whether a config name is written as a path (has a ``/`` or a ``.yaml`` / ``.yml``
    suffix): only then may a file in the working directory stand for it."""
    text = str(name)
    return "/" in text or os.sep in text or text.endswith((".yaml", ".yml"))


def resolve_config_path(name: str | Path) -> Path:
    """The file a config name stands for: a path as written when it looks like one
    (``looks_like_path``); else the shipped config of that name (a file or folder named
    so in the working directory is not used, said in a warning), else an existing file."""
    p = Path(name)
    if looks_like_path(name):
        if p.exists():
            return p
    else:
        shipped = configs_dir() / f"{p}.yaml"
        if shipped.is_file():
            if p.exists():
                logging.getLogger(__name__).warning(
                    "config %s: the shipped %s, not ./%s in the working directory (write "
                    "./%s for that)", quote_name(str(name)), shipped, p, p)
            return shipped
        if p.is_file():
            return p
    known = sorted(q.stem for q in configs_dir().glob("*.yaml"))
    raise ConfigError(f"config file {quote_name(str(name))} not found "
                      f"(shipped configs: {', '.join(known)})")


def _base_path(base: Any, child: Path) -> Path:
    """Where ``base: NAME`` in ``child`` points: a path beside ``child`` first, then a path
    from the working directory or a shipped config's name."""
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(f"{child}: 'base' must name a config (a shipped name or a path), "
                          f"got {quote(base)}")
    for cand in (child.parent / base, child.parent / f"{base}.yaml"):
        if cand.is_file():
            return cand
    try:
        return resolve_config_path(base)
    except ConfigError as e:
        raise ConfigError(f"{child}: 'base': {e}") from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A config file's sections with its ``base:`` chain merged in: each file is read, its
    base (if any) read first, and the file's keys deep-merged over it (MaxText-style base +
    overrides). A chain that returns to a file it already read is refused in one line."""
    chain: list[Path] = []
    layers: list[dict[str, Any]] = []
    src = resolve_config_path(path)
    while True:
        key = src.resolve()
        if key in chain:
            names = [str(p.name) for p in [*chain, key]]
            if len(names) > 8:  # a loop over thousands of files stays one short line
                names = [*names[:3], f"... {len(names) - 6} more ...", *names[-3:]]
            text = " -> ".join(names)
            text = text if len(text) <= 400 else f"{text[:397]}..."
            raise ConfigError(f"config {quote_name(str(path))}: 'base' chain loops ({text})")
        chain.append(key)
        loaded = safe_load_yaml(read_config_text(src), str(src)) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{src}: top level must be a mapping of sections")
        layers.append(loaded)
        if "base" not in loaded:
            break
        src = _base_path(loaded.pop("base"), src)
    data: dict[str, Any] = {}
    for layer in reversed(layers):
        data = _merge(data, layer)
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Loads a YAML config (default: the embedded ``default.yaml``) with its ``base:`` chain,
    applies overrides, validates, and returns a ``Config``."""
    data = read_config_file(path if path is not None else "default")
    for ov in overrides or []:
        data = _merge(data, parse_override(ov))
    return from_dict(data)


def from_dict(data: dict[str, Any]) -> Config:
    """A validated ``Config`` from nested section mappings (omitted keys take defaults)."""
    cfg = _build(Config, data, "")
    validate(cfg)
    return cfg
