"""Every config value out of its range is a one-line ConfigError naming the key (so `tppo
config` refuses what `tppo train` would crash on), and the YAML loader is bounded."""

from __future__ import annotations

import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest

from tppo_jax.config import Config, ConfigError, load_config, validate
from tppo_jax.config_checks import (
    FREE_TEXT,
    INT_MAX,
    QUOTE_CHARS,
    RANGES,
    Range,
    is_int_field,
    section_fields,
)


def _fields() -> list[tuple[str, typing.Any]]:
    return [(key, tp) for key, tp, _ in section_fields(Config())]


def _is_numeric(tp: typing.Any) -> bool:
    args = typing.get_args(tp) if typing.get_origin(tp) is not typing.Literal else ()
    return tp in (int, float) or any(a in (int, float) for a in args)


def test_every_numeric_field_has_a_range() -> None:
    """A new numeric field cannot be added without a range (and no range names a stale key)."""
    numeric = {key for key, tp in _fields() if _is_numeric(tp)}
    assert numeric - set(RANGES) == set(), "numeric fields without a RANGES entry"
    assert set(RANGES) - numeric == set(), "RANGES entries for no numeric field"


def test_every_field_is_checked() -> None:
    """Numeric: RANGES; Literal and bool: the loader's type check; text: FREE_TEXT."""
    for key, tp in _fields():
        typed = typing.get_origin(tp) is typing.Literal or tp is bool
        assert typed or key in RANGES or key in FREE_TEXT, key
    assert {key for key, _ in _fields()} >= FREE_TEXT


def _bad_values(key: str, rng: Range, is_int: bool) -> list[typing.Any]:
    """Values just outside ``rng`` (and past the int cap) for the field ``key``."""
    step = 1 if is_int else 0.5
    out: list[typing.Any] = []
    if rng.lo is not None:
        lo = rng.lo if rng.lo_open else rng.lo - step
        out.append(int(lo) if is_int else lo)
    if rng.hi is not None:
        hi = rng.hi if rng.hi_open else rng.hi + step
        out.append(int(hi) if is_int else hi)
    if is_int:
        out.append(INT_MAX + 1 if rng.hi is None else 2**70)
    if not out:  # any finite number: only non-finite ones are refused
        out.append(".nan")
    return [v for v in out if v not in rng.special]


GENERATED = [(key, v) for key, tp in _fields() if key in RANGES
             for v in _bad_values(key, RANGES[key], is_int_field(tp))]

# The values the red-team found crashing `tppo train` (or printing "nan%") after
# `tppo config` had accepted them.
FOUND = [
    ("reward.workers", -1), ("mesh.data", 0), ("mesh.fsdp", -2), ("train.eval_samples", 0),
    ("data.max_operand", 0), ("train.seed", 2**70), ("data.seed", -1), ("checkpoint.keep", 0),
    ("data.eval_size", 0), ("train.target_accuracy", 101), ("optim.b2", 1.0),
    ("train.max_skipped_updates", 0), ("train.warmstart_batch", 0), ("data.max_value", 1),
]


@pytest.mark.parametrize(("key", "value"), FOUND + GENERATED)
def test_out_of_range_is_one_line_naming_the_key(key: str, value: typing.Any) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{key}={value}"])
    msg = str(e.value)
    assert key in msg and "\n" not in msg, msg


@pytest.mark.parametrize("override", [
    "reward.workers=0", "mesh.data=-1", "checkpoint.every=0",
    "optim.grad_clip=0", "train.steps=0", f"train.seed={2**31 - 1}", "algo.dual_clip_c=null",
    "train.target_accuracy=100", "rollout.top_p=1", "rollout.temperature=0", "data.max_value=2",
    "reward.verify_timeout_s=null", "algo.advantage_clip=null",
])
def test_edges_of_the_ranges_are_accepted(override: str) -> None:
    load_config(None, [override])


