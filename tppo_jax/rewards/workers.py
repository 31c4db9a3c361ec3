"""Starting grading worker processes without re-running the user's script.

``spawn`` and ``forkserver`` children run the parent's ``__main__`` file again (as
``__mp_main__``) before they unpickle their target, so a plain script that calls
``tppo_jax.fit(...)`` with no ``if __name__ == "__main__":`` guard would start a second
training run in every grading worker. Our workers' targets live in our own modules and need
nothing from ``__main__``, so a worker is started while ``__main__`` is a stand-in module
with no file and no spec: ``multiprocessing`` then has no main module to re-run. A reward
function (``reward.fn``) must therefore live in an importable module, not in the script.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

_lock = threading.Lock()


@contextlib.contextmanager
def _without_main() -> Iterator[None]:
    with _lock:
        real = sys.modules.get("__main__")
        stand_in = types.ModuleType("__main__")
        stand_in.__spec__ = None
        sys.modules["__main__"] = stand_in
        try:
            yield
        finally:
            if real is not None:
                sys.modules["__main__"] = real


def start_worker(proc: Any) -> None:
    """``proc.start()`` for a ``spawn`` / ``forkserver`` process whose target is in a module
    of ours: the child does not import the parent's ``__main__`` (see the module doc)."""
    with _without_main():
        proc.start()
