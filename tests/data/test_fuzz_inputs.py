"""Fuzzing the input edges (issue 8, item 4): dataset files and config overrides.

Dataset rows of every reader format either read fine or raise :class:`DataError` naming the file
and line; ``on_bad_row="skip"`` never raises for row-level problems and counts them. Config
overrides either load or raise a one-line :class:`ConfigError` naming the key -- through
``load_config`` and through the ``tppo config`` command line.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import tempfile
import typing
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tppo_jax.config import Config, ConfigError, load_config
from tppo_jax.data.readers import DEFAULT_FIELDS, DataError, read_examples

FORMATS = sorted(DEFAULT_FIELDS)
FUZZ = settings(max_examples=25, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ------------------------------------------------------------------------------ dataset rows
FIELD_NAMES = sorted({p.split(".")[0] for f in DEFAULT_FIELDS.values() for p in f.values() if p})
TEXTS = st.sampled_from([
    "What is 1+1?", "#### 4", "so 2 \\boxed{2}", "a ) 1 , b ) 2 , c ) 3", "b", "4", "", "  ",
    "x = 3 + 1", "( 3.0 + 1.0 )", "Jack has 3 apples.", "\\boxed{", "\u202e\u200b\x00",
])
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12) | TEXTS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=6,
)
PLAUSIBLE = st.one_of(
    TEXTS,
    st.integers(-10**6, 10**6),
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                    "content": TEXTS}), max_size=2),
    st.fixed_dictionaries({"ground_truth": TEXTS | st.integers()}),
    JSON_VALUES,
)
ROWS = st.dictionaries(st.sampled_from([*FIELD_NAMES, "extra", "ID", "reward_model.ground_truth"]),
                       PLAUSIBLE, max_size=7)


@st.composite
def jsonl_line(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["row", "row", "row", "value", "truncated", "bad_utf8", "huge",
                                 "blank", "special"]))
    if kind == "row":
        return json.dumps(draw(ROWS)).encode()
    if kind == "value":
        return json.dumps(draw(JSON_VALUES)).encode()
    if kind == "truncated":
        text = json.dumps(draw(ROWS))
        return text[: draw(st.integers(0, max(0, len(text) - 1)))].encode()
    if kind == "bad_utf8":
        good = json.dumps(draw(ROWS)).encode()
        cut = draw(st.integers(0, len(good)))
        bad = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"]))
        return good[:cut] + bad + good[cut:]
    if kind == "huge":
        return json.dumps({"question": "x" * 300_000, "answer": "1", "problem": "y" * 1000,
                           "solution": "\\boxed{1}", "correct": "a", "options": "a ) 1"}).encode()
    if kind == "blank":
        return draw(st.sampled_from([b"", b"   ", b"\t", b"\r"]))
    return draw(st.sampled_from([
        b'{"question": "q", "answer": NaN}', b'{"question": "q", "answer": 1e999}',
        b'{"question": "q", "answer": ' + b"7" * 5000 + b"}",  # over the int-digit limit
        b"[" * 50_000 + b"]" * 50_000,  # deeper than the JSON decoder's recursion limit
        b'\xef\xbb\xbf{"question": "q", "answer": "1"}',  # a BOM
        b'{"question": "q", "answer": "1"} trailing', b"\x00", b"null", b'"str"',
    ]))


def _nonblank_lines(lines: list[bytes]) -> list[int]:
    """1-based numbers of the lines the reader counts as rows (undecodable lines count)."""
    out = []
    for i, raw in enumerate(lines, start=1):
        try:
            blank = not raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            blank = False
        if not blank:
            out.append(i)
    return out


def _check_file(p: Path, fmt: str, rows: list[int], loc_of: typing.Callable[[int], str]) -> None:
    """``rows``: the locations' numbers the reader should count, in file order."""
    locs = [loc_of(r) for r in rows]
    exs, rep = read_examples(p, format=fmt, on_bad_row="skip")  # never raises for bad rows
    assert rep.total_rows == len(rows)
    assert len(exs) + rep.num_bad == rep.total_rows
    bad_locs = [loc for loc, _ in rep.bad]
    assert all(loc in locs for loc in bad_locs) and bad_locs == sorted(bad_locs, key=locs.index)
    assert all(isinstance(why, str) and why for _, why in rep.bad)
    for ex in exs:
        assert isinstance(ex.question, str) and ex.question.strip()
        assert isinstance(ex.answer, str) and ex.answer
    try:
        exs2, rep2 = read_examples(p, format=fmt, on_bad_row="error")
    except DataError as e:
        msg = str(e)
        assert bad_locs, f"error mode failed but skip mode found nothing bad: {msg}"
        assert msg.startswith(f"{bad_locs[0]}: "), msg  # names the file and the first bad line
        assert "\n" not in msg
    else:
        assert not bad_locs and rep2.num_bad == 0 and len(exs2) == len(exs)


