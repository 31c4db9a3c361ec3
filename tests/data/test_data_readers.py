"""Readers: real-format rows (DAPO, GSM8K, MATH, AIME) and the bad-row policy."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tppo_jax.data.readers import DataError, get_path, last_boxed, read_examples

DAPO_ROWS = [
    {
        "data_source": "math_dapo",
        "prompt": [{"content": "Solve the following math problem. What is 17 + 17?\n\n"
                               "Remember to put your answer on its own line after \"Answer:\".",
                    "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "34", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"},
    },
    {
        "data_source": "math_dapo",
        "prompt": [{"content": "Find $m+n$ where $m/n = 0.75$ in lowest terms.", "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "7", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "b2"},
    },
]
GSM8K_ROWS = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
                 "clips to her friends in May. How many clips did Natalia sell altogether?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = "
               "<<48+24=72>>72 clips altogether in April and May.\n#### 72"},
    {"question": "A shop sells 1,200 pens a day. How many in 2 days?",
     "answer": "1200*2=<<1200*2=2400>>2400\n#### 2,400"},
]
MATH_ROWS = [
    {"problem": "What is $\\frac{1}{4}+\\frac{1}{4}$?", "level": "Level 1", "type": "Prealgebra",
     "solution": "We add: $\\frac14+\\frac14=\\boxed{\\frac{1}{2}}$."},
    {"problem": "Compute $\\sqrt{16}$.", "level": "Level 1", "type": "Algebra",
     "solution": "First $\\boxed{5}$ was a typo; the answer is $\\boxed{\\sqrt{16}=4}$."},
]
AIME_ROWS = [
    {"ID": "2024-I-1", "Problem": "Every morning Aya goes for a walk...", "Solution": "... 204",
     "Answer": 204},
]


def write_jsonl(path: Path, rows: list, raw_lines: tuple[str, ...] = ()) -> Path:
    lines = [json.dumps(r) for r in rows] + list(raw_lines)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_last_boxed_nested_and_last() -> None:
    assert last_boxed(r"$\boxed{\frac{1}{\sqrt{2}}}$") == r"\frac{1}{\sqrt{2}}"
    assert last_boxed(r"\boxed{1} and \boxed{2}") == "2"
    assert last_boxed(r"\boxed 7$") == "7"
    assert last_boxed(r"\fbox{3}") == "3"
    assert last_boxed(r"\boxed{unbalanced") is None
    assert last_boxed("no box") is None


def test_get_path_nested() -> None:
    row = {"a": {"b": [{"c": 5}]}, "x.y": 1}
    assert get_path(row, "a.b.0.c") == 5
    assert get_path(row, "x.y") == 1
    with pytest.raises(KeyError):
        get_path(row, "a.z")


def test_dapo_jsonl(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "dapo.jsonl", DAPO_ROWS)
    exs, rep = read_examples(p, format="dapo", fields={"id": "extra_info.index"})
    assert rep.num_bad == 0 and rep.total_rows == 2
    assert [e.answer for e in exs] == ["34", "7"]
    assert "17 + 17" in exs[0].question
    assert exs[0].id == "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"
    assert exs[0].solution is None and exs[0].source == "dapo.jsonl"


def test_dapo_parquet_nested_struct(tmp_path: Path) -> None:
    p = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist(DAPO_ROWS), p)
    exs, _ = read_examples(p, format="dapo")
    assert [e.answer for e in exs] == ["34", "7"]
    assert exs[1].id == "dapo.parquet-1"


def test_gsm8k(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    exs, _ = read_examples(p, format="gsm8k")
    assert [e.answer for e in exs] == ["72", "2400"]
    assert exs[0].solution is not None and exs[0].solution.endswith("April and May.")
    assert "####" not in exs[0].solution


def test_math_boxed_and_aime_explicit_answer(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "math.jsonl", MATH_ROWS)
    exs, _ = read_examples(p, format="math")
    assert [e.answer for e in exs] == [r"\frac{1}{2}", r"\sqrt{16}=4"]
    a = write_jsonl(tmp_path / "aime.jsonl", AIME_ROWS)
    exs, _ = read_examples(a, format="math", fields={"question": "Problem", "answer": "Answer",
                                                     "solution": "Solution", "id": "ID"})
    assert exs[0].answer == "204" and exs[0].id == "2024-I-1"


BAD_JSONL = (
    '{"question": "ok?", "answer": "1"}',
    '{"question": "broken json", "answer": ',
    '{"question": "no answer field"}',
    '{"question": "empty", "answer": "   "}',
    '{"question": ["not", "a", "string"], "answer": "3"}',
    '{"question": "bool answer", "answer": true}',
    '[1, 2, 3]',
    '{"question": "fine too", "answer": 5}',
)


@pytest.mark.parametrize(
    ("line", "needle"),
    [(2, "invalid JSON"), (3, "missing field 'answer'"), (4, "empty"), (5, "expected str"),
     (6, "bool"), (7, "expected an object")],
)
def test_bad_row_error_names_file_and_line(tmp_path: Path, line: int, needle: str) -> None:
    lines = [BAD_JSONL[0], BAD_JSONL[line - 1]]
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as ei:
        read_examples(p, format="generic")
    msg = str(ei.value)
    assert "bad.jsonl:2" in msg and needle in msg


def test_bad_rows_skip_report_and_log(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    p = tmp_path / "mixed.jsonl"
    p.write_text("\n".join(BAD_JSONL) + "\n\n")  # trailing blank line is ignored
    with caplog.at_level(logging.WARNING):
        exs, rep = read_examples(p, format="generic", on_bad_row="skip")
    assert [e.answer for e in exs] == ["1", "5"]
    assert rep.total_rows == 8 and rep.num_bad == 6
    assert [loc.rsplit(":", 1)[1] for loc, _ in rep.bad] == ["2", "3", "4", "5", "6", "7"]
    assert sum("skipping bad row" in r.message for r in caplog.records) == 6


def test_gsm8k_without_marker_is_bad(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "g.jsonl", [{"question": "q", "answer": "no marker"}])
    with pytest.raises(DataError, match="####"):
        read_examples(p, format="gsm8k")


def test_math_without_box_or_answer_is_bad(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "m.jsonl", [{"problem": "q", "solution": "it is 4"}])
    with pytest.raises(DataError, match=r"m.jsonl:1: .*boxed"):
        read_examples(p, format="math")


def test_parquet_bad_row_index(tmp_path: Path) -> None:
    rows = [{"question": "a", "answer": "1"}, {"question": "b", "answer": None},
            {"question": "c", "answer": ""}]
    p = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist(rows), p)
    with pytest.raises(DataError, match=r"t.parquet:row 1: .*NoneType"):
        read_examples(p)
    exs, rep = read_examples(p, on_bad_row="skip")
    assert len(exs) == 1 and [loc for loc, _ in rep.bad] == [f"{p}:row 1", f"{p}:row 2"]


def test_bad_arguments(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "x.jsonl", [{"question": "q", "answer": "1"}])
    with pytest.raises(ValueError):
        read_examples(p, format="nope")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        read_examples(p, fields={"bogus": "x"})
    with pytest.raises(DataError, match="no such file"):
        read_examples(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match="unsupported"):
        read_examples(write_jsonl(tmp_path / "x.csv", []))


@settings(max_examples=80, deadline=None)
@given(st.recursive(st.text(alphabet="ab1+ ", max_size=4),
                    lambda inner: st.builds(lambda a, b: a + "{" + b + "}", inner, inner),
                    max_leaves=6))
def test_last_boxed_recovers_balanced_content(body: str) -> None:
    assert last_boxed(rf"pre \boxed{{x}} text $\boxed{{{body}}}$ post") == body


def test_limit_and_numeric_answers(tmp_path: Path) -> None:
    rows = [{"question": f"q{i}", "answer": i, "solution": "s"} for i in range(5)]
    exs, rep = read_examples(write_jsonl(tmp_path / "n.jsonl", rows), limit=3)
    assert [e.answer for e in exs] == ["0", "1", "2"] and rep.total_rows == 3
