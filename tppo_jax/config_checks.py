"""Validation of a built config: one range table for every numeric field, then the checks
between fields. ``tppo_jax.config`` re-exports ``ConfigError`` and ``validate``.

Kept apart from ``config.py`` (the loader) so each stays small; it imports only
``config_schema`` (the sections, below it): it walks the config's dataclass fields and their
type hints. A key that names a plugin (``reward.fn``, ``algo.advantage_baseline``) is checked
for its shape here and resolved where it is used (``plugins.py``): validation imports nothing
above the config.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tppo_jax.config_schema import DEFAULT_FIELDS

if TYPE_CHECKING:
    from tppo_jax.config_schema import Config


class ConfigError(ValueError):
    """A config key or value is invalid; the message names it."""


QUOTE_CHARS = 60  # an error message quotes at most this much of a value (it may be huge)
NAME_QUOTE_CHARS = 250  # and of a key or a path: enough for any real one, escapes and all


def quote(value: Any, limit: int = QUOTE_CHARS) -> str:
    """``repr(value)``, cut to ``limit`` characters: messages stay one short line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


def quote_name(key: str) -> str:
    """A config key, an override's left side or a file path, as a message quotes it."""
    return quote(key, NAME_QUOTE_CHARS)


# Device arrays hold int32: a count or size above this cannot be represented there.
INT_MAX = 2**31 - 1
# Seeds get small offsets added (value pretraining's, the critic's +1) and end up in
# int64/uint32 PRNG seeds: this leaves room for both.
SEED_MAX = 2**31 - 1
# Token positions of one step's rollout batch (slots x (prompt + response)), summed over
# hosts: each is a KV cache row per layer and a cell of every per-token array; past int32
# the flat indices overflow (and no slice holds the arrays).
MAX_TOKEN_CELLS = INT_MAX