@pytest.mark.parametrize("fmt", FORMATS)
@FUZZ
@given(lines=st.lists(jsonl_line(), max_size=8))
def test_fuzz_jsonl_rows(fmt: str, lines: list[bytes]) -> None:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "fuzz.jsonl"
        p.write_bytes(b"\n".join(lines) + (b"\n" if lines else b""))
        _check_file(p, fmt, _nonblank_lines(lines), lambda n: f"{p}:{n}")


def _column(kind: str, n: int, draw: st.DrawFn) -> pa.Array:
    """A Parquet column of ``n`` values of a (usually wrong) type."""
    if kind == "string":
        return pa.array(draw(st.lists(st.none() | TEXTS, min_size=n, max_size=n)), pa.string())
    if kind == "int":
        return pa.array(draw(st.lists(st.none() | st.integers(-2**63, 2**63 - 1),
                                      min_size=n, max_size=n)), pa.int64())
    if kind == "float":
        return pa.array(draw(st.lists(st.none() | st.floats(), min_size=n, max_size=n)),
                        pa.float64())
    if kind == "bool":
        return pa.array(draw(st.lists(st.none() | st.booleans(), min_size=n, max_size=n)))
    if kind == "binary":
        return pa.array(draw(st.lists(st.binary(max_size=8), min_size=n, max_size=n)),
                        pa.binary())
    if kind == "list":
        return pa.array(draw(st.lists(st.lists(st.integers(0, 9), max_size=3),
                                      min_size=n, max_size=n)), pa.list_(pa.int64()))
    if kind == "chat":
        msgs = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                               "content": st.none() | TEXTS}), max_size=2)
        return pa.array(draw(st.lists(msgs, min_size=n, max_size=n)))
    if kind == "struct":
        return pa.array(draw(st.lists(st.fixed_dictionaries({"ground_truth": TEXTS}),
                                      min_size=n, max_size=n)))
    if kind == "timestamp":
        return pa.array(draw(st.lists(st.integers(0, 2**40), min_size=n, max_size=n)),
                        pa.timestamp("s"))
    if kind == "decimal":
        return pa.array([None] * n, pa.decimal128(10, 2))
    return pa.nulls(n)


@pytest.mark.parametrize("fmt", FORMATS)
@FUZZ
@given(data=st.data())
def test_fuzz_parquet_column_types(fmt: str, data: st.DataObject) -> None:
    n = data.draw(st.integers(0, 5))
    names = data.draw(st.lists(st.sampled_from([*FIELD_NAMES, "reward_model", "extra"]),
                               unique=True, max_size=6))
    kinds = ["string", "string", "int", "float", "bool", "binary", "list", "chat", "struct",
             "timestamp", "decimal", "null"]
    cols = {name: _column(data.draw(st.sampled_from(kinds)), n, data.draw) for name in names}
    table = pa.table(cols) if cols else pa.table({"_": pa.nulls(n)})
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "fuzz.parquet"
        pq.write_table(table, p)
        _check_file(p, fmt, list(range(n)), lambda i: f"{p}:row {i}")


def test_known_bad_lines_are_row_errors(tmp_path: Path) -> None:
    """The cases the fuzzer found: each is a bad row (named by line), never a crash."""
    good = b'{"question": "q", "answer": "1"}'
    bad = [b'{"question": "\xff", "answer": "1"}', b'{"question": "q", "answer": NaN}',
           b'{"question": "q", "answer": 1e999}', b'{"question": "q", "answer": ' + b"7" * 5000
           + b"}", b"[" * 50_000 + b"]" * 50_000]
    for i, line in enumerate(bad):
        p = tmp_path / f"b{i}.jsonl"
        p.write_bytes(good + b"\n" + line + b"\n" + good + b"\n")
        with pytest.raises(DataError, match=rf"^{re.escape(str(p))}:2: "):
            read_examples(p)
        exs, rep = read_examples(p, on_bad_row="skip")
        assert len(exs) == 2 and [loc for loc, _ in rep.bad] == [f"{p}:2"]


def test_parquet_unconvertible_value_is_a_row_error(tmp_path: Path) -> None:
    """A timestamp past year 9999 cannot become a Python datetime: that row is bad, not fatal."""
    p = tmp_path / "ts.parquet"
    pq.write_table(pa.table({"question": ["a", "b"], "answer": ["1", "2"],
                             "when": pa.array([0, 253_402_300_800], pa.timestamp("s"))}), p)
    with pytest.raises(DataError, match=r"ts.parquet:row 1: cannot convert row"):
        read_examples(p)
    exs, rep = read_examples(p, on_bad_row="skip")
    assert [e.answer for e in exs] == ["1"] and [loc for loc, _ in rep.bad] == [f"{p}:row 1"]


# ----------------------------------------------------------------------------- config overrides
def _valid_keys() -> list[str]:
    out = []
    for sec in dataclasses.fields(Config):
        for f in dataclasses.fields(typing.get_type_hints(Config)[sec.name]):
            out.append(f"{sec.name}.{f.name}")
    return out


