"""Row parsers for the extra formats of :func:`tppo_jax.data.readers.read_examples`.

- ``mathqa``: MathQA rows ``Problem``, ``Rationale``, ``options`` (the string
  ``"a ) 38 , b ) 27.675 , c ) 30 , d ) 40 , e ) 44"`` or a list of option strings) and ``correct``
  (a letter); the answer is the text of the option the letter points to.
- ``svamp``: SVAMP rows ``Body``, ``Question``, ``Equation``, ``Answer`` (a number); the question is
  ``Body + " " + Question`` and the equation is kept as the solution.
- ``asdiv``: ASDiv-style rows ``question`` (+ optional ``body``), ``answer`` (units in a trailing
  parenthesis, ``"9 (apples)"``, are dropped) and optional ``formula`` (kept as the solution).

Each parser gets the ``need`` / ``maybe`` field accessors of ``readers.parse_row`` (so field
overrides and dotted paths work the same for every format) and raises ValueError/KeyError on a
malformed row; the caller turns that into a DataError or a skipped-row entry.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from tppo_jax.data.readers import _as_text, _numeric_or_text

Getter = Callable[[str], Any]
Parsed = tuple[str, str, str | None]  # (question, answer, solution)

# An option label: `a )`, `b)`, `(c)`, `d .` at the start of the string or after a comma.
_OPTION_LABEL = re.compile(r"(?:^|,)\s*\(?\s*([a-eA-E])\s*[).:]\s*")


def _number_text(value: float | int) -> str:
    """``7.0 -> "7"``, ``2.5 -> "2.5"``: SVAMP stores every answer as a float."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value)


def _clean_option(text: str) -> str:
    """MathQA tokenizes options with spaces (``"27 . 5"``, ``"rs . 400"``): rejoin the numbers."""
    text = re.sub(r"(?<=\d) \. (?=\d)", ".", text.strip().rstrip(",").strip())
    return re.sub(r"(?<=\d) , (?=\d{3}\b)", "", text)


def parse_options(options: Any) -> dict[str, str]:
    """MathQA options -> ``{"a": "38", "b": "27.675", ...}``.

    Accepts the original string form or a list (items either labelled ``"a ) 38"`` or bare, in
    which case the position gives the letter). Raises ValueError when nothing parses.
    """
    if isinstance(options, list | tuple):
        out: dict[str, str] = {}
        for i, item in enumerate(options):
            if not isinstance(item, str | int | float) or isinstance(item, bool):
                raise ValueError(f"option {i} is {type(item).__name__}, expected str")
            text = str(item)
            m = _OPTION_LABEL.match(text)
            letter = m.group(1).lower() if m else "abcdefghij"[i]
            out[letter] = _clean_option(text[m.end():] if m else text)
        return out
    if not isinstance(options, str):
        raise ValueError(f"options is {type(options).__name__}, expected str or list")
    labels = list(_OPTION_LABEL.finditer(options))
    if not labels:
        raise ValueError(f"cannot parse options {options[:80]!r} (expected 'a ) .. , b ) ..')")
    out = {}
    for k, m in enumerate(labels):
        end = labels[k + 1].start() if k + 1 < len(labels) else len(options)
        out[m.group(1).lower()] = _clean_option(options[m.end():end])
    return out


def parse_mathqa(need: Getter, maybe: Getter, fields: Mapping[str, str | None]) -> Parsed:
    """MathQA row -> (Problem, text of the correct option, Rationale)."""
    question = _as_text(need("question"), fields["question"] or "Problem")
    options = parse_options(need("options"))
    letter = _as_text(need("answer"), fields["answer"] or "correct").strip().lower()
    if letter not in options:
        raise ValueError(f"correct option {letter!r} is not among the options {sorted(options)}")
    answer = options[letter]
    if not answer:
        raise ValueError(f"option {letter!r} is empty")
    sol = maybe("solution")
    solution = _as_text(sol, fields["solution"] or "solution") if sol else None
    return question, answer, solution


def parse_svamp(need: Getter, maybe: Getter, fields: Mapping[str, str | None]) -> Parsed:
    """SVAMP row -> (Body + " " + Question, Answer, Equation)."""
    question = _as_text(need("question"), fields["question"] or "Question").strip()
    body = maybe("body")
    if body is not None:
        question = f"{_as_text(body, fields['body'] or 'Body').strip()} {question}"
    raw = need("answer")
    if isinstance(raw, float | int) and not isinstance(raw, bool):
        answer = _number_text(raw)
    else:
        answer = _numeric_or_text(raw, fields["answer"] or "Answer")
        try:
            answer = _number_text(float(answer))
        except ValueError:
            raise ValueError(f"SVAMP answer {answer!r} is not a number") from None
    eq = maybe("solution")
    solution = _as_text(eq, fields["solution"] or "Equation").strip() if eq else None
    return question, answer, solution


_UNITS = re.compile(r"^(.*?\S)\s*\([^()]*\)\s*$")


def parse_asdiv(need: Getter, maybe: Getter, fields: Mapping[str, str | None]) -> Parsed:
    """ASDiv-style row -> ([body + " "] + question, answer without its unit, formula)."""
    question = _as_text(need("question"), fields["question"] or "question").strip()
    body = maybe("body")
    if body:
        question = f"{_as_text(body, fields['body'] or 'body').strip()} {question}"
    answer = _numeric_or_text(need("answer"), fields["answer"] or "answer")
    m = _UNITS.match(answer)
    if m:  # "9 (apples)" -> "9"; the unit is not part of the graded answer
        answer = m.group(1)
    sol = maybe("solution")
    solution = _as_text(sol, fields["solution"] or "formula").strip() if sol else None
    return question, answer, solution


EXTRA_PARSERS: dict[str, Callable[[Getter, Getter, Mapping[str, str | None]], Parsed]] = {
    "mathqa": parse_mathqa,
    "svamp": parse_svamp,
    "asdiv": parse_asdiv,
}