@dataclass(frozen=True)
class Range:
    """Allowed values of one numeric field: ``lo``/``hi`` (None = unbounded), open or
    closed, plus ``special`` values outside it (e.g. mesh sizes' -1, ``meaning`` says what
    it stands for). An int field without ``hi`` is still capped at ``INT_MAX``."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    special: tuple[int, ...] = ()
    meaning: str = ""

    def contains(self, v: float) -> bool:
        if v in self.special:
            return True
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)

    def describe(self) -> str:
        if self.lo is not None and self.hi is not None:
            text = (f"in {'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}"
                    f"{')' if self.hi_open else ']'}")
        elif self.lo is not None:
            text = f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        elif self.hi is not None:
            text = f"{'<' if self.hi_open else '<='} {_num(self.hi)}"
        else:
            text = "a finite number"
        if self.special:
            text = f"{' or '.join(map(str, self.special))} ({self.meaning}) or {text}"
        return text


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


POSITIVE = Range(0, lo_open=True)
NON_NEGATIVE = Range(0)
UNIT = Range(0, 1)  # a fraction or a discount
ANY = Range()  # any finite number (the loader already refuses nan/inf)
SEED = Range(0, SEED_MAX)
# Below 1e-3 the log-probs of T-scaled logits overflow to NaN; 0 samples greedily.
TEMPERATURE = Range(1e-3, special=(0,), meaning="greedy")
MESH_AXIS = Range(1, special=(-1,), meaning="the devices left over")

# Every numeric field of every section, and what it may hold. A nullable field may also be
# null. tests/cli/test_config_ranges.py fails when a numeric field is missing here.
RANGES: dict[str, Range] = {
    "model.hidden_size": POSITIVE, "model.intermediate_size": POSITIVE,
    "model.num_layers": POSITIVE, "model.num_heads": POSITIVE, "model.num_kv_heads": POSITIVE,
    "model.max_seq_len": POSITIVE, "model.lora_rank": NON_NEGATIVE,  # 0 = no LoRA
    "model.lora_alpha": POSITIVE,
    # Upper bounds: past them the rollout batch, the KV pages or the eval's samples outgrow
    # any one machine's memory (a traceback deep in XLA, or a hang), see also _check_memory.
    "rollout.prompts_per_step": Range(1, 65536), "rollout.group_size": Range(1, 1024),
    "rollout.max_prompt_len": POSITIVE, "rollout.max_response_len": POSITIVE,
    "rollout.window": POSITIVE, "rollout.temperature": TEMPERATURE,
    "rollout.top_p": Range(0, 1, lo_open=True), "rollout.top_k": NON_NEGATIVE,
    "rollout.page_size": Range(1, 4096), "rollout.num_pages": NON_NEGATIVE,
    "rollout.page_chunk": POSITIVE, "rollout.page_reserve": Range(0, 1, hi_open=True),
    "algo.gamma": UNIT, "algo.lam_policy": UNIT, "algo.lam_critic": UNIT, "algo.lam_min": UNIT,
    "algo.alpha": POSITIVE, "algo.eps_low": Range(0, 1, lo_open=True, hi_open=True),
    "algo.eps_high": POSITIVE, "algo.dual_clip_c": Range(1, lo_open=True),
    "algo.window_ignore_tokens": NON_NEGATIVE, "algo.nll_coef": NON_NEGATIVE,
    "algo.kl_coef": NON_NEGATIVE, "algo.tis_cap": Range(1),  # a cap below 1 shrinks every weight
    "algo.critic_warmup_steps": NON_NEGATIVE, "algo.value_pretrain_steps": NON_NEGATIVE,
    "algo.advantage_clip": POSITIVE, "algo.value_clip_low": NON_NEGATIVE,
    "algo.value_clip_high": NON_NEGATIVE,
    "optim.policy_lr": NON_NEGATIVE, "optim.value_lr": NON_NEGATIVE,
    "optim.warmup_steps": NON_NEGATIVE, "optim.weight_decay": NON_NEGATIVE,
    "optim.policy_lr_decay_steps": NON_NEGATIVE,
    "optim.b1": Range(0, 1, hi_open=True), "optim.b2": Range(0, 1, hi_open=True),
    "optim.eps": POSITIVE,
    "optim.grad_clip": NON_NEGATIVE,  # 0 = no clipping
    "optim.minibatches": POSITIVE, "optim.grad_accum": POSITIVE, "optim.epochs": POSITIVE,
    "optim.value_epochs": POSITIVE,
    "data.difficulty": NON_NEGATIVE, "data.max_operand": POSITIVE,
    "data.max_value": Range(2),  # a chain problem starts at a value in [2, max_value]
    "data.max_steps": POSITIVE, "data.eval_size": Range(1, 1_000_000), "data.seed": SEED,
    "reward.correct": ANY, "reward.wrong": ANY, "reward.no_answer": ANY, "reward.error": ANY,
    "reward.workers": Range(0, 1024),  # 0 = grade inline; each is a process (~100 MB)
    "reward.item_timeout_s": POSITIVE, "reward.batch_deadline_s": POSITIVE,
    "reward.overlong_buffer": NON_NEGATIVE, "reward.overlong_penalty": NON_NEGATIVE,
    "reward.verify_timeout_s": Range(1),  # whole seconds (SIGALRM)
    "reward.max_tasks_per_child": POSITIVE, "reward.crash_retries": NON_NEGATIVE,
    "reward.max_abs": Range(0, 1e9, lo_open=True),  # 1e9 squared still fits float32
    "mesh.data": MESH_AXIS, "mesh.fsdp": MESH_AXIS, "mesh.tensor": MESH_AXIS,
    "mesh.decode_tensor": NON_NEGATIVE,  # 0 = decode on the training mesh
    "checkpoint.every": NON_NEGATIVE,  # 0 = only the last step
    "checkpoint.keep": POSITIVE,
    "logging.samples_per_step": NON_NEGATIVE,
    "train.steps": NON_NEGATIVE, "train.seed": SEED, "train.eval_every": NON_NEGATIVE,
    "train.eval_every_s": NON_NEGATIVE, "train.eval_samples": Range(1, 1024),
    "train.target_accuracy": Range(0, 100),  # percent
    "train.time_budget_s": POSITIVE, "train.max_skipped_updates": POSITIVE,
    "train.warmstart_steps": NON_NEGATIVE, "train.warmstart_lr": NON_NEGATIVE,
    "train.warmstart_batch": POSITIVE, "train.warmstart_wrong_step_frac": UNIT,
    "train.warmstart_no_format_frac": UNIT,
}

# Text fields: no range to check; each is checked where it is used (a path when it is
# opened, a template when it is rendered). With the Literal and bool fields (checked by
# the loader against their annotation) these and RANGES cover every field.
FREE_TEXT = frozenset({
    "model.path", "model.value_path", "data.source", "data.fields", "data.prompt_template",
    "data.system_prompt", "checkpoint.dir", "train.compile_cache",
    "data.eval_source",  # read (one-line DataError when it cannot be) as data.source is
    "reward.fn",  # package.module:function (check_plugin_path); imported where the grader starts
    "data.hf_config", "data.split", "data.hf_revision",  # the names' shape: _check_hub_names
    "model.lora_targets",  # projection names: parse_lora_targets
    "logging.wandb_project", "logging.wandb_name", "logging.wandb_entity",  # wandb's to judge
    "algo.advantage_baseline",  # an estimator's name or package.module:function (_check_plugins)
})


# The projections a LoRA adapter may target (models/transformer.py PROJECTIONS' names).
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def parse_lora_targets(text: str) -> tuple[str, ...]:
    """``model.lora_targets`` ("q,v" or "q, k, v, o, gate, up, down") as projection names in
    the model's order, each once; ``ConfigError`` naming an unknown one, or none given."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in LORA_TARGETS]
    if unknown or not names:
        what = f"unknown projection {quote(unknown[0])}" if unknown else "no projection named"
        raise ConfigError(f"model.lora_targets: {what}; a comma-separated list of "
                          f"{', '.join(LORA_TARGETS)}")
    return tuple(t for t in LORA_TARGETS if t in names)


