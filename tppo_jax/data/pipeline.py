"""Grain prompt pipeline: per-host shard -> seeded shuffle -> repeat -> batch, checkpointable.

The pipeline is a grain ``MapDataset`` chain, so every element is addressed by an index and the
iterator state is a tiny dict (``{"next_index": k}``); saving it with the trainer checkpoint and
restoring it into a fresh iterator resumes the exact same stream of batches.

Sharding happens *before* shuffling: host ``i`` of ``n`` owns the strided slice ``i::n`` (trimmed
so all hosts hold the same number of examples and stay in lock-step), then shuffles it with the
shared seed -- each epoch reshuffles (grain re-seeds the shuffle per epoch).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import grain

T = TypeVar("T")


def default_shard() -> tuple[int, int]:
    """``(jax.process_index(), jax.process_count())``: one data shard per host."""
    import jax  # lazy: keeps `tppo_jax.data` importable without initialising a backend

    return jax.process_index(), jax.process_count()


def shard_dataset(
    ds: grain.MapDataset, shard_index: int, shard_count: int, *, even: bool = True
) -> grain.MapDataset:
    """Host ``shard_index``'s strided slice of ``ds``.

    With ``even=True`` the tail ``len(ds) % shard_count`` examples are dropped so every host sees
    the same number of examples (hosts that run out at different times deadlock collectives).
    """
    if shard_count < 1 or not 0 <= shard_index < shard_count:
        raise ValueError(f"bad shard {shard_index} of {shard_count}")
    n = len(ds)
    stop = (n // shard_count) * shard_count if even else n
    if stop == 0 or shard_index >= stop:
        raise ValueError(f"dataset of {n} examples is too small for {shard_count} shards")
    return ds[shard_index:stop:shard_count]


class PromptPipeline(Generic[T]):
    """Infinite (or ``num_epochs``-long) stream of batches, resumable from ``get_state()``.

    Args:
      source: a sequence (e.g. ``list[MathExample]``) or a grain ``RandomAccessDataSource``.
      batch_size: examples per batch *on this host*.
      seed: shuffle seed (shared by all hosts; shards are disjoint anyway).
      shuffle: reshuffle each epoch when True; keep source order when False.
      num_epochs: None repeats forever.
      shard_index, shard_count: this host's shard; default from :func:`default_shard`.
      drop_remainder: drop a final partial batch (only matters with finite ``num_epochs``).
      batch_fn: how to collate a batch; default returns the list of elements.
      map_fn: optional per-element transform (e.g. tokenisation), applied before batching.
    """

    def __init__(
        self,
        source: Sequence[T] | Any,
        *,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        num_epochs: int | None = None,
        shard_index: int | None = None,
        shard_count: int | None = None,
        drop_remainder: bool = True,
        batch_fn: Callable[[Sequence[Any]], Any] | None = None,
        map_fn: Callable[[T], Any] | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if (shard_index is None) != (shard_count is None):
            raise ValueError("give both shard_index and shard_count, or neither")
        if shard_index is None or shard_count is None:
            shard_index, shard_count = default_shard()
        self.batch_size = batch_size
        self.shard_index, self.shard_count = shard_index, shard_count
        ds = grain.MapDataset.source(source)
        ds = shard_dataset(ds, shard_index, shard_count)
        self.num_examples = len(ds)  # examples on this host, per epoch
        if shuffle:
            ds = ds.shuffle(seed=seed)
        # repeat() after shuffle: grain derives a fresh permutation for every epoch.
        ds = ds.repeat(num_epochs)
        if map_fn is not None:
            ds = ds.map(map_fn)
        ds = ds.batch(batch_size, drop_remainder=drop_remainder, batch_fn=batch_fn or list)
        self.dataset: grain.MapDataset = ds
        # A single reader thread: elements are cheap Python objects, and fewer threads means
        # less prefetched-but-unused work when the iterator is checkpointed.
        self._read_options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)
        self._it: grain.DatasetIterator | None = None

    def _iter(self) -> grain.DatasetIterator:
        if self._it is None:
            self._it = iter(self.dataset.to_iter_dataset(self._read_options))
        return self._it

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        return next(self._iter())

    def take(self, n: int) -> list[Any]:
        """The next ``n`` batches."""
        return [next(self) for _ in range(n)]

    def get_state(self) -> dict[str, Any]:
        """Checkpointable iterator state (a small JSON-serialisable dict)."""
        return dict(self._iter().get_state())

    def set_state(self, state: dict[str, Any]) -> None:
        """Resume from a state produced by ``get_state`` of an identically built pipeline."""
        self._iter().set_state(dict(state))

    def state_json(self) -> str:
        """``get_state()`` as JSON text (for checkpoint metadata files)."""
        return json.dumps(self.get_state(), sort_keys=True)

    def load_state_json(self, text: str) -> None:
        """Inverse of :meth:`state_json`."""
        self.set_state(json.loads(text))
