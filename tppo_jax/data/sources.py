"""``data.source`` to examples: a file, a dataset folder, or a Hub dataset id.

The order is fixed so a name never means two things: a local path that exists wins (a
``.jsonl`` / ``.parquet`` file, or a folder: ``save_to_disk`` output or data files); otherwise
an ``owner/name`` id is a Hub dataset, read through the ``datasets`` library
(:mod:`tppo_jax.data.hub`) with ``data.hf_config``, ``data.split`` and ``data.hf_revision``;
anything else is a missing file. ``synthetic`` is not read here (``trainer/trainer.py`` builds it).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path

from tppo_jax.data.readers import (
    BadRowReport,
    DataError,
    Format,
    MathExample,
    OnBadRow,
    collect_examples,
    merged_fields,
    read_examples,
)

log = logging.getLogger(__name__)

# A Hub repository id: exactly one "/", each part what the Hub allows in a name.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_FILE_SUFFIXES = (".jsonl", ".json", ".ndjson", ".parquet")  # a missing file, never an id

# The row format of the Hub datasets the docs name (ids compared case-insensitively): a
# mismatch is legal (data.fields may remap) but usually a mistake, so it is warned about.
KNOWN_FORMATS: dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    "huggingfaceh4/math-500": "math",
    "bytedtsinghua-sia/dapo-math-17k": "dapo",
}


def is_hub_id(source: str) -> bool:
    """Whether ``source`` reads as a Hub dataset id ``owner/name`` (and not as a file name)."""
    return bool(_HUB_ID.fullmatch(source)) and not source.lower().endswith(_FILE_SUFFIXES)


def read_source(
    source: str, *, format: Format = "generic",  # noqa: A002 - mirrors the config key
    fields: Mapping[str, str | None] | None = None, on_bad_row: OnBadRow = "error",
    split: str = "train", hf_config: str | None = None, hf_revision: str | None = None,
    limit: int | None = None,
) -> tuple[list[MathExample], BadRowReport]:
    """The examples of ``data.source`` (a file, a dataset folder or a Hub id) and the bad-row
    report; ``DataError`` in one line when the source cannot be read. ``split``,
    ``hf_config`` and ``hf_revision`` apply to Hub ids and folders, not to single files."""
    path = Path(source)
    if path.is_dir():
        return _read_table(source, path, format, fields, on_bad_row, split, hf_config, None,
                           limit)
    if path.exists() or not is_hub_id(source):
        if not path.exists():
            raise DataError(f"{source}: no such file (data.source is synthetic, a .jsonl or "
                            f".parquet file, a dataset folder or a Hub id owner/name)")
        return read_examples(path, format=format, fields=fields, on_bad_row=on_bad_row,
                             limit=limit)
    _warn_format(source, format)
    return _read_table(source, None, format, fields, on_bad_row, split, hf_config, hf_revision,
                       limit)


def _read_table(source: str, folder: Path | None, fmt: Format,
                fields: Mapping[str, str | None] | None, on_bad_row: OnBadRow, split: str,
                hf_config: str | None, hf_revision: str | None, limit: int | None,
                ) -> tuple[list[MathExample], BadRowReport]:
    """Open the table with ``datasets`` (a folder, or a Hub id when ``folder`` is None) and
    parse its rows under the bad-row policy."""
    from tppo_jax.data import hub  # lazy: `datasets` takes ~2 s to import

    merged = merged_fields(fmt, fields, on_bad_row)  # before the (maybe slow) load
    if folder is None:
        ds = hub.open_hub(source, hf_config=hf_config, split=split, revision=hf_revision)
    else:
        ds = hub.open_folder(folder, hf_config=hf_config, split=split)
    label = hub.dataset_label(source, hf_config, split, hf_revision)
    log.info("data: %s: %d rows", label, len(ds))
    return collect_examples(hub.dataset_rows(ds, label), fmt, merged, src=source, label=label,
                            on_bad_row=on_bad_row, limit=limit)


def _warn_format(source: str, fmt: str) -> None:
    known = KNOWN_FORMATS.get(source.lower())
    if known is not None and known != fmt:
        log.warning("data: %s has %s rows, read here as data.format=%s (set data.format=%s "
                    "unless data.fields remaps them)", source, known, fmt, known)
