"""JSONL / Parquet readers for math datasets, with an explicit bad-row policy.

Every format is reduced to :class:`MathExample` (question + ground-truth final answer as a string).
Supported shapes:

- ``dapo``: DAPO-Math-17K style rows, ``prompt`` (a string or a chat list of
  ``{"role", "content"}``) and ``reward_model.ground_truth`` (dotted paths address nested keys).
- ``gsm8k``: ``question`` + ``answer`` whose last line is ``#### N``.
- ``math``: MATH / AIME style ``problem`` + ``solution`` containing ``\\boxed{...}``, or an explicit
  ``answer`` field (preferred when present).
- ``generic``: ``question`` + ``answer`` (+ optional ``solution``), fully configurable: every
  field may be renamed (any key, dotted paths for nested keys) through ``fields``.
- ``mathqa`` / ``svamp`` / ``asdiv``: see :mod:`tppo_jax.data.readers_extra`.

A malformed row raises :class:`DataError` naming the file, the line (JSONL, 1-based) or row index
(Parquet, 0-based) and the problem; with ``on_bad_row="skip"`` it is logged and listed in the
returned :class:`BadRowReport` instead.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

logger = logging.getLogger(__name__)

Format = Literal["dapo", "gsm8k", "math", "generic", "mathqa", "svamp", "asdiv"]
OnBadRow = Literal["error", "skip"]


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


@dataclass
class BadRowReport:
    """Rows skipped under ``on_bad_row="skip"``: ``(location, reason)`` pairs."""

    path: str = ""
    total_rows: int = 0
    bad: list[tuple[str, str]] = field(default_factory=list)

    @property
    def num_bad(self) -> int:
        """Number of skipped rows."""
        return len(self.bad)


# Default field mapping per format. Keys: question, answer, solution, id (any may be None).
DEFAULT_FIELDS: dict[str, dict[str, str | None]] = {
    "dapo": {"question": "prompt", "answer": "reward_model.ground_truth", "solution": None,
             "id": None},
    "gsm8k": {"question": "question", "answer": "answer", "solution": None, "id": None},
    "math": {"question": "problem", "answer": "answer", "solution": "solution", "id": None},
    "generic": {"question": "question", "answer": "answer", "solution": "solution", "id": "id"},
    # Extra formats (parsed in readers_extra). MathQA's "answer" is the correct option's letter.
    "mathqa": {"question": "Problem", "answer": "correct", "options": "options",
               "solution": "Rationale", "id": None},
    "svamp": {"question": "Question", "body": "Body", "answer": "Answer", "solution": "Equation",
              "id": "ID"},
    "asdiv": {"question": "question", "body": "body", "answer": "answer", "solution": "formula",
              "id": "id"},
}


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


def _as_text(value: Any, name: str, *, allow_chat: bool = False) -> str:
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


def _numeric_or_text(value: Any, name: str) -> str:
    """Answers may legitimately be stored as numbers (e.g. AIME ints); booleans/None may not."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        if value != value or value in (float("inf"), float("-inf")):  # JSON NaN / 1e999
            raise ValueError(f"field {name!r} is {value}, expected a finite number")
        return str(value)
    return _as_text(value, name).strip()


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
        # Lazy import: readers_extra imports helpers from this module.
        from tppo_jax.data.readers_extra import EXTRA_PARSERS

        question, answer, solution = EXTRA_PARSERS[fmt](need, maybe, fields)
        return _example(question, answer, solution, maybe("id"), row_id, source)
    question = _as_text(need("question"), fields["question"] or "question", allow_chat=True)
    if fmt == "gsm8k":
        raw = _as_text(need("answer"), fields["answer"] or "answer")
        if "####" not in raw:
            raise ValueError("gsm8k answer has no '#### N' final line")
        sol, _, final = raw.rpartition("####")
        answer = final.strip().replace(",", "")  # "1,000" -> "1000"
        solution = sol.strip() or None
    elif fmt == "math":
        sol_val = maybe("solution")
        solution = _as_text(sol_val, fields["solution"] or "solution") if sol_val else None
        ans_val = maybe("answer")
        if ans_val is not None:
            answer = _numeric_or_text(ans_val, fields["answer"] or "answer")
        elif solution is not None:
            boxed = last_boxed(solution)
            if boxed is None:
                raise ValueError("no explicit answer and no \\boxed{...} in the solution")
            answer = boxed.strip()
        else:
            raise KeyError("missing both answer and solution fields")
    else:
        answer = _numeric_or_text(need("answer"), fields["answer"] or "answer")
        sol_val = maybe("solution")
        if sol_val is not None:
            solution = _as_text(sol_val, fields["solution"] or "solution")
    return _example(question, answer, solution, maybe("id"), row_id, source)


