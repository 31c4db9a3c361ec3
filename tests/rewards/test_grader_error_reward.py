"""Grader failures (timeout, crash) score the wrong-answer reward, never more."""

from __future__ import annotations

from tppo_jax.rewards.grader import MathGrader

HANG = r"so \boxed{9^{9^{9^{9^9}}}}"  # sympy would try to build this integer forever


def test_timeout_scores_the_wrong_reward_under_plus_minus_one() -> None:
    with MathGrader(num_workers=1, item_timeout_s=1.0, mv_timeout_s=None,
                    correct_reward=1.0, wrong_reward=-1.0) as g:
        r = g.grade([HANG, r"\boxed{4}", r"\boxed{3}"], ["3", "3", "3"])
        assert r.reasons == ["timeout", "wrong", "ok"]
        assert list(r.rewards) == [-1.0, -1.0, 1.0]  # a timeout no longer beats a wrong answer
        assert g.reward_of["crash"] == -1.0


def test_explicit_error_reward_still_wins() -> None:
    g = MathGrader(num_workers=0, wrong_reward=-1.0, error_reward=-0.5)
    assert g.reward_of["timeout"] == g.reward_of["crash"] == -0.5
    assert g.reward_of["no_answer"] == -1.0
