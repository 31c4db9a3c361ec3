"""JetStream gRPC serving of a ``JetStreamEngine`` (bound to loopback unless asked otherwise).

The engine is ``rollout.jetstream_engine``'s adapter over the decode engine that trains. We
build JetStream's ``Driver`` (prefill / transfer / generate / detokenize threads) around it
in interleaved mode, and serve it with our own ``grpc.aio`` server instead of
``server_lib.JetStreamServer`` for two reasons:

* requests are validated *before* they reach the driver: JetStream's worker threads SIGKILL
  the whole process on any exception, so a malformed request (empty prompt, token ids out of
  the vocabulary, ``max_tokens < 1``) must be rejected with ``INVALID_ARGUMENT`` up front;
* the bind address and port are explicit (port 0 picks a free port and reports it), and the
  server owns its port: gRPC's default ``SO_REUSEPORT`` would let a second server start on a
  busy port and share its traffic (answers from two models), so port sharing is off and a busy
  port is an ``OSError``.

The driver also stops working for a client that has gone: an abandoned request still waiting is
never prefilled, and one in a slot frees the slot at the next decode step (JetStream decodes
both to ``max_tokens``, so abandoned requests delayed every later one).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import queue
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent import futures
from typing import Any, NamedTuple

import grpc
import numpy as np

import tppo_jax.compat.jetstream  # noqa: F401  (before any jetstream import)

# isort: split
from jetstream.core import orchestrator
from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc
from jetstream.core.utils import async_multifuture
from jetstream.engine import engine_api, token_utils

from tppo_jax.compat.jetstream import LOOPBACK_HOST, quiet_logging
from tppo_jax.rollout.engine import EngineParams
from tppo_jax.rollout.jetstream_engine import JetStreamEngine, ServedPrefix, TPPOResultTokens
from tppo_jax.rollout.tokenizer_adapter import encode_request_text

log = logging.getLogger(__name__)

MAX_PORT = 65535
# A token of any tokenizer served here spans at most this many characters of its text (the
# longest BPE / sentencepiece pieces are whitespace runs of a few dozen): a text longer than
# this times the prompt limit is refused before it is tokenized.
MAX_CHARS_PER_TOKEN = 64
# No port sharing: with SO_REUSEPORT a second server binds a busy port and the kernel splits
# connections between the two.
GRPC_OPTIONS = (("grpc.so_reuseport", 0),)


def check_port(port: int, *, allow_any: bool = True) -> None:
    """Raises ``ValueError`` unless ``port`` is in 1..65535, or 0 (any free port) when
    ``allow_any``: gRPC would bind ``port % 65536`` instead of refusing."""
    low = 0 if allow_any else 1
    if isinstance(port, bool) or not isinstance(port, int) or not low <= port <= MAX_PORT:
        what = f"0 (any free port) or 1..{MAX_PORT}" if allow_any else f"1..{MAX_PORT}"
        raise ValueError(f"port must be {what}, got {port!r}")


def ensure_port_free(host: str, port: int) -> None:
    """Raises ``OSError`` (one line) when something already listens on ``host:port``: checked
    with a plain socket first, so a busy port is refused before a model is loaded (and
    without gRPC's own error log line)."""
    check_port(port)
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise OSError(f"cannot bind {host}:{port}: {e.strerror}") from None
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as sock:
            # As gRPC does: TIME_WAIT leftovers of a stopped server do not block the port.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(addr)
            except OSError as e:
                # Anything else (e.g. no IPv6 for the ::1 of "localhost") is gRPC's to judge:
                # it serves on the addresses it can bind.
                if e.errno == errno.EADDRINUSE:
                    raise OSError(f"port {port} on {host} is already in use (another "
                                  f"`tppo serve`?); pick another --port, or 0 for any free "
                                  f"port") from None


class Generated(NamedTuple):
    """One decoded token of ``EngineServer.decode_steps``: its id, its log-prob under the
    distribution it was drawn from, and ``top``: ``(id, log-prob)`` of the most likely tokens
    of that distribution (as many as the engine's ``SamplingParams.top_logprobs``)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class ServedRequest(orchestrator.ActiveRequest):
    """A request with its own sampling: its prefill result reaches ``insert`` as a
    ``ServedPrefix`` (the driver's prefill thread assigns ``prefill_result``; the property
    attaches ``temperature`` / ``top_p`` / ``seq_id`` there), and its stream carries
    ``Generated`` tokens (log-probs included) instead of JetStream's samples."""

    sampling: dict[str, Any]

    @property
    def prefill_result(self) -> Any:
        return self.__dict__.get("_prefill_result")

    @prefill_result.setter
    def prefill_result(self, value: Any) -> None:
        if value is not None and not isinstance(value, ServedPrefix):
            value = ServedPrefix(value, **getattr(self, "sampling", {}))
        self.__dict__["_prefill_result"] = value


def _generated(samples: list[Any], result: TPPOResultTokens, slot: int) -> list[Generated]:
    """The tokens of ``samples`` (one slot's, this step) with their log-probs."""
    lp = float(result.logprobs()[slot, 0])
    ids, lps = result.top()
    top = tuple(zip(ids[slot].tolist(), lps[slot].tolist(), strict=True))
    return [Generated(int(t), lp, top) for s in samples for t in s.token_ids]


def _abandoned(request: Any) -> bool:
    """Whether the client of ``request`` has gone (its stream cancelled or the driver
    stopping, which drops the channel)."""
    channel = getattr(request, "return_channel", None)
    return isinstance(request, orchestrator.ActiveRequest) and (
        channel is None or channel.cancelled())


class _SkipAbandoned(queue.Queue):
    """The prefill backlog: ``get`` drops the requests whose client has gone, so they are
    never prefilled (``on_drop`` counts them)."""

    def __init__(self, on_drop: Callable[[], None]) -> None:
        super().__init__()
        self._on_drop = on_drop

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        while True:
            item = super().get(block, timeout)
            if not _abandoned(item):
                return item
            self._on_drop()


class PromptAsSentDriver(orchestrator.Driver):
    """JetStream's ``Driver``, except that a prompt is served exactly as sent: token-id
    requests are not given a leading ``bos_id`` (JetStream adds one to every request whose
    ``history_path`` is empty), and text is encoded as the model's tokenizer does; and that a
    request whose client has gone is dropped before prefill or freed from its slot at the
    next step (``abandoned`` counts them)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._skipped = 0  # abandoned before prefill (prefill thread only)
        self._freed = 0  # abandoned in a slot (detokenize thread only)
        self._live: dict[int, dict[int, orchestrator.ActiveRequest]] = {}  # engine -> slot -> req
        super().__init__(*args, **kwargs)  # starts the threads

    # JetStream's __init__ assigns the prefill backlog and starts the threads that read it in
    # one go; a property installs our queue at that assignment, before any thread runs.
    @property
    def _prefill_backlog(self) -> queue.Queue:
        return self.__dict__["_prefill_queue"]

    @_prefill_backlog.setter
    def _prefill_backlog(self, _jetstream_queue: queue.Queue) -> None:
        self.__dict__["_prefill_queue"] = _SkipAbandoned(self._count_skipped)

    def _count_skipped(self) -> None:
        self._skipped += 1

    @property
    def abandoned(self) -> int:
        """Requests whose client went away before they finished, and that were dropped."""
        return self._skipped + self._freed

    def busy_slots(self) -> int:
        """Slots decoding a request now. (Not JetStream's free-slot queue: its generate thread
        holds one slot out of that queue while it waits for work, even when idle.)"""
        return sum(len(live) for live in self._live.values())

    def queued(self) -> int:
        """Requests waiting for prefill."""
        return self._prefill_backlog.qsize()

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

    def _detokenize_thread(self, idx: int) -> None:
        """JetStream's detokenize loop (tokens of each step to each live slot's stream, slot
        freed when its request is complete), except that the slot of a request whose client
        has gone is freed at once instead of being decoded to ``max_tokens``."""
        backlog = self._detokenize_backlogs[idx]
        engine = self._generate_engines[idx]
        free = self._generate_slots[idx]
        tokenizer = engine.build_tokenizer(engine.get_tokenizer())
        live = self._live.setdefault(idx, {})
        while self.live:
            data = backlog.get(block=True)
            if data is None:
                break
            if not isinstance(data[1], engine_api.ResultTokens):
                slot, request = data  # from now on, this slot's tokens go to this request
                live[slot] = request
                continue
            result = data[1].convert_to_numpy()
            for slot, request in list(live.items()):
                if _abandoned(request):
                    self._freed += 1
                else:
                    samples, request.complete = token_utils.process_result_tokens(
                        tokenizer=tokenizer, slot=slot, slot_max_length=request.max_tokens,
                        result_tokens=result, complete=request.complete,
                        is_client_side_tokenization=request.is_client_side_tokenization)
                    if isinstance(request, ServedRequest):
                        samples = _generated(samples, result, slot)
                    request.enqueue_samples(samples)
                    if not request.complete.all():
                        continue
                    request.return_channel.close()
                del live[slot]
                free.put(slot, block=False)


def validate_request(request: jetstream_pb2.DecodeRequest, vocab_size: int,
                     max_prompt_tokens: int | None = None,
                     encode: Callable[[str], list[int]] | None = None) -> str | None:
    """Why ``request`` cannot be served, or None if it is fine. A prompt longer than the
    engine's prefill length is refused rather than silently truncated (JetStream keeps its
    last tokens): token ids as sent, text as ``encode`` (the served encoding) gives it, after
    a character bound (``MAX_CHARS_PER_TOKEN``) that refuses a huge text untokenized."""
    if request.max_tokens < 1:
        return f"max_tokens must be >= 1, got {request.max_tokens}"
    which = request.WhichOneof("content")
    if which is None:
        return "request has neither text_content nor token_content"
    if which == "text_content":
        text = request.text_content.text
        if not text.strip():
            return "empty prompt text"
        if max_prompt_tokens is not None and len(text) > max_prompt_tokens * MAX_CHARS_PER_TOKEN:
            return (f"prompt has {len(text)} characters, more than {max_prompt_tokens} tokens "
                    f"can hold; this server takes at most {max_prompt_tokens} tokens")
        return None if encode is None else _too_long(len(encode(text)), max_prompt_tokens)
    ids = list(request.token_content.token_ids)
    if not ids:
        return "empty token_content"
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        return f"token ids out of vocabulary [0, {vocab_size}): {bad[:5]}"
    return _too_long(len(ids), max_prompt_tokens)


def _too_long(n: int, limit: int | None) -> str | None:
    if limit is not None and n > limit:
        return f"prompt has {n} tokens; this server takes at most {limit}"
    return None


class ValidatingOrchestrator(orchestrator.LLMOrchestrator):
    """JetStream's servicer, rejecting malformed requests before they reach the driver."""

    def __init__(self, driver: orchestrator.Driver, vocab_size: int,
                 max_prompt_tokens: int | None = None,
                 encode: Callable[[str], list[int]] | None = None) -> None:
        super().__init__(driver=driver)
        self._vocab_size = vocab_size
        self._max_prompt_tokens = max_prompt_tokens
        self._encode = encode

    async def Decode(  # noqa: N802  (gRPC method name)
        self, request: jetstream_pb2.DecodeRequest,
        context: grpc.aio.ServicerContext | None = None,
    ) -> AsyncIterator[jetstream_pb2.DecodeResponse]:
        # Off the event loop: encoding a long text must not stall every other stream.
        err = await asyncio.get_running_loop().run_in_executor(
            None, validate_request, request, self._vocab_size, self._max_prompt_tokens,
            self._encode)
        if err is not None:
            log.warning("rejected request: %s", err)
            if context is None:
                raise ValueError(err)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
            return
        async for response in super().Decode(request, context):
            yield response


