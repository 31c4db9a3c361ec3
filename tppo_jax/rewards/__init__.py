"""Rewards: math-verify outcome grading in a deadline-owning process pool, DAPO length shaping."""

from tppo_jax.rewards.grader import GradeResult, MathGrader, overlong_penalty
from tppo_jax.rewards.grading import REASONS, extract_answer, grade_one

__all__ = [
    "REASONS", "GradeResult", "MathGrader", "extract_answer", "grade_one", "overlong_penalty",
]
