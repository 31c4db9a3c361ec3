"""Extra readers (MathQA, SVAMP, ASDiv, generic field mapping) over real-format rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tppo_jax.data.formats import parse_options
from tppo_jax.data.readers import DataError, read_examples

MATHQA_ROWS = [
    {"Problem": "the banker ' s gain of a certain sum due 3 years hence at 10 % per annum is rs . "
                "36 . what is the present worth ?",
     "Rationale": "\"explanation : t = 3 years r = 10 % td = ( bg × 100 ) / tr = ( 36 × 100 ) / "
                  "( 3 × 10 ) = 12 × 10 = rs . 120 answer : option a\"",
     "options": "a ) rs . 400 , b ) rs . 300 , c ) rs . 500 , d ) rs . 350 , e ) none of these",
     "correct": "a", "annotated_formula": "divide(multiply(const_100, divide(multiply(36, "
                                          "const_100), multiply(3, 10))), multiply(3, 10))",
     "linear_formula": "multiply(n2,const_100)|", "category": "gain"},
    {"Problem": "a train 125 m long passes a man , running at 5 km / hr in the same direction in "
                "which the train is going , in 10 sec . the speed of the train is ?",
     "Rationale": "\"speed of the train relative to man = 125 / 10 = 25 / 2 m / sec .\"",
     "options": "a ) 38 , b ) 27.675 , c ) 30 , d ) 40 , e ) 44", "correct": "b",
     "category": "physics"},
    {"Problem": "what is 1 / 2 of 9 ?", "Rationale": "9 / 2 = 4 . 5",
     "options": ["a ) 4 . 5", "b ) 3", "c ) 2", "d ) 1", "e ) 0"], "correct": "a",
     "category": "general"},
]
SVAMP_ROWS = [
    {"ID": "chal-1", "Body": "Each pack of dvds costs 76 dollars. If there is a discount of 25 "
                             "dollars on each pack",
     "Question": "How much do you have to pay to buy each pack?",
     "Equation": "( 76.0 - 25.0 )", "Answer": 51.0, "Type": "Subtraction"},
    {"ID": "chal-2", "Body": "Dan had $ 3 left with him after he bought a candy bar. If he had a "
                             "total of $ 4 at the start",
     "Question": "How much did the candy bar cost?", "Equation": "( 4.0 - 3.0 )", "Answer": 1.0,
     "Type": "Subtraction"},
    {"ID": "chal-3", "Body": "A pizza is cut into 8 slices.", "Question": "What is 3/8 of it?",
     "Equation": "( 3.0 / 8.0 )", "Answer": 0.375, "Type": "Common-Division"},
]
ASDIV_ROWS = [
    {"body": "Seven red apples and two green apples are in the basket.",
     "question": "How many apples are in the basket?", "solution_type": "Addition",
     "answer": "9 (apples)", "formula": "7+2=9"},
    {"body": "Ellen has six more balls than Marin. Marin has nine balls.",
     "question": "How many balls does Ellen have?", "solution_type": "Addition",
     "answer": "15 (balls)", "formula": "6+9=15"},
    {"question": "What is 3 + 4?", "answer": 7},
]


def _write_jsonl(path: Path, rows: list[Any], bad_line: str | None = None) -> Path:
    lines = [json.dumps(r) for r in rows]
    if bad_line is not None:
        lines.insert(1, bad_line)  # the malformed row is on line 2
    path.write_text("\n".join(lines) + "\n")
    return path


def _check_bad_row(path: Path, fmt: str, n_good: int, needle: str) -> None:
    """error: DataError naming file:2; skip: the row is counted and the rest are read."""
    with pytest.raises(DataError, match=rf"{path.name}:2: .*{needle}"):
        read_examples(path, format=fmt)  # type: ignore[arg-type]
    exs, rep = read_examples(path, format=fmt, on_bad_row="skip")  # type: ignore[arg-type]
    assert len(exs) == n_good
    assert rep.num_bad == 1 and rep.total_rows == n_good + 1
    assert rep.bad[0][0].endswith(":2")


def test_mathqa_reads_option_text(tmp_path: Path) -> None:
    exs, rep = read_examples(_write_jsonl(tmp_path / "mathqa.jsonl", MATHQA_ROWS), format="mathqa")
    assert rep.num_bad == 0
    assert [e.answer for e in exs] == ["rs . 400", "27.675", "4.5"]
    assert exs[1].question.startswith("a train 125 m long")
    assert exs[0].solution is not None and exs[0].solution.startswith("\"explanation")
    assert exs[2].id == "mathqa.jsonl-2"


def test_mathqa_bad_row(tmp_path: Path) -> None:
    bad = dict(MATHQA_ROWS[1], correct="f")  # the letter points at no option
    p = _write_jsonl(tmp_path / "mq.jsonl", MATHQA_ROWS, json.dumps(bad))
    _check_bad_row(p, "mathqa", 3, "correct option 'f'")


def test_parse_options_forms() -> None:
    assert parse_options("a ) 38 , b ) 27.675 , c ) 30 , d ) 40 , e ) 44") == {
        "a": "38", "b": "27.675", "c": "30", "d": "40", "e": "44"}
    assert parse_options(["12", "15", "18"]) == {"a": "12", "b": "15", "c": "18"}
    assert parse_options("a ) 1 , 200 , b ) 3 / 4")["a"] == "1200"
    with pytest.raises(ValueError, match="cannot parse options"):
        parse_options("38 or 40")


def test_svamp(tmp_path: Path) -> None:
    exs, _ = read_examples(_write_jsonl(tmp_path / "svamp.jsonl", SVAMP_ROWS), format="svamp")
    assert [e.answer for e in exs] == ["51", "1", "0.375"]
    assert exs[0].question == ("Each pack of dvds costs 76 dollars. If there is a discount of 25 "
                               "dollars on each pack How much do you have to pay to buy each pack?")
    assert exs[0].solution == "( 76.0 - 25.0 )" and exs[0].id == "chal-1"
    bad = {k: v for k, v in SVAMP_ROWS[0].items() if k != "Answer"}
    p = _write_jsonl(tmp_path / "sv.jsonl", SVAMP_ROWS, json.dumps(bad))
    _check_bad_row(p, "svamp", 3, "missing field 'Answer'")


def test_svamp_non_numeric_answer_is_bad(tmp_path: Path) -> None:
    p = _write_jsonl(tmp_path / "sv.jsonl", [SVAMP_ROWS[0], dict(SVAMP_ROWS[1], Answer="lots")])
    with pytest.raises(DataError, match="sv.jsonl:2: SVAMP answer 'lots' is not a number"):
        read_examples(p, format="svamp")


def test_asdiv(tmp_path: Path) -> None:
    exs, _ = read_examples(_write_jsonl(tmp_path / "asdiv.jsonl", ASDIV_ROWS), format="asdiv")
    assert [e.answer for e in exs] == ["9", "15", "7"]
    assert exs[0].question.endswith("basket. How many apples are in the basket?")
    assert exs[0].solution == "7+2=9" and exs[2].solution is None
    p = _write_jsonl(tmp_path / "ad.jsonl", ASDIV_ROWS, '{"question": "How many?", "answer": ')
    _check_bad_row(p, "asdiv", 3, "invalid JSON")
    p2 = _write_jsonl(tmp_path / "ad2.jsonl", ASDIV_ROWS, json.dumps({"question": "Q?",
                                                                      "answer": None}))
    _check_bad_row(p2, "asdiv", 3, "field 'answer' is NoneType")


def test_extra_formats_from_parquet(tmp_path: Path) -> None:
    p = tmp_path / "svamp.parquet"
    pq.write_table(pa.Table.from_pylist(SVAMP_ROWS), p)
    exs, _ = read_examples(p, format="svamp")
    assert [e.answer for e in exs] == ["51", "1", "0.375"]
    p2 = tmp_path / "mathqa.parquet"
    pq.write_table(pa.Table.from_pylist([MATHQA_ROWS[1], dict(MATHQA_ROWS[0], options="none")]),
                   p2)
    with pytest.raises(DataError, match=r"mathqa.parquet:row 1: cannot parse options"):
        read_examples(p2, format="mathqa")


def test_generic_mapping_any_field_names(tmp_path: Path) -> None:
    rows = [
        {"Problem Text": "What is 2+2?", "meta": {"gold": 4, "uid": 17}, "work": "2+2=4"},
        {"Problem Text": "What is 3*3?", "meta": {"gold": "9", "uid": 18}, "work": "3*3=9"},
        {"Problem Text": "", "meta": {"gold": "1", "uid": 19}},
    ]
    p = _write_jsonl(tmp_path / "custom.jsonl", rows)
    fields = {"question": "Problem Text", "answer": "meta.gold", "solution": "work",
              "id": "meta.uid"}
    with pytest.raises(DataError, match=r"custom.jsonl:3: field 'Problem Text' is empty"):
        read_examples(p, format="generic", fields=fields)
    exs, rep = read_examples(p, format="generic", fields=fields, on_bad_row="skip")
    assert [(e.id, e.question, e.answer, e.solution) for e in exs] == [
        ("17", "What is 2+2?", "4", "2+2=4"), ("18", "What is 3*3?", "9", "3*3=9")]
    assert rep.num_bad == 1
    # Extra formats take overrides too (e.g. a MathQA dump with lower-case column names).
    mq = [{"problem": r["Problem"], "opts": r["options"], "ans": r["correct"]}
          for r in MATHQA_ROWS[1:2]]
    exs, _ = read_examples(_write_jsonl(tmp_path / "mq.jsonl", mq), format="mathqa",
                           fields={"question": "problem", "options": "opts", "answer": "ans",
                                   "solution": None})
    assert exs[0].answer == "27.675" and exs[0].solution is None
    with pytest.raises(ValueError, match="unknown field keys"):
        read_examples(p, format="generic", fields={"body": "x"})