def test_mesh_needs_at_most_one_free_axis_and_must_fill_the_devices() -> None:
    with pytest.raises(ConfigError, match="at most one axis may be -1"):
        load_config(None, ["mesh.fsdp=-1"])
    cfg = load_config(None, ["mesh.data=1"])
    with pytest.raises(ConfigError, match="does not fit 8 devices"):
        validate(cfg, num_devices=8)
    validate(cfg, num_devices=1)


def test_tiny_model_head_size_must_be_even() -> None:
    with pytest.raises(ConfigError, match="head size, 3"):
        load_config(None, ["model.hidden_size=12", "model.num_heads=4", "model.num_kv_heads=2"])


def test_unknown_data_fields_key_is_refused() -> None:
    """read_examples would raise a bare ValueError from inside `tppo train`."""
    with pytest.raises(ConfigError, match="data.fields: unknown key 'qestion'"):
        load_config(None, ["data.fields={qestion: q}"])
    load_config(None, ["data.format=svamp", "data.fields={body: b}"])


def test_values_are_quoted_as_a_short_prefix() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["data.format=" + "x" * 100_000])
    assert "data.format" in str(e.value) and len(str(e.value)) < QUOTE_CHARS + 200


# ---- the bounded YAML loader ----------------------------------------------------------
BOMB = "\n".join(["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"] + [
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi",
                                                               strict=True)]) + "\n"


def test_yaml_bomb_is_refused_at_once(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB)
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="aliases") as e:
        load_config(bomb)
    assert time.monotonic() - t0 < 2 and "\n" not in str(e.value)


def test_aliases_in_an_override_are_refused() -> None:
    with pytest.raises(ConfigError, match="data.fields.*aliases"):
        load_config(None, ["data.fields={a: &x q, b: *x}"])


