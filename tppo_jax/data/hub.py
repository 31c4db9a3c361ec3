"""Datasets the ``datasets`` library opens: a Hub id (``owner/name``) or a local dataset folder.

``data.source=openai/gsm8k`` is read with ``datasets.load_dataset(id, data.hf_config,
split=data.split, revision=data.hf_revision)``, so the standard cache (``HF_HOME``,
``HF_DATASETS_CACHE``), a token (``HF_TOKEN``) and offline mode (``HF_HUB_OFFLINE`` /
``HF_DATASETS_OFFLINE``) work as everywhere else. Offline, ``datasets`` only finds the copy it
prepared itself on an earlier online load; a repository fetched with ``hf download`` sits in the
hub cache instead (``HF_HUB_CACHE``), and is read from there when the first load cannot reach
the Hub.

Every failure is one :class:`DataError` line naming the id: not cached while offline, no such
dataset, a missing config or split (the available ones listed). Rows come out of the
memory-mapped Arrow table batch by batch; the bad-row policy is the files' one
(:func:`tppo_jax.data.readers.collect_examples`).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tppo_jax.data.formats import DataError
from tppo_jax.data.readers import iter_arrow_rows

BATCH_ROWS = 1024  # rows converted to Python at a time
MAX_MESSAGE = 300  # a library message is cut to this many characters
_SPLITS_IN_MESSAGE = re.compile(r"Should be one of (\[[^\]]*\])")


def dataset_label(source: str, hf_config: str | None, split: str,
                  revision: str | None = None) -> str:
    """How messages and bad-row locations name the table: ``openai/gsm8k (main, train)``,
    ``openai/gsm8k@v2 (main, train)`` for a revision."""
    name = f"{source}@{revision}" if revision else source
    return f"{name} ({hf_config}, {split})" if hf_config else f"{name} ({split})"


def open_hub(repo_id: str, *, hf_config: str | None, split: str,
             revision: str | None) -> Any:
    """The ``datasets.Dataset`` of one split of a Hub dataset; ``DataError`` (one line) when it
    cannot be had."""
    datasets = _datasets()
    label = dataset_label(repo_id, hf_config, split, revision)
    try:
        return _load(datasets, repo_id, hf_config, split, revision)
    except Exception as e:  # noqa: BLE001 - every library failure becomes one line naming the id
        first = e
    offline = bool(datasets.config.HF_HUB_OFFLINE)
    snapshot = _cached_snapshot(repo_id, revision) if (
        offline or isinstance(first, ConnectionError)) else None
    if snapshot is None:
        raise DataError(_describe(first, label, repo_id, split, offline)) from None
    try:
        return _load(datasets, str(snapshot), hf_config, split, None)
    except Exception as e:  # noqa: BLE001
        raise DataError(_describe(e, label, repo_id, split, offline)) from None


def open_folder(path: Path, *, hf_config: str | None, split: str) -> Any:
    """A local folder: one ``save_to_disk`` output (a ``Dataset``, or a ``DatasetDict`` from
    which ``split`` is taken), or data files ``load_dataset`` reads (e.g. ``hf download
    --local-dir``: its README's configs apply)."""
    datasets = _datasets()
    label = dataset_label(str(path), hf_config, split)
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        try:
            saved = datasets.load_from_disk(str(path))
        except Exception as e:  # noqa: BLE001
            raise DataError(f"{label}: cannot load the saved dataset: {_one_line(e)}") from None
        if not isinstance(saved, datasets.DatasetDict):
            return saved  # one saved split: data.split does not apply
        if split not in saved:
            raise DataError(f"{label}: no split {split!r}; its splits: {', '.join(saved)} "
                            f"(set data.split)")
        return saved[split]
    try:
        return _load(datasets, str(path), hf_config, split, None)
    except Exception as e:  # noqa: BLE001
        raise DataError(_describe(e, label, str(path), split, False)) from None


def dataset_rows(ds: Any, label: str) -> Iterator[tuple[str, Any, str | None]]:
    """``(location, row, error)`` of every row, ``BATCH_ROWS`` at a time from the Arrow table
    (memory-mapped: a large dataset is never all Python objects at once)."""
    table = ds.with_format("arrow")
    batches = (table[i:i + BATCH_ROWS] for i in range(0, len(table), BATCH_ROWS))
    return iter_arrow_rows(batches, label)


def _datasets() -> Any:
    """The ``datasets`` module, imported on first use (~2 s: only Hub and folder sources pay)."""
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise DataError(f"Hub dataset ids need the `datasets` package ({e})") from None
    return datasets


def _load(datasets: Any, path: str, hf_config: str | None, split: str,
          revision: str | None) -> Any:
    return datasets.load_dataset(path, hf_config, split=split, revision=revision)


def _cached_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The hub cache's snapshot of the dataset repository (``hf download``), or None; never
    touches the network."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, repo_type="dataset", revision=revision,
                                      local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached (or an unusable cache entry): nothing to use
        return None


def _describe(e: BaseException, label: str, name: str, split: str, offline: bool) -> str:
    """One line for a failed load, with what to set to fix it."""
    from datasets.exceptions import DatasetNotFoundError

    msg = _one_line(e)
    if isinstance(e, ConnectionError):
        return (f"{label}: not in the local cache ({_caches()}) and the Hub cannot be reached"
                f"{' (offline mode)' if offline else ''}: load it once online, or set "
                f"data.source to a local copy")
    if isinstance(e, DatasetNotFoundError):
        return (f"{label}: no such dataset on the Hub, or no access to it (gated or private: "
                f"log in or set HF_TOKEN); no local file or folder {name!r} either")
    m = _SPLITS_IN_MESSAGE.search(msg)
    if "Unknown split" in msg and m:
        splits = ", ".join(str(s) for s in _literal_list(m.group(1)))
        return f"{label}: no split {split!r}; its splits: {splits} (set data.split)"
    if "config" in msg.lower():
        return f"{label}: {msg} (set data.hf_config)"
    return f"{label}: {msg}"


def _one_line(e: BaseException) -> str:
    """The library's message on one line: usage examples dropped, whitespace collapsed, cut."""
    text = str(e).split("Example of usage", 1)[0]
    if e.__cause__ is not None:  # "An error occurred while generating the dataset": why
        text = f"{text}: {type(e.__cause__).__name__}: {e.__cause__}"
    text = " ".join(text.split()) or type(e).__name__
    return text if len(text) <= MAX_MESSAGE else f"{text[:MAX_MESSAGE - 3]}..."


def _literal_list(text: str) -> list[Any]:
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return [text]
    return list(value) if isinstance(value, list | tuple) else [value]


def _caches() -> str:
    import datasets
    from huggingface_hub import constants

    return f"{datasets.config.HF_DATASETS_CACHE} or {constants.HF_HUB_CACHE}"