class _TokenStream:
    """The tokens of one submitted request (``EngineServer.decode_steps``); ``close()``
    (also before the first token) cancels the request, freeing its slot."""

    def __init__(self, channel: async_multifuture.AsyncMultifuture, run: Callable) -> None:
        self._channel, self._run = channel, run
        self._buffer: list[Generated] = []

    def __iter__(self) -> _TokenStream:
        return self

    def __next__(self) -> Generated:
        while not self._buffer:
            got = self._run(self._step())
            if got is None:
                raise StopIteration
            self._buffer = list(got)
        return self._buffer.pop(0)

    async def _step(self) -> list | None:
        try:
            return await self._channel.__anext__()
        except StopAsyncIteration:
            return None

    def close(self) -> None:
        if not self._channel.done():
            self._channel.cancel()


class EngineServer:
    """``Driver`` + gRPC server around one engine; ``start()`` then ``stop()``.

    Args:
      engine: the JetStream engine (used as both prefill and generate engine).
      params: its ``EngineParams`` (default ``engine.load_params()``).
      host: bind address (default loopback); port: 0 = any free port (see ``self.port``),
        else 1..65535, not shared with another server (``OSError`` when it is busy).
    """

    def __init__(self, engine: JetStreamEngine, params: EngineParams | None = None, *,
                 host: str = LOOPBACK_HOST, port: int = 0, threads: int = 16) -> None:
        ensure_port_free(host, port)  # before any thread starts
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
        vocab = engine.core.config.vocab_size

        # A text prompt is measured as the driver will encode it (JetStreamTokenizer.encode).
        encode = lambda text: encode_request_text(engine.tokenizer, text)  # noqa: E731

        async def build() -> tuple[grpc.aio.Server, int]:
            server = grpc.aio.server(self._executor, options=GRPC_OPTIONS)
            jetstream_pb2_grpc.add_OrchestratorServicer_to_server(ValidatingOrchestrator(
                self.driver, vocab, engine.max_prefill_length, encode), server)
            try:
                return server, server.add_insecure_port(f"{bind}:{port}")
            except RuntimeError:  # lost a race for the port since ensure_port_free
                return server, 0

        self._server, self.port = self._run(build())
        if self.port == 0:
            self.stop()
            raise OSError(f"could not bind {host}:{port}")
        self.host = host
        self._stopped = False

    def _run(self, coro):  # noqa: ANN001, ANN202
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def decode_ids(self, ids: list[int], max_tokens: int) -> Iterator[int]:
        """``decode_steps`` at the engine's sampling, token ids only (closing the iterator
        frees the slot)."""
        stream = self.decode_steps(ids, max_tokens)

        def tokens() -> Iterator[int]:
            try:
                for g in stream:
                    yield g.token
            finally:
                stream.close()

        return tokens()

    def decode_steps(self, ids: list[int], max_tokens: int, *,
                     temperature: float | None = None, top_p: float | None = None,
                     seq_id: int | None = None) -> Iterator[Generated]:
        """Submits prompt ``ids`` and returns the stream of tokens the driver decodes after
        it, exactly as a gRPC token-id request is decoded (same driver, same slots, no BOS
        added; stops at an EOS id, which is not yielded, or after ``max_tokens``), sampled
        at ``temperature`` (0 = greedy) / ``top_p`` (None: the engine's; an engine that does
        not sample per row ignores them) from stream ``seq_id`` (None: a fresh one). The
        HTTP server's one door to the engine. Raises ``ValueError`` for what gRPC answers
        ``INVALID_ARGUMENT``, and ``RuntimeError`` when the prefill queue is full. Closing
        the iterator early (a client that went away) frees the request's slot at the next
        decode step."""
        req = jetstream_pb2.DecodeRequest(max_tokens=max_tokens, token_content=(
            jetstream_pb2.DecodeRequest.TokenContent(token_ids=ids)))
        err = validate_request(req, self.engine.core.config.vocab_size,
                               self.engine.max_prefill_length)
        if err is not None:
            raise ValueError(err)

        async def submit() -> async_multifuture.AsyncMultifuture:
            channel = async_multifuture.AsyncMultifuture()  # bound to the server's loop
            request = ServedRequest(max_tokens=max_tokens, prefill_content=list(ids),
                                    is_client_side_tokenization=True, return_channel=channel)
            request.sampling = dict(temperature=temperature, top_p=top_p, seq_id=seq_id)
            self.driver.place_request_on_prefill_queue(request)
            return channel

        try:
            channel = self._run(submit())
        except queue.Full:
            raise RuntimeError("the prefill queue is full; retry the request") from None
        return _TokenStream(channel, self._run)

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