def test_config_file_over_the_size_limit_is_refused(tmp_path: Path) -> None:
    from tppo_jax.config import MAX_CONFIG_BYTES

    big = tmp_path / "big.yaml"
    big.write_text("# padding\n" * (MAX_CONFIG_BYTES // 10 + 1))
    with pytest.raises(ConfigError, match="over 1048576 bytes"):
        load_config(big)


@pytest.mark.parametrize(("content", "needle"), [
    (b"\xff\xfe rollout: {}", "not UTF-8"),
    (b"rollout: [" * 2000, "invalid YAML"),
    (b"rollout:\n  window: [1,\n", "invalid YAML at line"),
    (b"- 1\n- 2\n", "top level must be a mapping"),
])
def test_bad_config_files_are_one_line(tmp_path: Path, content: bytes, needle: str) -> None:
    p = tmp_path / "c.yaml"
    p.write_bytes(content)
    with pytest.raises(ConfigError, match=needle) as e:
        load_config(p)
    assert "\n" not in str(e.value)


def test_a_directory_as_the_config_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def test_an_endless_config_file_is_refused() -> None:
    with pytest.raises(ConfigError, match="over 1048576 bytes"):
        load_config("/dev/zero")


@pytest.mark.parametrize("args", [["reward.workers=-1"], ["--config", "BOMB"]])
def test_tppo_config_refuses_in_one_line(tmp_path: Path, args: list[str]) -> None:
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB)
    args = [str(bomb) if a == "BOMB" else a for a in args]
    r = subprocess.run([sys.executable, "-m", "tppo_jax.cli", "config", *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and "config error" in r.stderr, r.stderr


def test_defaults_and_shipped_configs_pass_the_ranges() -> None:
    for p in sorted(Path(__file__).parents[2].glob("configs/*.yaml")):
        load_config(p)
    validate(Config())  # the dataclass defaults too


def test_a_paged_pool_too_small_for_one_prompt_is_refused() -> None:
    """Issue 49 M4: num_pages=1 trained nothing, every step, rc 0."""
    base = ["rollout.kv_cache=paged", "rollout.max_prompt_len=64", "rollout.window=16",
            "rollout.page_size=16"]
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, "rollout.num_pages=1"])
    msg = str(e.value)
    assert "rollout.num_pages (1) cannot hold one prompt" in msg and "\n" not in msg
    assert "need 5 pages" in msg
    window = [*base, "rollout.page_alloc=window"]
    load_config(None, [*window, "rollout.num_pages=5"])  # 63 + 16 tokens: 5 pages
    load_config(None, [*base, "rollout.num_pages=0"])  # 0: sized for every slot
    with pytest.raises(ConfigError, match="value_pretrain_steps"):  # a full-length window
        load_config(None, [*window, "rollout.num_pages=5", "algo.value_pretrain_steps=2"])
    # On demand a row keeps its pages to the end: one row at full length, 63 + 128 tokens.
    with pytest.raises(ConfigError, match=r"leaves 11 pages; .*on_demand one row at full "
                                          r"length \(max_prompt_len - 1 \+ max_response_len\) "
                                          r"needs 12"):
        load_config(None, [*base, "rollout.num_pages=11"])
    load_config(None, [*base, "rollout.num_pages=12"])


@pytest.mark.parametrize("value", ["3", "[a, b]", "{x: y}", "true"])
def test_a_data_fields_value_that_is_not_text_is_refused(value: str) -> None:
    """Issue 49 "Also": a non-string data.fields value was coerced into a path."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"data.fields={{question: {value}}}"])
    assert "data.fields.question must be a field name" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("override", "needle"), [
    ("rollout.prompts_per_step=1000000000", "rollout.prompts_per_step must be in [1, 65536]"),
    ("rollout.group_size=1000000000", "rollout.group_size must be in [1, 1024]"),
    ("rollout.page_size=1000000", "rollout.page_size must be in [1, 4096]"),
    ("train.eval_samples=100000000", "train.eval_samples must be in [1, 1024]"),
    ("data.eval_size=1000000000", "data.eval_size must be in [1, 1000000]"),
    ("rollout.temperature=1e-40", "rollout.temperature must be 0 (greedy) or >= 0.001"),
])
def test_values_that_crashed_or_hung_train_are_refused(override: str, needle: str) -> None:
    """Issue 49 L4: values `tppo config` accepted that crashed (RESOURCE_EXHAUSTED, OOM,
    MemoryError), hung, or trained on NaN log-probs in `tppo train`."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_rollout_batch_past_int32_positions_is_refused() -> None:
    with pytest.raises(ConfigError, match="token positions per step"):
        load_config(None, ["rollout.prompts_per_step=65536", "rollout.group_size=1024"])


def test_auto_kv_cache_is_checked_as_paged() -> None:
    """Issue 62 M-4: ``kv_cache=auto`` is paged on TPU/GPU; num_pages=1 was accepted."""
    base = ["rollout.max_prompt_len=64", "rollout.window=16", "rollout.page_size=16"]
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, "rollout.kv_cache=auto", "rollout.num_pages=1"])
    msg = str(e.value)
    assert "rollout.num_pages (1) cannot hold one prompt" in msg and "auto is paged" in msg
    load_config(None, [*base, "rollout.kv_cache=dense", "rollout.num_pages=1"])  # unused


def test_caps_on_window_ignore_tokens_and_workers() -> None:
    """Issue 62 (round 4's L4 caps): both were accepted."""
    with pytest.raises(ConfigError) as e:
        load_config("smoke", ["algo.window_ignore_tokens=100"])  # smoke's window is 16
    msg = str(e.value)
    assert "algo.window_ignore_tokens (100) must be below rollout.window (16)" in msg
    assert "\n" not in msg
    load_config("smoke", ["algo.window_ignore_tokens=15"])
    with pytest.raises(ConfigError, match=r"reward.workers must be in \[0, 1024\]"):
        load_config("smoke", ["reward.workers=100000"])
