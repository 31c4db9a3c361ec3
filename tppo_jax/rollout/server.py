"""JetStream gRPC serving of ``TPPOEngine`` (bound to loopback unless asked otherwise).

We build JetStream's ``Driver`` (prefill / transfer / generate / detokenize threads) around one
engine in interleaved mode, and serve it with our own ``grpc.aio`` server instead of
``server_lib.JetStreamServer`` for two reasons:

* requests are validated *before* they reach the driver: JetStream's worker threads SIGKILL
  the whole process on any exception, so a malformed request (empty prompt, token ids out of
  the vocabulary, ``max_tokens < 1``) must be rejected with ``INVALID_ARGUMENT`` up front;
* the bind address and port are explicit (port 0 picks a free port and reports it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from concurrent import futures
from typing import Any

import grpc
import numpy as np

import tppo_jax.compat.jetstream  # noqa: F401  (before any jetstream import)

# isort: split
from jetstream.core import orchestrator
from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc
from jetstream.engine import token_utils

from tppo_jax.compat.jetstream import LOOPBACK_HOST, quiet_logging
from tppo_jax.rollout.engine import EngineParams, TPPOEngine

log = logging.getLogger(__name__)


class PromptAsSentDriver(orchestrator.Driver):
    """JetStream's ``Driver``, except that a prompt is served exactly as sent: token-id
    requests are not given a leading ``bos_id`` (JetStream adds one to every request whose
    ``history_path`` is empty), and text is encoded as the model's tokenizer does."""

    def _process_prefill_content(self, request: Any, tokenizer: Any, is_bos: bool,
                                 max_prefill_length: int) -> tuple[Any, int]:
        content = request.prefill_content
        if isinstance(content, str):
            return tokenizer.encode(content, is_bos=False, max_prefill_length=max_prefill_length,
                                    jax_padding=self._jax_padding)
        # (JetStream's own path needs an array here once is_bos is False.)
        return token_utils.pad_tokens(np.asarray(content, np.int32), tokenizer.bos_id,
                                      tokenizer.pad_id, is_bos=False,
                                      max_prefill_length=max_prefill_length,
                                      jax_padding=self._jax_padding)


def validate_request(request: jetstream_pb2.DecodeRequest, vocab_size: int,
                     max_prompt_tokens: int | None = None) -> str | None:
    """Why ``request`` cannot be served, or None if it is fine. A prompt longer than the
    engine's prefill length is refused rather than silently truncated."""
    if request.max_tokens < 1:
        return f"max_tokens must be >= 1, got {request.max_tokens}"
    which = request.WhichOneof("content")
    if which is None:
        return "request has neither text_content nor token_content"
    if which == "text_content":
        if not request.text_content.text.strip():
            return "empty prompt text"
        return None
    ids = list(request.token_content.token_ids)
    if not ids:
        return "empty token_content"
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        return f"token ids out of vocabulary [0, {vocab_size}): {bad[:5]}"
    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        return f"prompt has {len(ids)} tokens; this server takes at most {max_prompt_tokens}"
    return None


class ValidatingOrchestrator(orchestrator.LLMOrchestrator):
    """JetStream's servicer, rejecting malformed requests before they reach the driver."""

    def __init__(self, driver: orchestrator.Driver, vocab_size: int,
                 max_prompt_tokens: int | None = None) -> None:
        super().__init__(driver=driver)
        self._vocab_size = vocab_size
        self._max_prompt_tokens = max_prompt_tokens

    async def Decode(  # noqa: N802  (gRPC method name)
        self, request: jetstream_pb2.DecodeRequest,
        context: grpc.aio.ServicerContext | None = None,
    ) -> AsyncIterator[jetstream_pb2.DecodeResponse]:
        err = validate_request(request, self._vocab_size, self._max_prompt_tokens)
        if err is not None:
            log.warning("rejected request: %s", err)
            if context is None:
                raise ValueError(err)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
            return
        async for response in super().Decode(request, context):
            yield response


class EngineServer:
    """``Driver`` + gRPC server around one engine; ``start()`` then ``stop()``.

    Args:
      engine: the engine (used as both prefill and generate engine).
      params: its ``EngineParams`` (default ``engine.load_params()``).
      host: bind address (default loopback); port: 0 = any free port (see ``self.port``).
    """

    def __init__(self, engine: TPPOEngine, params: EngineParams | None = None, *,
                 host: str = LOOPBACK_HOST, port: int = 0, threads: int = 16) -> None:
        engine.strict_insert = False  # a raising insert would kill the server process
        params = engine.load_params() if params is None else params
        self.engine = engine
        self.driver = PromptAsSentDriver(
            prefill_engines=[engine], generate_engines=[engine], prefill_params=[params],
            generate_params=[params], interleaved_mode=True)
        quiet_logging()
        self._executor = futures.ThreadPoolExecutor(max_workers=threads)
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(self._executor)
        self._loop_thread = threading.Thread(target=self._loop.run_forever,
                                             name="grpc-loop", daemon=True)
        self._loop_thread.start()
        bind = f"[{host}]" if ":" in host and not host.startswith("[") else host
        vocab = engine.config.vocab_size

        async def build() -> tuple[grpc.aio.Server, int]:
            server = grpc.aio.server(self._executor)
            jetstream_pb2_grpc.add_OrchestratorServicer_to_server(
                ValidatingOrchestrator(self.driver, vocab, engine.max_prefill_length), server)
            return server, server.add_insecure_port(f"{bind}:{port}")

        self._server, self.port = self._run(build())
        if self.port == 0:
            self.stop()
            raise OSError(f"could not bind {host}:{port}")
        self.host = host
        self._stopped = False

    def _run(self, coro):  # noqa: ANN001, ANN202
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def start(self) -> EngineServer:
        self._run(self._server.start())
        log.info("serving on %s:%d", self.host, self.port)
        return self

    def stop(self, grace: float = 1.0) -> None:
        """Stops the driver threads, the gRPC server and the event loop (idempotent)."""
        if getattr(self, "_stopped", False):
            return
        self._stopped = True
        self.driver.stop()
        if hasattr(self, "_server"):
            self._run(self._server.stop(grace))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(timeout=10)
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> EngineServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
