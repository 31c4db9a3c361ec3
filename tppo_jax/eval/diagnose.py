"""What an eval says when its numbers cannot be trusted: why an answer was not graded, a
warning when nearly every answer is missing (the model never writes the answer format the
grader reads), and the tag that keeps eval files of different protocols apart."""

from __future__ import annotations

from typing import Any

NO_ANSWER_WARN = 90.0  # percent of answers without a readable answer worth a warning

# What each answer format (rewards/grader.py ANSWER_FORMATS) reads.
FORMAT_TEXT = {
    "boxed": "a final \\boxed{...}",
    "answer_line": "a final `Answer: X` (or `The answer is X`) line",
    "boxed_or_answer_line": "a final \\boxed{...} or an `Answer: X` line",
    "last_number": "a \\boxed{...}, an `Answer: X` line or at least one number",
}


def why_not_graded(reason: str, answer_format: str) -> str | None:
    """A grader reason (``REASONS``) in words, for a reason that is not a verdict on the
    answer (``no_answer``, ``timeout``, ``crash``); None for ``ok`` and ``wrong``."""
    if reason == "no_answer":
        return (f"no answer found: reward.answer_format={answer_format} reads "
                f"{FORMAT_TEXT.get(answer_format, answer_format)}")
    if reason == "timeout":
        return "grading ran past reward.item_timeout_s (or the batch deadline)"
    if reason == "crash":
        return "the grader raised or its worker died (see the log)"
    return None


def no_answer_warning(no_answer_pct: float | None, answer_format: str) -> str | None:
    """One warning line when over ``NO_ANSWER_WARN`` percent of answers had no readable
    answer: the score measures the format, not the maths, and a run would train on zero
    rewards. None otherwise."""
    if no_answer_pct is None or no_answer_pct <= NO_ANSWER_WARN:
        return None
    return (f"warning: {no_answer_pct:.0f}% of answers had no answer the grader could read "
            f"(reward.answer_format={answer_format} reads "
            f"{FORMAT_TEXT.get(answer_format, answer_format)}). Ask for it in the prompt "
            f"(data.prompt_template / data.system_prompt), or set reward.answer_format "
            f"(boxed, answer_line, boxed_or_answer_line, last_number); see docs/eval.md")


def protocol_tag(protocol: dict[str, Any], *, greedy: bool = False) -> str:
    """``greedy`` (``greedy``, or no samples), else ``<name>-k<samples>-t<temperature>-
    p<top_p>`` of an ``EvalProtocol.to_dict()``: eval files are named by it, so evals drawn
    differently never overwrite each other (an overridden protocol's ``+`` becomes ``x``)."""
    if greedy or not protocol["samples"]:
        return "greedy"
    name = str(protocol["name"]).replace("+", "x")
    return (f"{name}-k{protocol['samples']}-t{protocol['temperature']:g}"
            f"-p{protocol['top_p']:g}")
