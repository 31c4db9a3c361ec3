"""What the OpenAI-compatible server sends back for one choice: its text as it grows (held
back while a character or a stop sequence is incomplete), its finish reason, and the token
ids and log-probs in OpenAI's chat and completions layouts."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from tppo_jax.serve.chat import GenRequest


class TextStream:
    """Token ids -> text pieces: the whole completion is decoded each time and the new
    suffix returned, held back while it ends in an incomplete UTF-8 character (a
    sentencepiece or byte-level tokenizer can split one over several tokens) or in what may
    be the start of a ``stop`` string. Once a stop string appears, the text ends before it
    and ``stopped`` is set."""

    def __init__(self, decode_text: Callable[[list[int]], str], stop: tuple[str, ...] = ()
                 ) -> None:
        self._decode = decode_text
        self.stop = stop
        self.stopped = False
        self.ids: list[int] = []
        self._sent = ""

    def _held(self, text: str) -> int:
        """Characters at the end of ``text`` that may begin a stop string."""
        return max((k for s in self.stop for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self._decode(self.ids)
        hits = [i for s in self.stop if (i := text.find(s)) >= 0]
        if hits:
            self.stopped = True
            text = text[:min(hits)]
        elif text.endswith("\ufffd"):
            return ""
        else:
            text = text[:len(text) - self._held(text)]
        if not text.startswith(self._sent):
            return ""
        piece, self._sent = text[len(self._sent):], text
        return piece

    def rest(self) -> str:
        """The text still held back, once the choice has ended without a stop string."""
        if self.stopped:
            return ""
        text = self._decode(self.ids)
        piece = text[len(self._sent):] if text.startswith(self._sent) else ""
        self._sent = text
        return piece

    @property
    def text(self) -> str:
        return self._sent


class Choice:
    """One choice of a request, read token by token from ``tokens`` (``Generated`` items:
    ``token``, ``logprob``, ``top``). ``advance()`` pulls one token and returns the text it
    releases; ``finish`` is set once the choice has ended."""

    def __init__(self, index: int, tokens: Iterator[Any], req: GenRequest,
                 decode_text: Callable[[list[int]], str]) -> None:
        self.index, self.req = index, req
        self._tokens = tokens
        self.text = TextStream(decode_text, req.stop)
        self.steps: list[Any] = []
        self.finish: str | None = None
        self._reported = 0

    def advance(self) -> str:
        if self.finish is not None:
            return ""
        g = next(self._tokens, None)
        if g is None:
            self.finish = "length" if len(self.steps) >= self.req.max_tokens else "stop"
            return self.text.rest()
        self.steps.append(g)
        piece = self.text.push(int(g.token))
        if self.text.stopped:
            self.finish = "stop"
            self.close()
        return piece

    def new_steps(self) -> list[Any]:
        """The tokens not reported yet (streaming: the ones since the last event)."""
        new, self._reported = self.steps[self._reported:], len(self.steps)
        return new

    def close(self) -> None:
        """Ends the choice's decode (its slot is freed at the next step)."""
        close = getattr(self._tokens, "close", None)
        if close is not None:
            close()


def _entry(tok: str, lp: float) -> dict[str, Any]:
    return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8", "replace"))}


def token_piece(decode_text: Callable[[list[int]], str], before: list[int], token: int) -> str:
    """The text ``token`` adds after ``before`` (its last few tokens as context: a
    sentencepiece word-start piece decodes alone without its space)."""
    ctx = before[-4:]
    base, full = decode_text(ctx), decode_text([*ctx, token])
    return full[len(base):] if full.startswith(base) else decode_text([token])


def logprobs_block(steps: list[Any], req: GenRequest, decode_text: Callable[[list[int]], str],
                   offset: int = 0, before: list[int] | None = None) -> dict[str, Any] | None:
    """The ``logprobs`` of a choice (or of a streamed chunk): chat's ``{"content": [...]}``
    or completions' ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``
    (``offset``: characters of the choice sent before these steps; ``before``: its token
    ids before them). Alternatives of probability 0 (outside the top-p nucleus) are left
    out."""
    if not req.logprobs:
        return None
    prev = list(before or [])
    rows = []  # (token text, log-prob, [(alternative text, log-prob)])
    for g in steps:
        alts = [(token_piece(decode_text, prev, int(t)), float(lp))
                for t, lp in g.top[:req.top_logprobs] if math.isfinite(lp)]
        rows.append((token_piece(decode_text, prev, int(g.token)), float(g.logprob), alts))
        prev.append(int(g.token))
    if req.chat:
        return {"content": [_entry(t, lp) | {"top_logprobs": [_entry(a, x) for a, x in alts]}
                            for t, lp, alts in rows]}
    offsets, at = [], offset
    for t, _, _ in rows:
        offsets.append(at)
        at += len(t)
    return {"tokens": [t for t, _, _ in rows], "token_logprobs": [lp for _, lp, _ in rows],
            "top_logprobs": [dict(alts) for _, _, alts in rows] if req.top_logprobs else None,
            "text_offset": offsets}
