"""Every dataset row format, reduced to :class:`MathExample` (question + ground-truth final
answer as a string). File reading and the bad-row policy are in :mod:`tppo_jax.data.readers`.

- ``dapo``: DAPO-Math-17K style rows, ``prompt`` (a string or a chat list of
  ``{"role", "content"}``) and ``reward_model.ground_truth`` (dotted paths address nested keys).
- ``gsm8k``: ``question`` + ``answer`` whose last line is ``#### N``.
- ``math``: MATH / AIME style ``problem`` + ``solution`` containing ``\\boxed{...}``, or an explicit
  ``answer`` field (preferred when present).
- ``generic``: ``question`` + ``answer`` (+ optional ``solution``), fully configurable: every
  field may be renamed (any key, dotted paths for nested keys) through ``fields``.
- ``mathqa``: MathQA rows ``Problem``, ``Rationale``, ``options`` (the string
  ``"a ) 38 , b ) 27.675 , c ) 30 , d ) 40 , e ) 44"`` or a list of option strings) and ``correct``
  (a letter); the answer is the text of the option the letter points to.
- ``svamp``: SVAMP rows ``Body``, ``Question``, ``Equation``, ``Answer`` (a number); the question is
  ``Body + " " + Question`` and the equation is kept as the solution.
- ``asdiv``: ASDiv-style rows ``question`` (+ optional ``body``), ``answer`` (units in a trailing
  parenthesis, ``"9 (apples)"``, are dropped) and optional ``formula`` (kept as the solution).

Every parser raises ValueError/KeyError on a malformed row; ``readers`` turns that into a
DataError naming the file and line, or a skipped-row entry.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from tppo_jax.data.answers import answer_problem  # math-verify: imported on first use

Format = Literal["dapo", "gsm8k", "math", "generic", "mathqa", "svamp", "asdiv"]


class DataError(ValueError):
    """A malformed input row (or unreadable file); the message names file, location and cause."""


@dataclass(frozen=True)
class MathExample:
    """One math problem with its checkable final answer."""

    id: str
    question: str
    answer: str  # ground-truth final answer, as a string (graded by math-verify)
    solution: str | None = None
    source: str = ""


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced.

    Why hand-rolled: a regex cannot match nested braces such as ``\\boxed{\\frac{1}{2}}``.
    Returns None when there is no complete boxed expression.
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    tag_len = 6 if text.startswith("\\boxed", start) else 5
    i = start + tag_len
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        # `\boxed 5` (no braces) is legal LaTeX: take the token up to whitespace or `$`.
        if i == start + tag_len:  # e.g. `\boxedx`: not a box at all
            return None
        token = re.split(r"[\s$]", text[i:], maxsplit=1)[0]
        return token or None
    depth = 0
    for j in range(i, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None  # unbalanced braces


def get_path(row: Mapping[str, Any], path: str) -> Any:
    """Look up a dotted path (``"reward_model.ground_truth"``) in nested mappings.

    A literal key containing dots wins over the nested interpretation. Raises KeyError.
    """
    if path in row:
        return row[path]
    cur: Any = row
    for part in path.split("."):
        if isinstance(cur, Mapping) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list | tuple) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            raise KeyError(path)
    return cur


def as_text(value: Any, name: str, *, allow_chat: bool = False) -> str:
    """Validate a field as a non-empty string (chat lists are joined when allowed)."""
    if allow_chat and isinstance(value, list | tuple):
        # DAPO stores prompts as chat messages; keep the user turns' content.
        parts = []
        for m in value:
            if not isinstance(m, Mapping) or not isinstance(m.get("content"), str):
                raise ValueError(f"field {name!r} is a list but not of chat messages with "
                                 "string 'content' (expected str or chat messages)")
            if m.get("role", "user") == "user":
                parts.append(m["content"])
        value = "\n".join(parts)
    if not isinstance(value, str):
        raise ValueError(f"field {name!r} is {type(value).__name__}, expected str")
    if not value.strip():
        raise ValueError(f"field {name!r} is empty")
    return value


def numeric_or_text(value: Any, name: str) -> str:
    """Answers may legitimately be stored as numbers (e.g. AIME ints); booleans/None may not."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        if value != value or value in (float("inf"), float("-inf")):  # JSON NaN / 1e999
            raise ValueError(f"field {name!r} is {value}, expected a finite number")
        return str(value)
    return as_text(value, name).strip()


