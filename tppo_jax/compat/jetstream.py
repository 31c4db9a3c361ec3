"""Makes google-jetstream 0.2.2 importable and safe on current jax.

JetStream 0.2.2 (archived upstream) has three problems on today's stack:

1. ``jetstream.engine.token_utils`` imports ``seqio.vocabularies`` only for type
   hints and one loader we never call; seqio drags in TensorFlow (~3 GB). We
   register a tiny ``seqio.vocabularies`` module with stand-in classes instead.
2. ``jetstream.core.orchestrator`` calls ``jax.tree_map``, removed from jax; when
   it raises inside JetStream's worker thread, JetStream SIGKILLs its own
   process. We restore it as an alias of ``jax.tree.map``.
3. ``jetstream.core.server_lib`` binds gRPC to ``[::]`` (every interface). We
   bind to 127.0.0.1 unless the caller asks for another host.

Import this module before any ``jetstream`` import; importing it twice is a no-op. Only the
serving modules import it (``rollout.jetstream_engine``, ``rollout.tokenizer_adapter``,
``rollout.server`` and ``tppo serve`` / ``generate``), so its process-wide patches never
reach training or the held-out eval.
"""

from __future__ import annotations

import logging
import sys
import types

import jax

LOOPBACK_HOST = "127.0.0.1"


def _install_tree_map() -> None:
    if not hasattr(jax, "tree_map"):
        jax.tree_map = jax.tree.map  # type: ignore[attr-defined]


class _Vocabulary:
    """Stand-in for ``seqio.vocabularies.Vocabulary`` (type hints only)."""

    def __init__(self, *args, **kwargs) -> None:
        raise NotImplementedError(
            "seqio vocabularies are not installed; tppo-jax engines bring their own "
            "tokenizer (tppo_jax.models.tokenizer)."
        )


class _SentencePieceVocabulary(_Vocabulary):
    """Stand-in for ``seqio.vocabularies.SentencePieceVocabulary``."""


def _install_seqio_stub() -> None:
    try:  # A real seqio wins if the user installed it.
        import seqio.vocabularies  # noqa: F401

        return
    except ImportError:
        pass
    seqio = types.ModuleType("seqio")
    vocabularies = types.ModuleType("seqio.vocabularies")
    vocabularies.Vocabulary = _Vocabulary
    vocabularies.SentencePieceVocabulary = _SentencePieceVocabulary
    seqio.vocabularies = vocabularies
    seqio.__tppo_stub__ = True
    sys.modules.setdefault("seqio", seqio)
    sys.modules.setdefault("seqio.vocabularies", vocabularies)


def bind_host(host: str = LOOPBACK_HOST) -> None:
    """Sets the interface JetStream's gRPC server binds to (loopback by default)."""
    from jetstream.core import server_lib

    server_lib._HOST = f"[{host}]" if ":" in host and not host.startswith("[") else host


def install() -> None:
    level = logging.getLogger().level
    _install_tree_map()
    _install_seqio_stub()
    bind_host(LOOPBACK_HOST)  # imports JetStream's orchestrator: undo its logging at once
    quiet_logging(level)


def quiet_logging(level: int = logging.WARNING) -> None:
    """JetStream's orchestrator sets the root logger to DEBUG with a handler on the
    ``sys.stdout`` of import time; undo that (root back to ``level``) so users and tests
    keep their own logging setup. Left in place, that handler outlives the stream it
    holds (pytest's capture): jax's exit-time ``Clearing JAX backend caches`` debug line
    then printed ``--- Logging error --- ValueError: I/O operation on closed file``."""
    orchestrator = sys.modules.get("jetstream.core.orchestrator")
    handler = getattr(orchestrator, "handler", None)
    root = logging.getLogger()
    if handler is not None and handler in root.handlers:
        root.removeHandler(handler)
        if root.level == logging.DEBUG:
            root.setLevel(level)


def check() -> None:
    """Imports the JetStream modules tppo-jax uses; raises if any fails."""
    install()
    from jetstream.core import server_lib  # noqa: F401
    from jetstream.engine import engine_api  # noqa: F401

    quiet_logging()
    if server_lib._HOST != LOOPBACK_HOST:
        raise RuntimeError(f"JetStream would bind {server_lib._HOST}, not {LOOPBACK_HOST}")


install()
