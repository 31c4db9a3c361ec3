"""Issue 49 M6: ground-truth answers the grader cannot parse (``\\frac{1}{``, ``$$``,
``\\text{}``, ``nan``) loaded and trained: every sample on them graded wrong, or the grader
raised. Each answer is now parsed once at load; an unparseable one is a bad row (refused
naming ``file:line``, or skipped and counted with ``data.on_bad_row=skip``)."""

import json

import pytest

from tppo_jax.data.answers import answer_problem
from tppo_jax.data.readers import DataError, read_examples
from tppo_jax.rewards.grading import grade_one

BAD = ["\\frac{1}{", "$$", "\\text{}", "nan", "1/0"]
GOOD = ["42", "-3.5", "\\frac{1}{2}", "\\text{Tuesday}", "(1,2)", "\\infty", "x+1", "C"]


def _file(tmp_path, answers):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": a}) + "\n"
                            for i, a in enumerate(answers)))
    return path


@pytest.mark.parametrize("answer", BAD)
def test_an_ungradable_answer_is_refused_naming_its_line(tmp_path, answer):
    path = _file(tmp_path, ["7", answer])
    with pytest.raises(DataError) as e:
        read_examples(path)
    msg = str(e.value)
    assert "\n" not in msg and f"{path}:2" in msg and "cannot be graded" in msg


def test_ungradable_answers_are_skipped_and_counted(tmp_path):
    rows, report = read_examples(_file(tmp_path, [*GOOD, *BAD]), on_bad_row="skip")
    assert [r.answer for r in rows] == GOOD
    assert report.num_bad == len(BAD)


@pytest.mark.parametrize("answer", GOOD)
def test_gradable_answers_pass_and_grade_right(answer):
    assert answer_problem(answer) is None
    assert grade_one(f"so \\boxed{{{answer}}}", answer) == "ok"
