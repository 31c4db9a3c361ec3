"""Synthetic task: exact answers, format, noise levels, long tail, determinism, disjoint splits."""

from __future__ import annotations

import re
import statistics
from fractions import Fraction

import pytest

from tppo_jax.data.readers import last_boxed
from tppo_jax.data.synthetic import SyntheticMathTask, length_histogram, length_stats

LINE = re.compile(r"^(\d+) ([-+*/]) (\d+) = (\d+)$")
PHRASES = [
    (re.compile(r"gets (\d+) more"), "+"),
    (re.compile(r"gives away (\d+)"), "-"),
    (re.compile(r"doubles them"), "*2"),
    (re.compile(r"triples them"), "*3"),
    (re.compile(r"keeps 1/(\d+) of them"), "/"),
]


@pytest.fixture(scope="module")
def task() -> SyntheticMathTask:
    return SyntheticMathTask(seed=7)


@pytest.fixture(scope="module")
def train512(task: SyntheticMathTask) -> list:
    return task.sample(512)


def recompute(question: str) -> Fraction:
    """Independent solver: read the word problem back with regexes, compute with Fractions."""
    start = int(re.search(r"has (\d+) ", question).group(1))  # type: ignore[union-attr]
    body = question.split(". ", 1)[1].split(". How many")[0]
    v = Fraction(start)
    for clause in body.split(", then "):
        for pat, op in PHRASES:  # noqa: B007 - op is used after the break
            m = pat.search(clause)
            if m:
                break
        else:
            raise AssertionError(f"unknown clause {clause!r}")
        if op == "+":
            v += int(m.group(1))
        elif op == "-":
            v -= int(m.group(1))
        elif op.startswith("*"):
            v *= int(op[1])
        else:
            v /= int(m.group(1))
    return v


def test_answers_are_right_and_solution_consistent(train512: list) -> None:
    for ex in train512:
        assert Fraction(ex.answer) == recompute(ex.question)
        lines = ex.solution.split("\n")
        assert last_boxed(lines[-1]) == ex.answer and lines[-1] == f"\\boxed{{{ex.answer}}}"
        prev = None
        for line in lines[:-1]:
            a, op, b, r = LINE.match(line).groups()  # type: ignore[union-attr]
            assert Fraction(eval(f"{a}{op}{b}")) == int(r)  # each worked line is exact
            assert prev is None or int(a) == prev  # and chains from the previous one
            prev = int(r)
        assert prev == int(ex.answer)


def test_long_tailed_steps(train512: list) -> None:
    steps = [ex.solution.count("\n") for ex in train512]
    med = statistics.median(steps)
    assert med <= 3
    assert max(steps) / med >= 3
    lens = [len(ex.solution) for ex in train512]
    assert length_stats(lens)["max_over_median"] >= 3


def test_difficulty_shifts_length(task: SyntheticMathTask) -> None:
    easy = SyntheticMathTask(seed=1, difficulty=0.3).sample(200)
    hard = SyntheticMathTask(seed=1, difficulty=4.0).sample(200)
    mean = lambda xs: sum(x.solution.count("\n") for x in xs) / len(xs)  # noqa: E731
    assert mean(hard) > 2 * mean(easy)


def test_deterministic_by_seed(task: SyntheticMathTask, train512: list) -> None:
    assert SyntheticMathTask(seed=7).sample(512) == train512
    assert task.sample(10) == train512[:10]  # prefix-stable
    assert SyntheticMathTask(seed=8).sample(10) != train512[:10]


def test_train_test_disjoint(task: SyntheticMathTask, train512: list) -> None:
    test = task.sample(300, split="test")
    assert {e.question for e in test}.isdisjoint({e.question for e in train512})
    assert all(task.split_of(e.question) == "test" for e in test)
    assert all(e.id.startswith("syn-test-") for e in test)
    with pytest.raises(ValueError):
        task.sample(1, split="valid")


def test_teacher_noise_fractions(task: SyntheticMathTask) -> None:
    n = 400
    recs = task.teacher_records(n, wrong_step_frac=0.25, no_format_frac=0.1)
    wrong = [r for r in recs if r.wrong_step is not None]
    unformatted = [r for r in recs if not r.formatted]
    assert len(wrong) == 100 and len(unformatted) == 40
    for r in recs:
        assert r.text.startswith(task.prompt(r.example))
        boxed = last_boxed(r.text)
        if r.formatted:
            assert boxed == r.final
        else:
            assert boxed is None and r.final in r.text.splitlines()[-1]
        # A wrong step always propagates to a wrong final answer; correct ones stay correct.
        assert (Fraction(r.final) != Fraction(r.example.answer)) == (r.wrong_step is not None)
        if r.wrong_step is not None:
            lines = r.text.split("A: ", 1)[1].split("\n")[:-1]
            bad = []
            for i, line in enumerate(lines):
                a, op, b, res = LINE.match(line).groups()  # type: ignore[union-attr]
                if Fraction(eval(f"{a}{op}{b}")) != int(res):
                    bad.append(i)
            assert bad == [r.wrong_step]  # exactly one faulty line, later lines consistent
    texts = task.teacher_corpus(n, 0.25, 0.1)
    assert texts == [r.text for r in recs]


def test_teacher_fraction_validation(task: SyntheticMathTask) -> None:
    with pytest.raises(ValueError):
        task.teacher_corpus(5, wrong_step_frac=1.5)


def test_length_histogram(train512: list) -> None:
    h = length_histogram([e.solution for e in train512], bins=8)
    lines = h.splitlines()
    assert len(lines) <= 9 and "median=" in lines[-1] and "max/median=" in lines[-1]
    assert sum(int(ln.split()[1]) for ln in lines[:-1]) == 512
    assert length_histogram([]) == "(no data)"
    assert "n=3" in length_histogram([5, 5, 5])
