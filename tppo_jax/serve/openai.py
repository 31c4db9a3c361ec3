"""An OpenAI-compatible HTTP server (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``; streaming as server-sent events) over the engine ``tppo serve`` serves.

It decodes through ``rollout.server.EngineServer.decode_steps``: the JetStream driver, slots
and decode program that the gRPC door uses, so greedy text is the same through either door.
Each request samples as it asks (``temperature``, ``top_p``, ``seed``; ``serve.chat``), with
``n`` choices, ``stop`` strings, log-probs and token ids (``serve.answers``).

Standard library only (``http.server``), bound to loopback unless asked otherwise, and
bounded: at most ``max_connections`` handler threads (more connections get 503 with
``Retry-After`` at once), a socket that waits on its client longer than ``idle_timeout``
is closed, a body is bounded by bytes before it is read (from the prompt limit) and a prompt
by characters before it is tokenized. A client that leaves is one log line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tppo_jax.data.prompts import chat_text
from tppo_jax.rollout.server import MAX_CHARS_PER_TOKEN
from tppo_jax.serve.answers import Choice, TextStream, logprobs_block
from tppo_jax.serve.chat import (
    GenRequest,
    RequestError,
    Sampling,
    parse_request,
)

__all__ = ["OpenAIServer", "TextStream"]
log = logging.getLogger(__name__)

# ``(prompt ids, max_tokens, temperature=, top_p=, seq_id=) -> Generated items`` (token,
# logprob, top): ``EngineServer.decode_steps``. It validates and submits when called.
Decode = Callable[..., Iterator[Any]]
# A body holds the prompt's characters as JSON escapes (at most 6 bytes each) and the rest.
BODY_OVERHEAD = 64 << 10  # bytes
MAX_CONNECTIONS = 64
IDLE_TIMEOUT = 30.0  # seconds
RETRY_AFTER = 1  # seconds, on a 503
SEEDED = 1 << 31  # seeded samples draw from streams in the upper half of the sequence ids


def seeded_seq_id(seed: int, index: int) -> int:
    """The sampling stream of choice ``index`` of a request with ``seed``: the same on every
    call, apart from the engine's own sequence ids (which count up from 0)."""
    return SEEDED | ((seed * 16 + index) % SEEDED)


