"""An OpenAI-compatible HTTP server (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``; streaming as server-sent events) over the engine ``tppo serve`` serves.

It decodes through ``rollout.server.EngineServer.decode_ids``: the JetStream driver, slots
and decode program that the gRPC door uses, so greedy text is the same through either door.
Standard library only (``http.server``, one thread per connection), bound to loopback
unless asked otherwise. Not served: ``n > 1``, ``stop`` sequences, logprobs, tools, and a
``temperature`` / ``top_p`` other than the server's (``serve.chat``: refused with 400).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tppo_jax.rollout.decode import SamplingParams
from tppo_jax.serve.chat import GenRequest, RequestError, parse_request

log = logging.getLogger(__name__)

Decode = Callable[[list[int], int], Iterator[int]]
MAX_BODY = 8 << 20  # bytes


class TextStream:
    """Token ids -> text pieces: the whole completion is decoded each time and the new
    suffix returned, held back while it ends in an incomplete UTF-8 character (a
    sentencepiece or byte-level tokenizer can split one over several tokens)."""

    def __init__(self, decode_text: Callable[[list[int]], str]) -> None:
        self._decode = decode_text
        self.ids: list[int] = []
        self._sent = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self._decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self._sent):
            return ""
        piece, self._sent = text[len(self._sent):], text
        return piece

    def rest(self) -> str:
        text = self._decode(self.ids)
        piece = text[len(self._sent):] if text.startswith(self._sent) else ""
        self._sent = text
        return piece


class OpenAIServer:
    """HTTP server around ``decode``; ``start()`` then ``stop()`` (or a ``with`` block).

    Args:
      decode: ``(prompt ids, max_tokens) -> iterator of new token ids`` (``decode_ids``).
      tokenizer: ``models.tokenizer.Tokenizer`` (chat template, decoding).
      encode: the served text encoding (``encode_request_text``).
      sampling: the engine's sampling (requests may not change it).
      model_name: the id ``/v1/models`` reports; max_tokens: the default budget;
      max_tokens_limit: the most a request may ask; host / port: 0 = any free port.
    """

    def __init__(self, decode: Decode, tokenizer: Any, encode: Callable[[str], list[int]], *,
                 sampling: SamplingParams, model_name: str = "tppo", max_tokens: int = 256,
                 max_tokens_limit: int = 4096, host: str = "127.0.0.1", port: int = 0) -> None:
        self.decode, self.tokenizer, self.encode = decode, tokenizer, encode
        self.sampling, self.model_name = sampling, model_name
        self.max_tokens, self.max_tokens_limit = min(max_tokens, max_tokens_limit), \
            max_tokens_limit
        handler = type("Handler", (_Handler,), {"app": self})
        self._httpd = ThreadingHTTPServer((host, port), handler)
        self._httpd.daemon_threads = True
        self.host, self.port = host, self._httpd.server_address[1]
        self._thread: threading.Thread | None = None

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
        return parse_request(body, chat=chat, tok=self.tokenizer, encode=self.encode,
                             sampling=self.sampling, default_max_tokens=self.max_tokens,
                             max_tokens_limit=self.max_tokens_limit)

    def decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def _finish(n_tokens: int, req: GenRequest) -> str:
    return "length" if n_tokens >= req.max_tokens else "stop"


class _Handler(BaseHTTPRequestHandler):
    app: OpenAIServer
    server_version = "tppo-openai/1"

    def log_message(self, fmt: str, *args: Any) -> None:  # route to logging, not stderr
        log.debug("%s " + fmt, self.address_string(), *args)

    # ------------------------------------------------------------------ plumbing
    def _json(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        self._json(status, {"error": {"message": message, "type": kind, "code": status}})

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            raise RequestError(f"request body over {MAX_BODY} bytes", 413)
        try:
            return json.loads(self.rfile.read(n) or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"the request body is not JSON: {e}") from None

    # ------------------------------------------------------------------ routes
    def do_GET(self) -> None:  # noqa: N802  (http.server's method name)
        if self.path.rstrip("/") in ("/v1/models", "/models"):
            self._json(200, {"object": "list", "data": [{
                "id": self.app.model_name, "object": "model", "created": 0,
                "owned_by": "tppo-jax"}]})
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
            tokens = self.app.decode(req.ids, req.max_tokens)
            first = next(tokens, None)  # ValueError (bad ids, too long) surfaces here
        except RequestError as e:
            self._error(e.status, str(e))
            return
        except ValueError as e:
            self._error(400, str(e))
            return
        except RuntimeError as e:  # the prefill queue is full
            self._error(503, str(e))
            return
        ids = [] if first is None else _chain(first, tokens)
        try:
            (self._stream if req.stream else self._whole)(req, ids)
        except (BrokenPipeError, ConnectionResetError):
            log.info("client went away; its request is dropped")
        finally:
            if hasattr(tokens, "close"):
                tokens.close()  # frees the slot if the client went away mid-stream

    def _meta(self, req: GenRequest, kind: str) -> dict:
        return {"id": f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                "object": kind, "created": int(time.time()), "model": self.app.model_name}

    def _whole(self, req: GenRequest, ids: Iterator[int] | list[int]) -> None:
        out = list(ids)
        text = self.app.decode_text(out)
        usage = {"prompt_tokens": len(req.ids), "completion_tokens": len(out),
                 "total_tokens": len(req.ids) + len(out)}
        finish = _finish(len(out), req)
        if req.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": finish, "logprobs": None}
            body = self._meta(req, "chat.completion")
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            body = self._meta(req, "text_completion")
        self._json(200, body | {"choices": [choice], "usage": usage})

    def _stream(self, req: GenRequest, ids: Iterator[int] | list[int]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()  # HTTP/1.0: the stream ends when the connection closes
        meta = self._meta(req, "chat.completion.chunk" if req.chat else "text_completion")

        def event(piece: str | None, finish: str | None = None, role: bool = False) -> None:
            if req.chat:
                delta = {"role": "assistant", "content": ""} if role else (
                    {} if piece is None else {"content": piece})
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": piece or "", "finish_reason": finish}
            self.wfile.write(f"data: {json.dumps(meta | {'choices': [choice]})}\n\n".encode())
            self.wfile.flush()

        if req.chat:
            event(None, role=True)
        text = TextStream(self.app.decode_text)
        for token in ids:
            if piece := text.push(token):
                event(piece)
        if piece := text.rest():
            event(piece)
        event(None, _finish(len(text.ids), req))
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


def _chain(first: int, rest: Iterator[int]) -> Iterator[int]:
    yield first
    yield from rest
