"""Ground-truth answers as the grader reads them: math-verify's parse of one, and whether it
can be graded at all (checked once per row when a dataset loads, so an ungradable row is a bad
row, not a run of zero rewards).

Data parsing asks this module, below the grader; ``rewards/grading.py`` compares samples
against the same ``parse_gold``. math-verify and sympy are imported on first use.
"""

from __future__ import annotations

import re
from typing import Any


def parse_gold(answer: str, mv_timeout_s: int | None = 1) -> list[Any]:
    """math-verify's reading of a ground-truth answer: as a boxed answer, else as it is
    (the one parse grading compares samples against)."""
    from math_verify import parse

    gold = parse(f"\\boxed{{{answer}}}", parsing_timeout=mv_timeout_s)
    return gold or parse(answer, parsing_timeout=mv_timeout_s)


# A plain integer or decimal: always gradable, so loading skips parsing it.
_PLAIN_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def answer_problem(answer: str) -> str | None:
    """Why no sample could be graded right against ground truth ``answer`` (None: it can),
    checked once per row when a dataset loads: math-verify reads no expression in it
    (``$$``, ``\\text{}``, ``\\frac{1}{``, which match only as raw text), or it is not
    a number (``nan``, ``1/0``)."""
    import threading

    import sympy
    from math_verify.errors import TimeoutException

    text = answer.strip()
    if _PLAIN_NUMBER.fullmatch(text):
        return None
    if text.lower().lstrip("+-") == "nan":
        return "not a number"
    main = threading.current_thread() is threading.main_thread()  # SIGALRM timeouts
    try:
        gold = parse_gold(answer, 5 if main else None)
    except TimeoutException:
        return "math-verify timed out parsing it"
    except Exception as e:  # noqa: BLE001 - any parse failure: the grader cannot use it
        return f"math-verify cannot parse it ({type(e).__name__})"
    exprs = [g for g in gold if not isinstance(g, str)]
    if not exprs:
        return "math-verify reads no math expression in it"
    if any(g is sympy.nan or g is sympy.zoo for g in exprs):
        return "not a number"
    return None
