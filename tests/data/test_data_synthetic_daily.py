"""The long-tail task (configs/longtail.yaml): short daily questions, long worked solutions."""

import statistics

import pytest
import sympy

from tppo_jax.config import ConfigError, load_config
from tppo_jax.data.run_data import synthetic_task
from tppo_jax.data.synthetic import SyntheticMathTask


def test_daily_problem_is_one_step_per_day_with_exact_answer():
    task = SyntheticMathTask(seed=3, difficulty=5.0, max_steps=32, max_operand=9, max_value=99,
                             style="daily")
    for prob, ex in zip(task.problems(300), task.sample(300), strict=True):
        (op, x), n = prob.steps[0], len(prob.steps)
        assert set(prob.steps) == {(op, x)} and op in "+-"
        assert f"after {n} days?" in ex.question and "Each day" in ex.question
        lines = ex.solution.splitlines()
        assert len(lines) == n + 1 and lines[-1] == f"\\boxed{{{ex.answer}}}"
        assert all(line.startswith(f"day {i + 1} of {n}: ") for i, line in enumerate(lines[:-1]))
        want = prob.start + n * x if op == "+" else prob.start - n * x
        assert sympy.Integer(ex.answer) == want and 0 <= want <= 99


def test_daily_lengths_are_long_tailed_up_to_max_steps():
    task = synthetic_task(load_config("longtail"))
    n = [len(p.steps) for p in task.problems(4000)]
    assert statistics.median(n) <= 6 and max(n) == 26  # median far below the cap, tail reaches it
    assert sum(k >= 20 for k in n) / len(n) > 0.02


def test_daily_teacher_errors_propagate():
    task = synthetic_task(load_config("longtail"))
    recs = task.teacher_records(200, wrong_step_frac=0.5, no_format_frac=0.0)
    wrong = [r for r in recs if r.wrong_step is not None]
    assert len(wrong) == 100 and all(r.final != r.example.answer for r in wrong)
    assert all("day 1 of " in r.text for r in recs)


def test_daily_needs_room_for_its_values():
    with pytest.raises(ConfigError, match="data.max_value"):
        load_config("longtail", ["data.max_value=20"])
    with pytest.raises(ValueError, match="style"):
        SyntheticMathTask(style="weekly")
