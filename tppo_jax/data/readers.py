"""JSONL / Parquet readers for math datasets, with an explicit bad-row policy.

Every row format (DAPO, GSM8K, MATH, MathQA, SVAMP, ASDiv, generic) is parsed by
:mod:`tppo_jax.data.formats` into a :class:`MathExample`; this module reads the files and applies
the bad-row policy.

A malformed row raises :class:`DataError` naming the file, the line (JSONL, 1-based) or row index
(Parquet, 0-based) and the problem; with ``on_bad_row="skip"`` it is logged and listed in the
returned :class:`BadRowReport` instead.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tppo_jax.config_schema import DEFAULT_FIELDS  # re-exported, as the row types are
from tppo_jax.data.formats import (  # re-exported: the row types callers import from here
    DataError,
    Format,
    MathExample,
    get_path,
    last_boxed,
    parse_row,
)

__all__ = ["DEFAULT_FIELDS", "BadRowReport", "DataError", "Format", "MathExample",
           "collect_examples", "get_path", "iter_arrow_rows", "last_boxed", "merged_fields",
           "parse_row", "read_examples"]

logger = logging.getLogger(__name__)

OnBadRow = Literal["error", "skip"]


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
    return iter_arrow_rows(pf.iter_batches(batch_size=1024), str(path))


def iter_arrow_rows(batches: Iterable[Any], label: str) -> Iterator[tuple[str, Any, str | None]]:
    """Yield ``(f"{label}:row {i}", row, error)`` from Arrow record batches or tables.

    Shared by Parquet files and ``datasets`` tables (:mod:`tppo_jax.data.hub`): a batch is
    converted to Python at once, and only a batch that will not convert (e.g. a timestamp past
    year 9999) row by row, so the one bad row is found and the rest are kept.
    """
    idx = 0
    for batch in batches:
        try:
            rows = batch.to_pylist()
        except (ValueError, OverflowError):
            rows = None
        for j in range(batch.num_rows):
            loc = f"{label}:row {idx}"
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
    merged = merged_fields(format, fields, on_bad_row)
    p = Path(path)
    if not p.exists():
        raise DataError(f"{p}: no such file")
    if not p.is_file():  # a directory (or a device): open() would raise from the reader
        raise DataError(f"{p}: not a regular file (data.source names one .jsonl or .parquet "
                        f"file)")
    if not os.access(p, os.R_OK):
        raise DataError(f"{p}: not readable (permission denied)")
    src = source if source is not None else p.name
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        rows = _iter_parquet(p)
    elif suffix in (".jsonl", ".json", ".ndjson"):
        rows = _iter_jsonl(p)
    else:
        raise DataError(f"{p}: unsupported file type {suffix!r} (use .jsonl or .parquet)")
    return collect_examples(rows, format, merged, src=src, label=str(p), on_bad_row=on_bad_row,
                            limit=limit)


def merged_fields(format: Format, fields: Mapping[str, str | None] | None,  # noqa: A002
                  on_bad_row: OnBadRow) -> dict[str, str | None]:
    """The format's default field paths with ``fields`` on top; checks the format, the
    overrides' keys and the bad-row policy before any row is read."""
    if format not in DEFAULT_FIELDS:
        raise ValueError(f"unknown format {format!r}; expected one of {sorted(DEFAULT_FIELDS)}")
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    merged = dict(DEFAULT_FIELDS[format])
    if fields:
        unknown = set(fields) - set(merged)
        if unknown:
            raise ValueError(f"unknown field keys {sorted(unknown)}; allowed {sorted(merged)}")
        merged.update(fields)
    return merged


def collect_examples(
    rows: Iterable[tuple[str, Any, str | None]], format: Format,  # noqa: A002
    fields: Mapping[str, str | None], *, src: str, label: str, on_bad_row: OnBadRow,
    limit: int | None = None,
) -> tuple[list[MathExample], BadRowReport]:
    """Parse ``(location, row, error)`` triples under the bad-row policy.

    The one place the policy lives, so a file and a Hub dataset fail (or skip) alike: the
    first bad row raises :class:`DataError` at its location, or (``"skip"``) is logged and
    listed in the report.
    """
    report = BadRowReport(path=label)
    out: list[MathExample] = []
    for n, (loc, row, err) in enumerate(rows):
        report.total_rows += 1
        if err is None:
            try:
                out.append(parse_row(row, format, fields, row_id=f"{src}-{n}", source=src))
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
