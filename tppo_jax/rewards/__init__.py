"""Rewards: math-verify outcome grading in a deadline-owning process pool, DAPO length shaping."""

from tppo_jax.rewards.grader import (
    REASONS,
    GradeResult,
    MathGrader,
    extract_answer,
    grade_one,
    overlong_penalty,
)

__all__ = [
    "REASONS", "GradeResult", "MathGrader", "extract_answer", "grade_one", "overlong_penalty",
]
