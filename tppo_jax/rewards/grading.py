"""Grading one answer (any process): which text of a completion is the answer
(``ANSWER_FORMATS``), math-verify's verdict against the ground truth (``grade_one``), or the
user's reward function's (``grade_item``). ``rewards/grader.py`` runs these in a pool of worker
processes that owns the deadlines.

Reasons per item: ``ok`` (correct), ``wrong``, ``no_answer`` (no ``\\boxed{}`` / unparsable),
``timeout``, ``crash`` (worker died or grading raised).
"""

from __future__ import annotations

import math
import re
import time
from typing import Any

from tppo_jax.data.answers import parse_gold
from tppo_jax.data.formats import last_boxed
from tppo_jax.rewards.custom import call_reward_fn

REASONS = ("ok", "wrong", "no_answer", "timeout", "crash")


# A line that states the answer: "Answer: X" (DAPO's format), or "The (final) answer is X"
# (GSM8K chain-of-thought's, lm-eval-harness's strict match; small instruct models write it).
_ANSWER_LINE = re.compile(
    r"^[ \t]*(?:Answer[ \t]*:|The[ \t]+(?:final[ \t]+)?answer[ \t]+is[ \t]*:?)[ \t]*(.+?)[ \t.]*$",
    re.I | re.M)
# A number as people write them: sign, thousands commas, decimals ("-1,234.5").
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")

# Which answer text is graded:
#   boxed                 the last \boxed{...}
#   answer_line           the last `Answer: X` line (the DAPO-Math-17K prompt's format) or
#                         `The answer is X` line (GSM8K chain of thought's)
#   boxed_or_answer_line  boxed first, else the answer line
#   last_number           boxed, else the answer line, else the last number in the text
#                         (lenient, for GSM8K-style numeric answers)
ANSWER_FORMATS = ("boxed", "answer_line", "boxed_or_answer_line", "last_number")
# The default per data format: DAPO rows ask for the answer line; GSM8K-style numeric sets
# also accept it (instruct models often write "Answer: 42" despite the boxed instruction);
# MATH and the rest are boxed. A weak model that never formats can use last_number.
DEFAULT_ANSWER_FORMATS = {"dapo": "answer_line", "gsm8k": "boxed_or_answer_line",
                          "svamp": "boxed_or_answer_line", "asdiv": "boxed_or_answer_line"}


def answer_format_for(data_format: str, answer_format: str = "auto") -> str:
    """``answer_format``, or the data format's default when it is ``auto``."""
    if answer_format == "auto":
        return DEFAULT_ANSWER_FORMATS.get(data_format, "boxed")
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format {answer_format!r} is not one of {ANSWER_FORMATS}")
    return answer_format


def _answer_line(completion: str) -> str | None:
    lines = _ANSWER_LINE.findall(completion)
    return lines[-1].strip("$ ") if lines else None


def extract_answer(completion: str, *, accept_answer_line: bool = False,
                   answer_format: str | None = None) -> str | None:
    """The graded answer text per ``answer_format`` (see ``ANSWER_FORMATS``); without one,
    the last ``\\boxed{...}``, and with ``accept_answer_line`` a final ``Answer: X`` line as
    the fallback. None when the completion has no answer in that format."""
    fmt = answer_format or ("boxed_or_answer_line" if accept_answer_line else "boxed")
    if fmt not in ANSWER_FORMATS:
        raise ValueError(f"answer_format {fmt!r} is not one of {ANSWER_FORMATS}")
    content = None if fmt == "answer_line" else last_boxed(completion)
    if content is None and fmt != "boxed":
        content = _answer_line(completion)
    if content is None and fmt == "last_number":
        numbers = _NUMBER.findall(completion)
        content = numbers[-1].replace(",", "") if numbers else None
    return content if content and content.strip() else None


def grade_one(
    completion: str,
    answer: str,
    *,
    require_boxed: bool = True,
    accept_answer_line: bool = False,
    answer_format: str | None = None,
    mv_timeout_s: int | None = 1,
) -> str:
    """Grade one completion against a ground-truth answer; returns a reason from REASONS.

    ``require_boxed``: only the last ``\\boxed{...}`` counts (the trained answer format), so an
    unformatted answer is ``no_answer`` even if its number is right (``accept_answer_line``: see
    :func:`extract_answer`, ``answer_format`` overrides both); False lets math-verify search
    the whole text. ``mv_timeout_s`` feeds
    math-verify's own SIGALRM timeouts -- a cheap first line of defence; None disables them
    (required off the main thread).
    """
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    if require_boxed:
        content = extract_answer(completion, accept_answer_line=accept_answer_line,
                                 answer_format=answer_format)
        if content is None:
            return "no_answer"
        pred_text = f"\\boxed{{{content}}}"
    else:
        pred_text = completion
    try:
        gold = parse_gold(answer, mv_timeout_s)
    except TimeoutException:
        return "timeout"
    if not gold:
        raise ValueError(f"unparsable ground-truth answer {answer!r}")
    try:
        pred = parse(pred_text, parsing_timeout=mv_timeout_s, raise_on_error=True)
    except TimeoutException:
        return "timeout"
    except Exception:  # noqa: BLE001 - any parse failure means the answer is unreadable
        return "no_answer"
    if not pred:
        return "no_answer"
    t0 = time.monotonic()
    ok = verify(gold, pred, timeout_seconds=mv_timeout_s)
    # verify() swallows its own timeout and returns False; recover the distinction by the clock.
    if not ok and mv_timeout_s and time.monotonic() - t0 >= mv_timeout_s * 0.95:
        return "timeout"
    return "ok" if ok else "wrong"


def grade_item(grade_kw: dict[str, Any], fn: Any, correct_reward: float, completion: str,
                answer: str, row: dict | None, max_abs: float = math.inf
                ) -> tuple[str, float | None, str | None]:
    """``(reason, reward or None: the reason's, note)`` of one item, by math-verify or by
    the user's reward function ``fn``."""
    if fn is None:
        return grade_one(completion, answer, **grade_kw), None, None
    row = row if row is not None else {"answer": answer}
    return call_reward_fn(fn, str(row.get("question", "")), completion, row, correct_reward,
                          max_abs)