def parse_row(
    row: Any, fmt: Format, fields: Mapping[str, str | None], *, row_id: str, source: str
) -> MathExample:
    """Convert one decoded row to a :class:`MathExample`; raises ValueError/KeyError if bad."""
    if not isinstance(row, Mapping):
        raise ValueError(f"row is {type(row).__name__}, expected an object")

    def need(key: str) -> Any:
        path = fields.get(key)
        if path is None:
            raise KeyError(key)
        try:
            return get_path(row, path)
        except KeyError:
            raise KeyError(f"missing field {path!r}") from None

    def maybe(key: str) -> Any:
        path = fields.get(key)
        if path is None:
            return None
        try:
            return get_path(row, path)
        except KeyError:
            return None

    solution: str | None = None
    if fmt in ("mathqa", "svamp", "asdiv"):
        question, answer, solution = EXTRA_PARSERS[fmt](need, maybe, fields)
        return _example(question, answer, solution, maybe("id"), row_id, source)
    question = as_text(need("question"), fields["question"] or "question", allow_chat=True)
    if fmt == "gsm8k":
        raw = as_text(need("answer"), fields["answer"] or "answer")
        if "####" not in raw:
            raise ValueError("gsm8k answer has no '#### N' final line")
        sol, _, final = raw.rpartition("####")
        answer = final.strip().replace(",", "")  # "1,000" -> "1000"
        solution = sol.strip() or None
    elif fmt == "math":
        sol_val = maybe("solution")
        solution = as_text(sol_val, fields["solution"] or "solution") if sol_val else None
        ans_val = maybe("answer")
        if ans_val is not None:
            answer = numeric_or_text(ans_val, fields["answer"] or "answer")
        elif solution is not None:
            boxed = last_boxed(solution)
            if boxed is None:
                raise ValueError("no explicit answer and no \\boxed{...} in the solution")
            answer = boxed.strip()
        else:
            raise KeyError("missing both answer and solution fields")
    else:
        answer = numeric_or_text(need("answer"), fields["answer"] or "answer")
        sol_val = maybe("solution")
        if sol_val is not None:
            solution = as_text(sol_val, fields["solution"] or "solution")
    return _example(question, answer, solution, maybe("id"), row_id, source)


def _example(question: str, answer: str, solution: str | None, id_val: Any, row_id: str,
             source: str) -> MathExample:
    """Final checks shared by every format; a missing/empty id falls back to ``row_id``."""
    if not answer:
        raise ValueError("empty answer")
    if (why := answer_problem(answer)) is not None:
        shown = answer if len(answer) <= 40 else answer[:40] + "..."
        raise ValueError(f"answer {shown!r} cannot be graded: {why}")
    ex_id = str(id_val) if id_val is not None and id_val != "" else row_id
    return MathExample(id=ex_id, question=question, answer=answer, solution=solution,
                       source=source)


# ---------------------------------------------------------------- MathQA / SVAMP / ASDiv
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
    question = as_text(need("question"), fields["question"] or "Problem")
    options = parse_options(need("options"))
    letter = as_text(need("answer"), fields["answer"] or "correct").strip().lower()
    if letter not in options:
        raise ValueError(f"correct option {letter!r} is not among the options {sorted(options)}")
    answer = options[letter]
    if not answer:
        raise ValueError(f"option {letter!r} is empty")
    sol = maybe("solution")
    solution = as_text(sol, fields["solution"] or "solution") if sol else None
    return question, answer, solution


def parse_svamp(need: Getter, maybe: Getter, fields: Mapping[str, str | None]) -> Parsed:
    """SVAMP row -> (Body + " " + Question, Answer, Equation)."""
    question = as_text(need("question"), fields["question"] or "Question").strip()
    body = maybe("body")
    if body is not None:
        question = f"{as_text(body, fields['body'] or 'Body').strip()} {question}"
    raw = need("answer")
    if isinstance(raw, float | int) and not isinstance(raw, bool):
        answer = _number_text(raw)
    else:
        answer = numeric_or_text(raw, fields["answer"] or "Answer")
        try:
            answer = _number_text(float(answer))
        except ValueError:
            raise ValueError(f"SVAMP answer {answer!r} is not a number") from None
    eq = maybe("solution")
    solution = as_text(eq, fields["solution"] or "Equation").strip() if eq else None
    return question, answer, solution


_UNITS = re.compile(r"^(.*?\S)\s*\([^()]*\)\s*$")


def parse_asdiv(need: Getter, maybe: Getter, fields: Mapping[str, str | None]) -> Parsed:
    """ASDiv-style row -> ([body + " "] + question, answer without its unit, formula)."""
    question = as_text(need("question"), fields["question"] or "question").strip()
    body = maybe("body")
    if body:
        question = f"{as_text(body, fields['body'] or 'body').strip()} {question}"
    answer = numeric_or_text(need("answer"), fields["answer"] or "answer")
    m = _UNITS.match(answer)
    if m:  # "9 (apples)" -> "9"; the unit is not part of the graded answer
        answer = m.group(1)
    sol = maybe("solution")
    solution = as_text(sol, fields["solution"] or "formula").strip() if sol else None
    return question, answer, solution


EXTRA_PARSERS: dict[str, Callable[[Getter, Getter, Mapping[str, str | None]], Parsed]] = {
    "mathqa": parse_mathqa,
    "svamp": parse_svamp,
    "asdiv": parse_asdiv,
}
