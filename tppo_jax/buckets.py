"""Static shapes: the few column widths a jitted batch over a token buffer may have, and an
account of what compiled.

Every distinct input shape of a jitted function is one XLA compile (seconds on CPU, minutes
for a large model on TPU). A batch cut to its longest row is rounded up to a width bucket
(the rollout's prefill and the updates share them), so the number of compiles per run is
bounded by the number of buckets, not by the number of steps. ``CompileWatch`` counts what
did compile (and how long it took, from jax's own monitoring events), so a run reports it
and warns when a new shape shows up late.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

# jax records these durations around every trace, lowering and backend compile (a persistent
# cache hit is timed as a backend compile too: its retrieval cost).
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_BACKEND_EVENT = _COMPILE_EVENTS[-1]


def width_buckets(cap: int, base: int = 32) -> list[int]:
    """The column widths a batch may have: ``base * 2^k`` below ``cap``, then ``cap``.

    Powers of two keep the count logarithmic in ``cap`` (6 for a 576-token buffer, against 18
    multiples of 32); a batch pays at most twice its width, cheaper than a compile per
    width on CPU where one compile of the three update functions costs tens of steps."""
    out, w = [], base
    while w < cap:
        out.append(w)
        w *= 2
    return [*out, cap]


def bucket_width(n: int, cap: int, base: int = 32) -> int:
    """The smallest width bucket holding ``n`` columns (``cap`` at most)."""
    return next(w for w in width_buckets(cap, base) if w >= min(n, cap))


def enable_compile_cache(path: str) -> Path | None:
    """Turns on jax's persistent compilation cache in ``path`` (``~`` expanded; "" = off), so
    a second run with the same shapes loads its executables instead of compiling them."""
    if not path:
        return None
    d = Path(path).expanduser()
    d.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(d))
    # The CPU default's compiles take ~1-10 s; jax's default floor (1 s) would skip some.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return d


class CompileWatch:
    """Counts XLA compiles and their seconds while open, process-wide (every thread), and the
    cache entries of named jitted functions.

    ``take()`` returns and resets the compile count and seconds since the last call;
    ``new_shapes()`` names the watched functions that compiled a new shape since the last call
    (a jitted function's cache holds one executable per input shape).
    """

    def __init__(self, fns: dict[str, Callable] | None = None) -> None:
        self.fns = dict(fns or {})
        self._sizes = {k: _cache_size(f) for k, f in self.fns.items()}
        self._lock = threading.Lock()
        self._seconds = 0.0
        self._count = 0
        self.total_seconds = 0.0
        self.total_count = 0

    def _listen(self, event: str, duration: float, **_: Any) -> None:
        if event in _COMPILE_EVENTS:
            with self._lock:
                self._seconds += duration
                self._count += event == _BACKEND_EVENT

    def __enter__(self) -> CompileWatch:
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc: Any) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listen)

    def take(self) -> tuple[int, float]:
        """``(compiles, seconds)`` since the last ``take``."""
        with self._lock:
            out = (self._count, self._seconds)
            self._count, self._seconds = 0, 0.0
        self.total_count += out[0]
        self.total_seconds += out[1]
        return out

    def reset(self) -> None:
        """Drops the compiles since the last ``take`` (e.g. a held-out eval's)."""
        with self._lock:
            self._count, self._seconds = 0, 0.0

    def new_shapes(self) -> dict[str, tuple[int, int]]:
        """``{name: (shapes before, shapes now)}`` of the watched functions that compiled a
        new shape since the last call."""
        out = {}
        for k, f in self.fns.items():
            n = _cache_size(f)
            if n > self._sizes[k]:
                out[k] = (self._sizes[k], n)
            self._sizes[k] = n
        return out

    def sizes(self) -> dict[str, int]:
        """Cache entries (distinct compiled shapes) of every watched function."""
        return {k: _cache_size(f) for k, f in self.fns.items()}


def _cache_size(fn: Callable) -> int:
    size = getattr(fn, "_cache_size", None)
    return int(size()) if callable(size) else 0
