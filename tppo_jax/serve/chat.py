"""OpenAI request bodies -> one typed ``GenRequest``: the prompt ids, the token budget, and
the sampling check.

The engine's sampling (temperature, top-p, top-k) is compiled into its decode program when
the server starts (``SamplingParams`` is static under jit), so a request may repeat it but
not change it: a different ``temperature`` / ``top_p`` is refused with a message that names
the server's setting and the ``tppo serve rollout.temperature=...`` that changes it.
Chat messages go through the model's chat template (``data.prompts.chat_text``), with the
assistant generation prompt; text and ids follow the served-prompt rule of
``rollout.tokenizer_adapter.encode_request_text`` (BOS only where the tokenizer adds one).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tppo_jax.data.prompts import chat_text
from tppo_jax.rollout.decode import SamplingParams

ROLES = ("system", "user", "assistant", "tool", "developer")


class RequestError(ValueError):
    """A request the server refuses (HTTP ``status``, message for the client)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class GenRequest:
    """One generation request, checked.

    Attributes:
      ids: the prompt token ids; max_tokens: at most this many new tokens;
      stream: answer as server-sent events; chat: a chat completion (else a text one).
    """

    ids: list[int]
    max_tokens: int
    stream: bool
    chat: bool


def _number(body: dict, key: str) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise RequestError(f"{key} must be a finite number, got {v!r}")
    return float(v)


def check_sampling(body: dict, sampling: SamplingParams) -> None:
    """Refuses a ``temperature`` / ``top_p`` other than the server's (see the module doc)."""
    greedy = sampling.greedy or sampling.temperature == 0
    t, p = _number(body, "temperature"), _number(body, "top_p")
    if t is not None and not (t == 0 if greedy else math.isclose(t, sampling.temperature)):
        have = "0 (greedy)" if greedy else f"{sampling.temperature:g}"
        raise RequestError(
            f"this server samples at temperature={have}, fixed when it starts; got "
            f"temperature={t:g}. Leave temperature out, or restart with "
            f"`tppo serve rollout.temperature={t:g}`")
    if p is not None and not greedy and not math.isclose(p, sampling.top_p):
        raise RequestError(
            f"this server samples with top_p={sampling.top_p:g}, fixed when it starts; got "
            f"top_p={p:g}. Leave top_p out, or restart with `tppo serve rollout.top_p={p:g}`")


def _max_tokens(body: dict, default: int, limit: int) -> int:
    v = body.get("max_completion_tokens", body.get("max_tokens"))
    if v is None:
        return min(default, limit)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise RequestError(f"max_tokens must be an integer >= 1, got {v!r}")
    if v > limit:
        raise RequestError(f"max_tokens={v} is over this server's limit of {limit} "
                           f"(rollout.max_response_len)")
    return v


def _messages(body: dict) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("messages must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}] needs a role in {list(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: text parts only
            if not all(isinstance(c, dict) and c.get("type") == "text" for c in content):
                raise RequestError(f"messages[{i}]: only text content parts are served")
            content = "".join(str(c.get("text", "")) for c in content)
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string")
        out.append({"role": m["role"], "content": content})
    return out


def parse_request(body: Any, *, chat: bool, tok: Any, encode: Callable[[str], list[int]],
                  sampling: SamplingParams, default_max_tokens: int, max_tokens_limit: int
                  ) -> GenRequest:
    """A ``/v1/chat/completions`` (``chat``) or ``/v1/completions`` body -> ``GenRequest``;
    ``RequestError`` says what is wrong. ``encode``: the served text encoding."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if body.get("n", 1) != 1:
        raise RequestError("n must be 1 (one completion per request)")
    if body.get("stop") not in (None, [], ""):
        raise RequestError("stop sequences are not supported; generation stops at the "
                           "model's end-of-sequence tokens or max_tokens")
    check_sampling(body, sampling)
    if chat:
        ids = encode(chat_text(_messages(body), tok))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt.strip():
                raise RequestError("empty prompt")
            ids = encode(prompt)
        elif isinstance(prompt, list) and prompt and all(
                isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            ids = list(prompt)
        else:
            raise RequestError("prompt must be one string or one list of token ids")
    return GenRequest(ids=ids, stream=bool(body.get("stream", False)), chat=chat,
                      max_tokens=_max_tokens(body, default_max_tokens, max_tokens_limit))
