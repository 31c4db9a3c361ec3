"""Math grading pool: correctness, reasons, deadlines, killed/crashed/recycled workers."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from tppo_jax.rewards.grader import MathGrader, extract_answer, grade_one, overlong_penalty

HANG = r"so \boxed{9^{9^{9^{9^9}}}}"  # sympy would try to build this integer forever


@pytest.fixture(scope="module")
def grader() -> Iterator[MathGrader]:
    with MathGrader(num_workers=2, item_timeout_s=2.0, batch_deadline_s=30.0) as g:
        yield g


def test_reasons_and_rewards(grader: MathGrader) -> None:
    comps = [
        r"12 + 7 = 19" "\n" r"\boxed{19}",  # correct
        r"\boxed{18}",  # wrong
        "The answer is 19.",  # right number, wrong format
        r"$\boxed{0.5}$",  # latex-equivalent
        r"\boxed{\frac{2}{4}}",
        r"first \boxed{3} then \boxed{19}",  # the last box counts
        r"\boxed{}",  # empty box
        r"\boxed{9^9^9^9^9}",  # huge but computable: simply wrong
    ]
    answers = ["19", "19", "19", r"\frac{1}{2}", "0.5", "19", "19", "3"]
    r = grader.grade(comps, answers)
    assert r.reasons == ["ok", "wrong", "no_answer", "ok", "ok", "ok", "no_answer", "wrong"]
    assert r.rewards.dtype == np.float32 and r.correct.dtype == bool
    np.testing.assert_array_equal(r.rewards, [1, 0, 0, 1, 1, 1, 0, 0])
    assert r.counts == {"ok": 4, "wrong": 2, "no_answer": 2, "timeout": 0, "crash": 0}


def test_batch_of_64_is_fast(grader: MathGrader) -> None:
    comps = [rf"... \boxed{{{i}}}" for i in range(64)]
    answers = [str(i if i % 2 else i + 1) for i in range(64)]
    t0 = time.monotonic()
    r = grader.grade(comps, answers)
    assert time.monotonic() - t0 < 2.0
    assert r.counts["ok"] == 32 and r.counts["wrong"] == 32
    assert grader.grade([], []).rewards.shape == (0,)


def test_pathological_answer_times_out_inside_deadline(grader: MathGrader) -> None:
    t0 = time.monotonic()
    r = grader.grade([HANG, r"\boxed{3}"], ["3", "3"])
    assert time.monotonic() - t0 < 4.0
    assert r.reasons == ["timeout", "ok"] and r.rewards[0] == 0.0


def test_hung_worker_is_killed_and_replaced() -> None:
    # Inner math-verify timeout off: only the pool's kill can end the item.
    with MathGrader(num_workers=2, item_timeout_s=1.0, mv_timeout_s=None) as g:
        t0 = time.monotonic()
        r = g.grade([HANG, r"\boxed{1}", r"\boxed{2}"], ["3", "1", "2"])
        assert time.monotonic() - t0 < 3.0
        assert r.reasons == ["timeout", "ok", "ok"]
        assert g.stats["killed"] == 1 and g.stats["started"] == 3
        assert g.grade([r"\boxed{5}"] * 4, ["5"] * 4).counts["ok"] == 4  # pool still healthy


def test_batch_deadline_bounds_the_call() -> None:
    with MathGrader(num_workers=2, item_timeout_s=30.0, batch_deadline_s=1.5,
                    mv_timeout_s=None) as g:
        t0 = time.monotonic()
        r = g.grade([HANG] * 5 + [r"\boxed{1}"], ["3"] * 5 + ["1"])
        assert time.monotonic() - t0 < 3.0
        assert r.counts["timeout"] == 6  # queued items behind the hung ones time out too
        assert g.grade([r"\boxed{1}"], ["1"]).reasons == ["ok"]


def _grade_and_kill(g: MathGrader, comps: list[str], answers: list[str]) -> dict:
    """Grade in a thread and SIGKILL the (single) busy worker mid-item, like a segfault/OOM."""
    out: dict = {}
    th = threading.Thread(target=lambda: out.setdefault("r", g.grade(comps, answers)))
    th.start()
    time.sleep(0.5)
    os.kill(g.worker_pids()[0], signal.SIGKILL)
    th.join(timeout=10)
    return out


def test_crashed_worker_scores_zero_and_is_replaced() -> None:
    with MathGrader(num_workers=1, item_timeout_s=20.0, mv_timeout_s=None, crash_retries=0) as g:
        pids = g.worker_pids()
        out = _grade_and_kill(g, [HANG], ["3"])
        assert out["r"].reasons == ["crash"] and out["r"].counts["crash"] == 1
        assert g.grade([r"\boxed{2}", r"\boxed{3}"], ["2", "3"]).counts["ok"] == 2
        assert set(g.worker_pids()).isdisjoint(pids)
        assert g.stats["died"] == 1


def test_crashed_item_is_retried_on_a_fresh_worker() -> None:
    with MathGrader(num_workers=1, item_timeout_s=1.5, mv_timeout_s=None, crash_retries=1) as g:
        out = _grade_and_kill(g, [HANG, r"\boxed{1}"], ["3", "1"])
        # The retry hangs again and is then ended by the item timeout, not reported as a crash.
        assert out["r"].reasons == ["timeout", "ok"]
        assert g.stats["died"] == 1 and g.stats["killed"] == 1


def test_workers_are_recycled() -> None:
    with MathGrader(num_workers=1, max_tasks_per_child=3) as g:
        first = g.worker_pids()
        r = g.grade([rf"\boxed{{{i}}}" for i in range(7)], [str(i) for i in range(7)])
        assert r.counts["ok"] == 7
        assert g.stats["recycled"] == 2 and g.worker_pids() != first


def test_reward_values_and_inline_mode() -> None:
    g = MathGrader(num_workers=0, correct_reward=1.0, wrong_reward=-1.0, no_answer_reward=-1.0)
    r = g.grade([r"\boxed{4}", r"\boxed{5}", "4"], ["4", "4", "4"])
    np.testing.assert_array_equal(r.rewards, [1.0, -1.0, -1.0])
    g.close()
    with pytest.raises(RuntimeError):
        g.grade([], [])
    with pytest.raises(ValueError):
        MathGrader(num_workers=0).grade(["a"], [])


def test_grade_one_unboxed_mode() -> None:
    assert grade_one("so the result is 42", "42", require_boxed=False) == "ok"
    assert grade_one("so the result is 42", "42") == "no_answer"


def test_overlong_penalty_matches_dapo() -> None:
    lengths = np.array([10, 60, 75, 90, 100, 130])
    got = overlong_penalty(lengths, max_len=100, buffer_len=40, penalty=1.0)
    np.testing.assert_allclose(got, [0.0, 0.0, -0.375, -0.75, -1.0, -1.0])
    assert got.dtype == np.float32
    np.testing.assert_allclose(overlong_penalty([80], 100, 40, penalty=0.5), [-0.25])
    with pytest.raises(ValueError):
        overlong_penalty([1], 10, 0)


def test_spawn_context_and_fork_refused() -> None:
    with MathGrader(num_workers=1, mp_context="spawn", max_tasks_per_child=2) as g:
        r = g.grade([r"\boxed{1}", r"\boxed{2}", r"\boxed{\frac{1}{2}}"], ["1", "3", "0.5"])
        assert r.reasons == ["ok", "wrong", "ok"] and g.stats["recycled"] == 1
    with pytest.raises(ValueError):
        MathGrader(num_workers=1, mp_context="fork")


def test_extract_answer_formats() -> None:
    assert extract_answer(r"x \boxed{\frac{1}{2}} y") == r"\frac{1}{2}"
    dapo = "Work...\nAnswer: $34$."
    assert extract_answer(dapo) is None
    assert extract_answer(dapo, accept_answer_line=True) == "34"
    assert extract_answer(r"Answer: 3" "\n" r"\boxed{4}", accept_answer_line=True) == "4"
    assert extract_answer(r"\boxed{ }") is None
    assert grade_one(dapo, "34", accept_answer_line=True) == "ok"


def test_the_answer_is_line_is_an_answer_line() -> None:
    """GSM8K chain of thought's closing sentence counts as the answer line; the same words
    inside a sentence, or a bare last number, do not (the grade stays strict)."""
    fmt = {"answer_format": "answer_line"}
    assert extract_answer("2 + 1 = 3.\nThe answer is: 3", **fmt) == "3"
    assert extract_answer("The final answer is 12.\n\nThe answer", **fmt) == "12"
    assert extract_answer("The answer is 6.\nThe answer is 7.", **fmt) == "7"  # the last one
    assert extract_answer("So, the answer is 6.", **fmt) is None
    assert extract_answer("2 + 1 = 3", **fmt) is None
    assert extract_answer("The answer is 6", answer_format="boxed") is None
    assert grade_one("Mia has 3.\nThe answer is 3.", "3",
                     answer_format="boxed_or_answer_line") == "ok"


def test_mixed_batch_with_hangs_keeps_other_results() -> None:
    with MathGrader(num_workers=2, item_timeout_s=1.0, mv_timeout_s=None) as g:
        comps = [rf"\boxed{{{i}}}" for i in range(40)]
        comps[5] = comps[23] = HANG
        t0 = time.monotonic()
        r = g.grade(comps, [str(i) for i in range(40)])
        assert time.monotonic() - t0 < 4.0
        assert [i for i, x in enumerate(r.reasons) if x != "ok"] == [5, 23]
        assert r.counts == {"ok": 38, "wrong": 0, "no_answer": 0, "timeout": 2, "crash": 0}


def test_from_config_maps_the_reward_section() -> None:
    from tppo_jax.config import RewardConfig

    rc = RewardConfig(workers=0, correct=2.0, wrong=-1.0, no_answer=-0.5, error=-2.0,
                      max_tasks_per_child=7, crash_retries=3, verify_timeout_s=None)
    g = MathGrader.from_config(rc, "gsm8k")
    assert g.reward_of == {"ok": 2.0, "wrong": -1.0, "no_answer": -0.5, "timeout": -2.0,
                           "crash": -2.0}
    assert g.grade_kw["answer_format"] == "boxed_or_answer_line"  # gsm8k's default
    assert g.grade_kw["mv_timeout_s"] is None
    assert (g.max_tasks_per_child, g.crash_retries) == (7, 3)
    r = g.grade(["so\nAnswer: 4", r"\boxed{5}", "no answer here"], ["4", "4", "4"])
    assert r.reasons == ["ok", "wrong", "no_answer"] and r.rewards.tolist() == [2.0, -1.0, -0.5]
    g.close()
    boxed = MathGrader.from_config(RewardConfig(workers=0, answer_format="boxed"), "gsm8k")
    assert boxed.grade(["so\nAnswer: 4"], ["4"]).reasons == ["no_answer"]
    boxed.close()