class _HTTPServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` with a cap on handler threads (the connection over the cap
    gets 503 from the accept loop, no thread) and one log line per failed connection."""

    daemon_threads = True

    def __init__(self, addr: tuple[str, int], handler: type, max_connections: int) -> None:
        self.max_connections = max_connections
        self.active = 0
        self._lock = threading.Lock()
        super().__init__(addr, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            ok = self.active < self.max_connections
            self.active += ok
        if not ok:
            _answer_busy(request)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def _release(self) -> None:
        with self._lock:
            self.active -= 1

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        who = client_address[0] if isinstance(client_address, tuple) else client_address
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.info("client %s went away: %s", who, exc)
        else:
            log.warning("request from %s failed: %s: %s", who, type(exc).__name__, exc)


def _error_body(status: int, message: str) -> bytes:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()


def _answer_busy(sock: socket.socket) -> None:
    """503 on a connection over the cap, from the accept loop: what the client has already
    sent is read first (closing over unread bytes resets the connection before the client
    reads the answer), waiting at most 50 ms so a flood of silent sockets cannot stall it."""
    body = _error_body(503, "the server is at its connection limit; retry")
    head = (f"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: {RETRY_AFTER}\r\n"
            f"Connection: close\r\n\r\n").encode()
    with contextlib.suppress(OSError):
        sock.settimeout(0.05)
        with contextlib.suppress(OSError):
            sock.recv(1 << 16)
        sock.sendall(head + body)


class OpenAIServer:
    """HTTP server around ``decode``; ``start()`` then ``stop()`` (or a ``with`` block).

    Args:
      decode: ``EngineServer.decode_steps`` (see ``Decode``).
      tokenizer: ``models.tokenizer.Tokenizer`` (chat template, decoding).
      encode: the served text encoding (``encode_request_text``).
      sampling: what a request that names no ``temperature`` / ``top_p`` gets.
      model_name: the id ``/v1/models`` reports; max_tokens: the default budget;
      max_tokens_limit: the most a request may ask; max_prompt_tokens: the longest prompt
      (the engine's prefill length); host / port: 0 = any free port; max_connections,
      idle_timeout: see the module docstring; chat: messages -> prompt text (default: the
      tokenizer's chat template, ``data.prompts.chat_text``; ``tppo serve``: the run's
      format, ``serve.chat.chat_renderer``).
    """

    def __init__(self, decode: Decode, tokenizer: Any, encode: Callable[[str], list[int]], *,
                 sampling: Sampling, max_prompt_tokens: int, model_name: str = "tppo",
                 max_tokens: int = 256, max_tokens_limit: int = 4096,
                 host: str = "127.0.0.1", port: int = 0,
                 max_connections: int = MAX_CONNECTIONS, idle_timeout: float = IDLE_TIMEOUT,
                 chat: Callable[[list[dict[str, str]]], str] | None = None) -> None:
        self.decode, self.tokenizer, self.encode = decode, tokenizer, encode
        self.render = chat or (lambda msgs: chat_text(msgs, tokenizer))
        self.sampling, self.model_name = sampling, model_name
        self.max_tokens, self.max_tokens_limit = min(max_tokens, max_tokens_limit), \
            max_tokens_limit
        self.max_prompt_tokens = max_prompt_tokens
        self.max_body = BODY_OVERHEAD + 6 * MAX_CHARS_PER_TOKEN * max_prompt_tokens
        self._handler = type("Handler", (_Handler,), {"app": self, "timeout": idle_timeout})
        self._httpd = _HTTPServer((host, port), self._handler, max_connections)
        self.host, self.port = host, self._httpd.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def idle_timeout(self) -> float:
        """Seconds a connection's socket waits on its client (for connections made after a
        change)."""
        return self._handler.timeout

    @idle_timeout.setter
    def idle_timeout(self, seconds: float) -> None:
        self._handler.timeout = seconds

    @property
    def active_connections(self) -> int:
        """Connections a handler thread holds now."""
        return self._httpd.active

    def start(self) -> OpenAIServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="openai-http",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> OpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def parse(self, body: Any, chat: bool) -> GenRequest:
        return parse_request(body, chat=chat, render=self.render, encode=self.encode,
                             default_sampling=self.sampling, max_tokens_limit=self.max_tokens_limit,
                             default_max_tokens=self.max_tokens,
                             max_prompt_tokens=self.max_prompt_tokens)

    def choices(self, req: GenRequest) -> list[Choice]:
        """Submits the request's ``n`` decodes (all at once: they share the decode steps);
        ``ValueError`` / ``RuntimeError`` as ``decode`` raises them."""
        out: list[Choice] = []
        try:
            for i in range(req.n):
                s = req.sampling
                seq = None if s.seed is None else seeded_seq_id(s.seed, i)
                tokens = self.decode(req.ids, req.max_tokens, temperature=s.temperature,
                                     top_p=s.top_p, seq_id=seq)
                out.append(Choice(i, tokens, req, self.decode_text))
        except BaseException:
            for c in out:
                c.close()
            raise
        return out

    def decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


class _Handler(BaseHTTPRequestHandler):
    app: OpenAIServer
    server_version = "tppo-openai/1"

    def log_message(self, fmt: str, *args: Any) -> None:  # route to logging, not stderr
        log.debug("%s " + fmt, self.address_string(), *args)

    # ------------------------------------------------------------------ plumbing
    def _json(self, status: int, obj: Any = None, data: bytes | None = None,
              headers: dict[str, str] | None = None) -> None:
        data = json.dumps(obj).encode() if data is None else data
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        self._json(status, data=_error_body(status, message),
                   headers={"Retry-After": str(RETRY_AFTER)} if status == 503 else None)

    def _body(self) -> Any:
        """The JSON body, bounded by bytes before it is read; refused in one line (4xx)
        when it is not there, too big, not JSON, nested too deeply or not valid Unicode."""
        if self.headers.get("Transfer-Encoding"):
            raise RequestError("send the body with a Content-Length (chunked bodies are not "
                               "read)", 411)
        raw = self.headers.get("Content-Length")
        if raw is None:
            raise RequestError("a POST needs a Content-Length header", 411)
        if not raw.strip().isdigit():
            raise RequestError(f"bad Content-Length {raw[:20]!r}")
        n = int(raw)
        if n > self.app.max_body:
            raise RequestError(f"the request body has {n} bytes; this server reads at most "
                               f"{self.app.max_body} (its prompt limit is "
                               f"{self.app.max_prompt_tokens} tokens)", 413)
        data = self.rfile.read(n)  # the socket's idle timeout bounds a slow body
        if len(data) < n:
            raise ConnectionAbortedError(f"body ended after {len(data)} of {n} bytes")
        try:
            body = json.loads(data or b"null")
            json.dumps(body, ensure_ascii=False).encode("utf-8")  # a lone surrogate raises
        except RecursionError:
            raise RequestError("the request body is nested too deeply") from None
        except UnicodeError:
            raise RequestError("the request body is not valid Unicode (a lone surrogate "
                               "such as \\ud800?)") from None
        except json.JSONDecodeError as e:
            raise RequestError(f"the request body is not JSON: {e}") from None
        return body

    # ------------------------------------------------------------------ routes
    def do_GET(self) -> None:  # noqa: N802  (http.server's method name)
        if self.path.rstrip("/") in ("/v1/models", "/models"):
            self._json(200, {"object": "list", "data": [{
                "id": self.app.model_name, "object": "model", "created": 0,
                "owned_by": "tppo-jax", "max_model_len": self.app.max_prompt_tokens
                + self.app.max_tokens_limit}]})
        elif self.path.rstrip("/") in ("/health", "/v1/health"):
            self._json(200, {"status": "ok"})
        else:
            self._error(404, f"no route {self.path}")

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.rstrip("/")
        if path not in ("/v1/completions", "/v1/chat/completions"):
            self._error(404, f"no route {self.path}")
            return
        try:
            req = self.app.parse(self._body(), chat=path.endswith("chat/completions"))
            choices = self.app.choices(req)  # ValueError: bad ids, a prompt too long
        except RequestError as e:
            self._error(e.status, str(e))
            return
        except (ConnectionError, TimeoutError):
            raise  # the client left: one log line (handle_error)
        except ValueError as e:
            self._error(400, str(e))
            return
        except RuntimeError as e:  # the prefill queue is full
            self._error(503, str(e))
            return
        except Exception as e:  # noqa: BLE001  (a bug: one line to the log, none to the client)
            log.warning("request failed: %s: %s", type(e).__name__, e)
            log.debug("request failed", exc_info=True)
            self._error(500, "internal server error (see the server's log)")
            return
        try:
            (self._stream if req.stream else self._whole)(req, choices)
        finally:
            for c in choices:
                c.close()  # frees the slots of a client that went away mid-answer

    def _meta(self, req: GenRequest, kind: str) -> dict:
        return {"id": f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                "object": kind, "created": int(time.time()), "model": self.app.model_name}

    def _usage(self, req: GenRequest, choices: list[Choice]) -> dict[str, int]:
        out = sum(len(c.steps) for c in choices)
        return {"prompt_tokens": len(req.ids), "completion_tokens": out,
                "total_tokens": len(req.ids) + out}

    def _whole(self, req: GenRequest, choices: list[Choice]) -> None:
        while any(c.finish is None for c in choices):
            for c in choices:
                c.advance()
        body = self._meta(req, "chat.completion" if req.chat else "text_completion")
        items = []
        for c in choices:
            lp = logprobs_block(c.steps, req, self.app.decode_text)
            item = ({"index": c.index, "message": {"role": "assistant", "content": c.text.text}}
                    if req.chat else {"index": c.index, "text": c.text.text})
            item |= {"finish_reason": c.finish, "logprobs": lp}
            if req.token_ids:
                item["token_ids"] = [int(g.token) for g in c.steps]
            items.append(item)
        if req.token_ids:
            body["prompt_token_ids"] = list(req.ids)
        self._json(200, body | {"choices": items, "usage": self._usage(req, choices)})

    def _stream(self, req: GenRequest, choices: list[Choice]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()  # HTTP/1.0: the stream ends when the connection closes
        meta = self._meta(req, "chat.completion.chunk" if req.chat else "text_completion")
        if req.token_ids:
            meta["prompt_token_ids"] = list(req.ids)
        sent = [0] * len(choices)

        def event(c: Choice, piece: str | None, finish: str | None = None,
                  role: bool = False) -> None:
            if req.chat:
                delta = {"role": "assistant", "content": ""} if role else (
                    {} if piece is None else {"content": piece})
                choice = {"index": c.index, "delta": delta}
            else:
                choice = {"index": c.index, "text": piece or ""}
            steps = [] if role else c.new_steps()
            before = [int(g.token) for g in c.steps[:len(c.steps) - len(steps)]]
            choice |= {"finish_reason": finish,
                       "logprobs": logprobs_block(steps, req, self.app.decode_text,
                                                  sent[c.index], before) if steps else None}
            if req.token_ids and not role:
                choice["token_ids"] = [int(g.token) for g in steps]
            sent[c.index] += len(piece or "")
            self._send(meta | {"choices": [choice]})

        for c in choices:
            if req.chat:
                event(c, None, role=True)
        while live := [c for c in choices if c.finish is None]:
            for c in live:
                piece = c.advance()
                if piece:
                    event(c, piece)
                if c.finish is not None:
                    event(c, None, c.finish)
        if req.usage_chunk:
            self._send(meta | {"choices": [], "usage": self._usage(req, choices)})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _send(self, obj: dict) -> None:
        self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
        self.wfile.flush()