VALID_KEYS = _valid_keys()
KEY_CHARS = st.characters(blacklist_characters="=", blacklist_categories=("Cs",))


@st.composite
def override_key(draw: st.DrawFn) -> str:
    key = draw(st.sampled_from(VALID_KEYS))
    kind = draw(st.sampled_from(["valid", "valid", "misspelt", "deep", "section", "random"]))
    if kind == "misspelt":
        i = draw(st.integers(0, len(key) - 1))
        key = key[:i] + draw(st.sampled_from(["", "x", "_", key[i] * 2])) + key[i + 1:]
    elif kind == "deep":
        key = key + "".join(draw(st.lists(st.sampled_from([".x", ".0", ".value"]), min_size=1,
                                          max_size=3)))
    elif kind == "section":
        key = key.split(".")[0]
    elif kind == "random":
        key = draw(st.text(KEY_CHARS, max_size=20))
    return key


VALUES = st.one_of(
    st.integers(-10**30, 10**30).map(str),
    st.floats().map(repr),
    st.sampled_from(["nan", "NaN", ".nan", "inf", "-inf", ".inf", "-.inf", "1e400", "-1e400",
                     "null", "~", "", "[1, 2]", "[]", "{}", "{a: 1}", "{question: q}", "-5",
                     "0", "-1", "true", "no", "tiny", "hf", "bfloat16", "skip", "token",
                     "'unterminated", "[[[", "a: b: c", "\x00", "9" * 5000, "[" * 2000,
                     "3e-5", "1_000", "0x10", "2.5", "-0.0", "64", "128"]),
    st.text(max_size=15),
)


def _names_key(msg: str, override: str) -> bool:
    key = override.split("=", 1)[0].strip()
    parts = [p for p in key.split(".") if p]
    if not parts:  # no key to name (messages quote only a prefix of the override)
        return "empty key" in msg
    cands = [key, override, *parts[:1], *parts[-1:]]
    return any(c and (c in msg or repr(c)[1:-1] in msg) for c in cands)


@settings(max_examples=400, deadline=None)
@given(key=override_key(), value=VALUES)
def test_fuzz_config_overrides(key: str, value: str) -> None:
    override = f"{key}={value}"
    try:
        cfg = load_config(None, [override])
    except ConfigError as e:
        msg = str(e)
        assert msg and "\n" not in msg, repr(msg)
        assert _names_key(msg, override), f"{override!r} -> {msg!r}"
    else:
        assert isinstance(cfg, Config)


@settings(max_examples=50, deadline=None)
@given(text=st.text(max_size=30))
def test_fuzz_config_override_without_structure(text: str) -> None:
    """Anything at all (no '=', only dots, ...) is a ConfigError or a config, never a crash."""
    try:
        load_config(None, [text])
    except ConfigError as e:
        assert "\n" not in str(e)


@pytest.mark.parametrize(("override", "needle"), [
    ("model.num_kv_heads=0", "model.num_kv_heads must be > 0"),  # was ZeroDivisionError
    ("model.num_heads=-4", "model.num_heads must be > 0"),
    ("train.steps=" + "1" * 5000, "4300 digits"),  # was ValueError from yaml
    ("data.source=\x00", "unacceptable character"),  # was AttributeError (.problem)
    ("data.source=" + "[" * 3000, "recursion depth"),  # was RecursionError
    ("rollout.temperature=.nan", "finite"),  # was accepted
    ("optim.weight_decay=nan", "finite"),
    ("reward.correct=-.inf", "finite"),
    ("algo.alpha=" + "9" * 400, "finite"),  # was OverflowError
    ("model=0", "expected a mapping"),  # was silently the defaults
    ("model=[]", "expected a mapping"),
])
def test_config_edge_values_are_config_errors(override: str, needle: str) -> None:
    with pytest.raises(ConfigError) as ei:
        load_config(None, [override])
    assert needle in str(ei.value) and "\n" not in str(ei.value)


def test_empty_section_still_means_defaults() -> None:
    assert load_config(None, ["model=null"]).model == load_config(None, ["model=~"]).model


@pytest.mark.parametrize("override,ok", [
    ("rollout.window=64", True),
    ("rollout.windwo=64", False),
    ("algo.alpha=nan", False),
    ("model.num_kv_heads=0", False),
    ("train.steps=" + "1" * 5000, False),
    ("data.source=" + "[" * 3000, False),
    ("model=0", False),
    ("model.hidden_size.x.y=1", False),
])
def test_cli_config_override(override: str, ok: bool) -> None:
    proc = subprocess.run([sys.executable, "-m", "tppo_jax.cli", "config", override],
                          capture_output=True, text=True, timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == (0 if ok else 2), proc.stderr[-2000:]
    if ok:
        assert "window: 64" in proc.stdout
    else:
        assert proc.stderr.count("\n") == 1 and "config error" in proc.stderr