def validate(cfg: Config, num_devices: int | None = None, num_processes: int = 1) -> None:
    """Every field's range, then cross-field checks; raises ``ConfigError`` naming the key."""
    check_ranges(cfg)
    _check_plugins(cfg)
    _check_rollout_and_algo(cfg)
    _check_data_and_model(cfg)
    _check_layout(cfg, num_devices, num_processes)


def check_plugin_path(key: str, path: str) -> tuple[str, str]:
    """``(module, function)`` of ``package.module:function``, the one form a config names a
    user's function in (``plugins.py``); ``ConfigError`` naming ``key`` otherwise."""
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise ConfigError(f"{key}: expected package.module:function, got {path!r}")
    return module, name


def _check_plugins(cfg: Config) -> None:
    """The keys that name a function have its shape. Whether it exists is known where it is
    imported (``learner/estimators.py resolve_estimator``, ``rewards/custom.py``): before a
    run claims its directory, and in ``tppo config``."""
    if cfg.reward.fn:
        check_plugin_path("reward.fn", cfg.reward.fn)
    name = cfg.algo.advantage_baseline
    if ":" in name:
        check_plugin_path("algo.advantage_baseline", name)
    elif not name.strip():
        raise ConfigError("algo.advantage_baseline: expected a registered estimator's name "
                          f"or package.module:function, got {name!r}")


def section_fields(cfg: Config) -> typing.Iterator[tuple[str, Any, Any]]:
    """``(section.key, annotation, value)`` of every field of every section."""
    for sec in dataclasses.fields(cfg):
        section = getattr(cfg, sec.name)
        hints = typing.get_type_hints(type(section))
        for f in dataclasses.fields(section):
            yield f"{sec.name}.{f.name}", hints[f.name], getattr(section, f.name)


def is_int_field(tp: Any) -> bool:
    """Whether the annotation is ``int`` or ``int | None``."""
    return tp is int or (typing.get_origin(tp) in (typing.Union, types.UnionType)
                         and int in typing.get_args(tp))


def check_ranges(cfg: Config) -> None:
    """Each numeric field against its ``RANGES`` entry (null passes where allowed)."""
    for key, tp, v in section_fields(cfg):
        rng = RANGES.get(key)
        if rng is None or v is None or isinstance(v, bool):
            continue
        null = " (or null)" if type(None) in typing.get_args(tp) else ""
        if not rng.contains(v):
            raise ConfigError(f"{key} must be {rng.describe()}{null}, got {quote(v)}")
        if is_int_field(tp) and v > INT_MAX:
            raise ConfigError(f"{key} must be <= {INT_MAX}, got {quote(v)}")


