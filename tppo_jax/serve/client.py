"""A small client for the OpenAI-compatible server (standard library only): what
``tppo generate`` uses, and what a test or a script can call."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any


class ServerError(RuntimeError):
    """The server answered with an error (its HTTP status and message)."""


def stream(host: str, port: int, path: str, body: dict[str, Any], *, timeout: float = 120.0
           ) -> Iterator[str]:
    """POSTs ``body`` (with ``stream: true``) to ``path`` and yields the text pieces of the
    server-sent events (chat deltas or completion text). Raises ``ServerError`` on an
    HTTP error and ``OSError`` when the server cannot be reached."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body | {"stream": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise ServerError(_message(resp.status, resp.read()))
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            choice = json.loads(data)["choices"][0]
            piece = choice.get("delta", {}).get("content") if "delta" in choice else \
                choice.get("text")
            if piece:
                yield piece
    finally:
        conn.close()


def request(host: str, port: int, path: str, body: dict[str, Any] | None = None, *,
            timeout: float = 120.0) -> dict[str, Any]:
    """One JSON request (POST with ``body``, GET without); the decoded JSON answer."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        if body is None:
            conn.request("GET", path)
        else:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise ServerError(_message(resp.status, data))
        return json.loads(data)
    finally:
        conn.close()


def _message(status: int, data: bytes) -> str:
    try:
        return f"HTTP {status}: {json.loads(data)['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {data[:200].decode(errors='replace')}"