def _example(question: str, answer: str, solution: str | None, id_val: Any, row_id: str,
             source: str) -> MathExample:
    """Final checks shared by every format; a missing/empty id falls back to ``row_id``."""
    if not answer:
        raise ValueError("empty answer")
    ex_id = str(id_val) if id_val is not None and id_val != "" else row_id
    return MathExample(id=ex_id, question=question, answer=answer, solution=solution,
                       source=source)


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Any, str | None]]:
    """Yield ``(location, row_or_None, decode_error_or_None)``; blank lines are skipped.

    Lines are split on ``\\n`` and decoded one by one, so invalid UTF-8 is one bad row rather
    than a ``UnicodeDecodeError`` out of the whole file.
    """
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            loc = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield loc, None, f"invalid UTF-8 ({e.reason} at byte {e.start + 1})"
                continue
            if not line.strip():
                continue
            try:
                row, err = json.loads(line), None
            except json.JSONDecodeError as e:
                row, err = None, f"invalid JSON ({e.msg} at column {e.colno})"
            except (ValueError, RecursionError) as e:  # a >4300-digit int; nesting too deep
                row, err = None, f"invalid JSON ({type(e).__name__}: {str(e)[:120]})"
            yield loc, row, err


def _iter_parquet(path: Path) -> Iterator[tuple[str, Any, str | None]]:
    """Yield Parquet rows as dicts, batch by batch (never the whole table as Python objects)."""
    import pyarrow.parquet as pq  # lazy: pyarrow is only needed for parquet files

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - any pyarrow failure means unreadable file
        raise DataError(f"{path}: cannot read parquet file: {e}") from e
    idx = 0
    for batch in pf.iter_batches(batch_size=1024):
        try:
            rows = batch.to_pylist()
        except (ValueError, OverflowError):  # e.g. a timestamp past year 9999: find the row
            rows = None
        for j in range(batch.num_rows):
            loc = f"{path}:row {idx}"
            idx += 1
            if rows is not None:
                yield loc, rows[j], None
                continue
            try:
                row, err = batch.slice(j, 1).to_pylist()[0], None
            except (ValueError, OverflowError) as e:
                row, err = None, f"cannot convert row to Python ({type(e).__name__}: {e})"
            yield loc, row, err


def read_examples(
    path: str | Path,
    *,
    format: Format = "generic",  # noqa: A002 - mirrors the CLI/config option name
    fields: Mapping[str, str | None] | None = None,
    on_bad_row: OnBadRow = "error",
    source: str | None = None,
    limit: int | None = None,
) -> tuple[list[MathExample], BadRowReport]:
    """Read a ``.jsonl``/``.json`` (one object per line) or ``.parquet`` file into examples.

    Args:
      path: the file; the suffix picks the reader.
      format: row shape, see the module docstring.
      fields: overrides of the default field paths for ``format`` (keys ``question``, ``answer``,
        ``solution``, ``id``, plus ``body`` for svamp/asdiv and ``options`` for mathqa; values
        are dotted paths or None to disable).
      on_bad_row: ``"error"`` raises :class:`DataError` on the first bad row; ``"skip"`` logs a
        warning per bad row and lists it in the report.
      source: tag stored on every example (default: the file name).
      limit: stop after this many good examples.
    Returns:
      ``(examples, report)``.
    """
    if format not in DEFAULT_FIELDS:
        raise ValueError(f"unknown format {format!r}; expected one of {sorted(DEFAULT_FIELDS)}")
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    p = Path(path)
    if not p.exists():
        raise DataError(f"{p}: no such file")
    merged = dict(DEFAULT_FIELDS[format])
    if fields:
        unknown = set(fields) - set(merged)
        if unknown:
            raise ValueError(f"unknown field keys {sorted(unknown)}; allowed {sorted(merged)}")
        merged.update(fields)
    src = source if source is not None else p.name
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        rows = _iter_parquet(p)
    elif suffix in (".jsonl", ".json", ".ndjson"):
        rows = _iter_jsonl(p)
    else:
        raise DataError(f"{p}: unsupported file type {suffix!r} (use .jsonl or .parquet)")

    report = BadRowReport(path=str(p))
    out: list[MathExample] = []
    for n, (loc, row, err) in enumerate(rows):
        report.total_rows += 1
        if err is None:
            try:
                out.append(parse_row(row, format, merged, row_id=f"{src}-{n}", source=src))
            except KeyError as e:
                err = str(e.args[0]) if e.args else "missing field"
            except ValueError as e:
                err = str(e)
        if err is not None:
            if on_bad_row == "error":
                raise DataError(f"{loc}: {err}")
            logger.warning("skipping bad row %s: %s", loc, err)
            report.bad.append((loc, err))
        if limit is not None and len(out) >= limit:
            break
    return out, report