def _check_rollout_and_algo(cfg: Config) -> None:
    """Windows vs lengths, batch divisibility."""
    r, o = cfg.rollout, cfg.optim
    if r.window < r.max_response_len and r.max_response_len % r.window:
        raise ConfigError(
            f"rollout.max_response_len (L={r.max_response_len}) must be a multiple of "
            f"rollout.window (l={r.window}), or window >= max_response_len for PPO"
        )
    if r.window > r.max_response_len:
        raise ConfigError(
            f"rollout.window (l={r.window}) > rollout.max_response_len (L={r.max_response_len}); "
            f"set window = max_response_len for synchronous PPO"
        )
    ignore = cfg.algo.window_ignore_tokens
    if r.window < r.max_response_len and ignore >= r.window:
        raise ConfigError(
            f"algo.window_ignore_tokens ({ignore}) must be below rollout.window ({r.window}): "
            f"it leaves the last tokens of an unfinished window out of the policy loss, so "
            f"no token of one would train")
    if r.max_len > cfg.model.max_seq_len:
        raise ConfigError(
            f"rollout.max_prompt_len + rollout.max_response_len = "
            f"{r.max_len} exceeds model.max_seq_len "
            f"({cfg.model.max_seq_len})"
        )
    if r.slots % (o.minibatches * o.grad_accum):
        raise ConfigError(
            f"slots ({r.slots}) not divisible by optim.minibatches * optim.grad_accum "
            f"({o.minibatches} * {o.grad_accum})"
        )
    if r.kv_cache != "dense" and r.num_pages:
        # The scheduler admits a prompt only with pages for it and its first window.
        # (Value pretraining's rollouts are one full-length window.) `auto` is paged on a
        # TPU or GPU, whatever machine checks the config: it is checked as paged.
        pre = cfg.algo.value_pretrain_steps > 0
        window = r.max_response_len if pre else min(r.window, r.max_response_len)
        need = -(-(r.max_prompt_len - 1 + window) // r.page_size)
        if r.num_pages < need:
            what = ("algo.value_pretrain_steps' full-length window" if pre
                    else "rollout.window")
            raise ConfigError(
                f"rollout.num_pages ({r.num_pages}) cannot hold one prompt and its first "
                f"window: rollout.max_prompt_len - 1 + {what} = "
                f"{r.max_prompt_len - 1 + window} tokens need {need} pages of "
                f"rollout.page_size {r.page_size}"
                f"{' (rollout.kv_cache=auto is paged on TPU and GPU)' * (r.kv_cache == 'auto')}"
                f"; raise it (0 = enough for every slot)")
        _check_full_row(r, r.num_pages, "")
    cells = r.slots * r.max_len
    if cells > MAX_TOKEN_CELLS:
        raise ConfigError(
            f"rollout.prompts_per_step * rollout.group_size * (max_prompt_len + "
            f"max_response_len) = {cells} token positions per step, over {MAX_TOKEN_CELLS} "
            f"(each is a row of the KV cache and of every rollout array): lower them")
    if cfg.reward.overlong_buffer > r.max_response_len:
        raise ConfigError(f"reward.overlong_buffer ({cfg.reward.overlong_buffer}) exceeds "
                          f"rollout.max_response_len ({r.max_response_len})")


def _check_data_and_model(cfg: Config) -> None:
    """Task, model source and prompt settings that must agree."""
    if cfg.data.style == "daily" and cfg.data.max_value < cfg.data.max_steps + 2:
        raise ConfigError(f"data.max_value ({cfg.data.max_value}) must be >= data.max_steps + 2 "
                          f"({cfg.data.max_steps + 2}) for daily problems")
    if cfg.model.source in ("hf", "gguf") and not cfg.model.path:
        raise ConfigError(f"model.path is required when model.source is {cfg.model.source!r}")
    if cfg.data.fields:
        _check_fields(cfg.data.format, cfg.data.fields)
    _check_hub_names(cfg.data.hf_config, cfg.data.split, cfg.data.hf_revision)
    pt = cfg.data.prompt_template
    if pt is not None and "{question}" not in pt:
        raise ConfigError(f"data.prompt_template must contain {{question}}, got {quote(pt)}")
    m = cfg.model
    parse_lora_targets(m.lora_targets)
    if m.param_dtype == "bfloat16" and m.dtype == "float32":
        raise ConfigError("model.param_dtype: bfloat16 needs model.dtype: bfloat16 (a float32 "
                          "model computes from float32 params); use param_dtype: float32")
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(f"model.num_heads ({m.num_heads}) must be a multiple of "
                          f"model.num_kv_heads ({m.num_kv_heads})")
    head = m.hidden_size // m.num_heads
    if m.source == "tiny" and (head < 2 or head % 2):  # RoPE rotates pairs of dimensions
        raise ConfigError(f"model.hidden_size // model.num_heads (the head size, {head}) must "
                          f"be even and >= 2 for model.source 'tiny'")


def _check_fields(fmt: str, fields: dict[str, str]) -> None:
    """``data.fields`` keys the row format has (``read_examples`` would raise a bare
    ValueError inside ``tppo train``)."""
    allowed = DEFAULT_FIELDS[fmt]
    unknown = sorted(set(fields) - set(allowed))
    if unknown:
        raise ConfigError(f"data.fields: unknown key {quote(unknown[0])} for data.format "
                          f"{fmt!r}; allowed: {', '.join(allowed)}")


# A split as datasets names it: "train", "test[:100]", "train[10%:]+validation".
_SPLIT_PART = r"[A-Za-z0-9_.-]+(\[[^\[\]]*\])?"
_SPLIT = re.compile(rf"{_SPLIT_PART}(\+{_SPLIT_PART})*")


def _check_hub_names(hf_config: str | None, split: str, revision: str | None) -> None:
    """``data.hf_config``, ``data.split`` and ``data.hf_revision`` have a name's shape, so a
    typo (an empty value, a stray space) stops here rather than as a Hub error mid-setup."""
    if not _SPLIT.fullmatch(split):
        raise ConfigError(f"data.split must name a split such as train, test or train[:1000], "
                          f"got {quote(split)}")
    for key, value in (("data.hf_config", hf_config), ("data.hf_revision", revision)):
        if value is not None and (not value.strip() or value != value.strip()
                                  or "\n" in value):
            raise ConfigError(f"{key} must be null or a name without surrounding spaces, got "
                              f"{quote(value)}")


def _check_layout(cfg: Config, num_devices: int | None, num_processes: int) -> None:
    """Slots vs processes and the device mesh."""
    r = cfg.rollout
    m = cfg.mesh
    sizes = [m.data, m.fsdp, m.tensor]
    if sizes.count(-1) > 1:
        raise ConfigError(f"mesh {sizes} (data, fsdp, tensor): at most one axis may be -1")
    if num_processes > 1 and r.slots % num_processes:
        raise ConfigError(f"slots ({r.slots}) not divisible by the number of processes "
                          f"({num_processes}): every host runs the same number of slots")
    if num_devices is not None:
        fixed = 1
        for s in sizes:
            if s != -1:
                fixed *= s
        dp = (num_devices // fixed if m.data == -1 else m.data) * (
            num_devices // fixed if m.fsdp == -1 else m.fsdp)
        if num_devices % fixed or (-1 not in sizes and fixed != num_devices):
            raise ConfigError(f"mesh {sizes} (data, fsdp, tensor) does not fit {num_devices} "
                              f"devices")
        if r.slots % max(dp, 1):
            raise ConfigError(
                f"slots ({r.slots}) not divisible by the data-parallel size "
                f"mesh.data*mesh.fsdp = {dp}"
            )
    if m.decode_tensor:
        if m.decode_layout != "decode":
            raise ConfigError(f"mesh.decode_tensor={m.decode_tensor} needs "
                              "mesh.decode_layout=decode (it lays out the decode copy)")
        if num_devices is not None:
            if num_devices % m.decode_tensor:
                raise ConfigError(f"mesh.decode_tensor={m.decode_tensor} does not divide the "
                                  f"{num_devices} devices into tensor-parallel replicas")
            replicas = num_devices // m.decode_tensor
            if r.slots % replicas:
                raise ConfigError(f"slots ({r.slots}) not divisible by the {replicas} decode "
                                  f"replicas (devices / mesh.decode_tensor)")
    if num_processes > 1 and num_devices is not None and r.kv_cache != "dense" and r.num_pages:
        # Across hosts each batch shard of the decode mesh has its own block of the pool.
        shards = num_devices // m.decode_tensor if m.decode_tensor else dp
        if r.num_pages % shards:
            raise ConfigError(f"rollout.num_pages ({r.num_pages}) not divisible by the "
                              f"{shards} decode batch shards: with {num_processes} processes "
                              f"each shard holds its own block of pages")
        pre = cfg.algo.value_pretrain_steps > 0
        window = r.max_response_len if pre else min(r.window, r.max_response_len)
        need = -(-(r.max_prompt_len - 1 + window) // r.page_size)
        if r.num_pages // shards < need:
            raise ConfigError(f"rollout.num_pages ({r.num_pages}) over {shards} decode batch "
                              f"shards leaves {r.num_pages // shards} pages per shard; one "
                              f"prompt and its first window need {need}")
        _check_full_row(r, r.num_pages // shards, f" per decode batch shard (of {shards})")


def _check_full_row(r: Any, pages: int, where: str) -> None:
    """On demand a row keeps its pages across windows and a dry block preempts the others
    for it: a block must hold one row at full length, or that row never finishes."""
    need = -(-(r.max_prompt_len - 1 + r.max_response_len) // r.page_size)
    if r.page_alloc == "on_demand" and pages < need:
        raise ConfigError(f"rollout.num_pages leaves {pages} pages{where}; with "
                          f"rollout.page_alloc=on_demand one row at full length "
                          f"(max_prompt_len - 1 + max_response_len) needs {need}: raise it, "
                          f"or set rollout.page_alloc=window")
