"""OpenAI request bodies -> one typed ``GenRequest``: the prompt ids, the token budget, how
to sample, and what to return.

Sampling is per request: ``temperature`` (0 = greedy), ``top_p`` and ``seed`` travel with
the request into its decode slot as traced values (``rollout.decode``: one decode program
for every setting, no compile per request); a request that leaves them out gets the
server's (``rollout.temperature`` / ``rollout.top_p``). ``top_k`` stays the server's.
Chat messages are rendered as the served run built its prompts (``chat_renderer``: the
model's chat template with the assistant generation prompt, where the run used it); text and
ids follow the served-prompt rule of ``rollout.tokenizer_adapter.encode_request_text`` (BOS
only where the tokenizer adds one).

A prompt is measured before it is tokenized: text over ``rollout.server.MAX_CHARS_PER_TOKEN``
characters a token of the server's prompt limit is refused unread, so a huge body costs no tokenizer
time or memory. Unknown parameters are refused, not ignored.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tppo_jax.data.prompts import chat_text, prompt_builder, render_chat, short_prompt
from tppo_jax.rollout.server import MAX_CHARS_PER_TOKEN

ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_N = 16  # completions per request
MAX_STOP = 4  # stop sequences per request (OpenAI's limit)
MAX_TOP_LOGPROBS = 20  # top_logprobs per token (OpenAI's chat limit; completions: 5)
MAX_SEED = 2**31 - 1
COMMON = frozenset({"model", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                    "n", "stop", "stream", "stream_options", "seed", "user",
                    "return_token_ids", "frequency_penalty", "presence_penalty",
                    "logit_bias"})
CHAT_KEYS = COMMON | {"messages", "logprobs", "top_logprobs"}
COMPLETION_KEYS = COMMON | {"prompt", "logprobs", "echo"}


class RequestError(ValueError):
    """A request the server refuses (HTTP ``status``, message for the client)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Sampling:
    """One request's sampling: temperature (0 = greedy), top_p (1 = off), seed (None: a
    fresh stream per sample; else sample ``i`` of the request draws from stream
    ``(seed, i)``, the same on every call)."""

    temperature: float
    top_p: float
    seed: int | None = None


@dataclass(frozen=True)
class GenRequest:
    """One generation request, checked.

    Attributes:
      ids: the prompt token ids; max_tokens: at most this many new tokens per choice;
      stream: answer as server-sent events; chat: a chat completion (else a text one);
      n: choices; stop: strings that end a choice (not included in its text);
      sampling: how tokens are drawn; logprobs: return each token's log-prob, with
      top_logprobs alternatives; token_ids: return the prompt's and each choice's token ids;
      usage_chunk: a streamed answer ends with a usage chunk (``stream_options``).
    """

    ids: list[int]
    max_tokens: int
    stream: bool
    chat: bool
    sampling: Sampling
    n: int = 1
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    token_ids: bool = False
    usage_chunk: bool = False


def _number(body: dict, key: str, lo: float, hi: float, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or not lo <= v <= hi:
        raise RequestError(f"{key} must be a number in [{lo:g}, {hi:g}], got {v!r}")
    return float(v)


def _flag(body: dict, key: str) -> bool:
    """A JSON boolean (or absent / null = false); ``"false"`` is refused, not truthy."""
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise RequestError(f"{key} must be true or false, got {v!r}")
    return v


def _integer(body: dict, key: str, lo: int, hi: int, default: int | None) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise RequestError(f"{key} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


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


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    stops = [] if v is None else [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(
            isinstance(s, str) for s in stops):
        raise RequestError(f"stop must be a string or a list of at most {MAX_STOP} strings")
    return tuple(s for s in stops if s)


def _refuse_unknown(body: dict, chat: bool) -> None:
    known = CHAT_KEYS if chat else COMPLETION_KEYS
    unknown = sorted(set(body) - known)
    if unknown:
        raise RequestError(f"unknown parameter{'s' * (len(unknown) > 1)} "
                           f"{', '.join(map(repr, unknown[:5]))}; this server takes "
                           f"{', '.join(sorted(known))}")
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise RequestError(f"{key} is not supported (only 0)")
    if body.get("logit_bias") not in (None, {}):
        raise RequestError("logit_bias is not supported")
    if not chat and body.get("echo") not in (None, False):
        raise RequestError("echo is not supported (only false)")


def _messages(body: dict, max_chars: int) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("messages must be a non-empty list of {role, content}")
    out, total = [], 0
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}] needs a role in {list(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: text parts only
            if not all(isinstance(c, dict) and c.get("type") == "text"
                       and isinstance(c.get("text", ""), str) for c in content):
                raise RequestError(f"messages[{i}]: only text content parts are served")
            content = "".join(c.get("text", "") for c in content)
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string")
        total += len(content)
        _check_chars(total, max_chars)
        out.append({"role": m["role"], "content": content})
    return out


def _check_chars(n_chars: int, max_chars: int) -> None:
    if n_chars > max_chars:
        raise RequestError(f"the prompt has over {max_chars} characters, more than this "
                           f"server's prompt limit of {max_chars // MAX_CHARS_PER_TOKEN} tokens "
                           f"can hold")


def _check_tokens(n: int, limit: int) -> None:
    if n > limit:
        raise RequestError(f"prompt has {n} tokens; this server takes at most {limit}")


def _prompt_ids(body: dict, encode: Callable[[str], list[int]], limit: int) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt.strip():
            raise RequestError("empty prompt")
        _check_chars(len(prompt), limit * MAX_CHARS_PER_TOKEN)
        return encode(prompt)
    if isinstance(prompt, list) and prompt:
        _check_tokens(len(prompt), limit)
        if all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            return list(prompt)
    raise RequestError("prompt must be one string or one non-empty list of token ids")


SHORT_FORMAT = "the tiny model's Q:/A: format"


def chat_format(cfg: Any, tok: Any) -> str:
    """How ``chat_renderer`` renders chat requests, in words (``tppo serve``'s OPENAI line)."""
    b = prompt_builder(cfg, tok)
    if b.short and not getattr(tok, "chat_template", None):
        return SHORT_FORMAT
    return "the tokenizer's chat template" if b.chat_template is not None else "plain text"


def chat_renderer(cfg: Any, tok: Any) -> Callable[[list[dict[str, str]]], str]:
    """Chat messages -> prompt text, as the run ``cfg`` built its prompts
    (``data.prompts.prompt_builder``): the tokenizer's chat template where the run used it
    (``data.chat_template``), else the plain fallback; the tiny model's ``Q: ...\nA: ``
    format, the user turns as the question, for a tiny run whose tokenizer has no template.
    The run's ``data.system_prompt`` goes first when the request has no system turn."""
    b = prompt_builder(cfg, tok)
    short = chat_format(cfg, tok) == SHORT_FORMAT

    def render(msgs: list[dict[str, str]]) -> str:
        if short:
            return short_prompt("\n\n".join(m["content"] for m in msgs if m["role"] == "user"))
        if b.system_prompt and not any(m["role"] == "system" for m in msgs):
            msgs = [{"role": "system", "content": b.system_prompt}, *msgs]
        if b.chat_template is not None:
            return render_chat(b.chat_template, msgs, bos_token=b.bos_token,
                               eos_token=b.eos_token)
        return chat_text(msgs, None)

    return render


def parse_request(body: Any, *, chat: bool, render: Callable[[list[dict[str, str]]], str],
                  encode: Callable[[str], list[int]],
                  default_sampling: Sampling, default_max_tokens: int, max_tokens_limit: int,
                  max_prompt_tokens: int) -> GenRequest:
    """A ``/v1/chat/completions`` (``chat``) or ``/v1/completions`` body -> ``GenRequest``;
    ``RequestError`` says what is wrong. ``render``: chat messages -> prompt text (e.g.
    ``chat_renderer``); ``encode``: the served text encoding;
    ``default_sampling``: the server's (temperature, top_p) for what a request leaves out."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _refuse_unknown(body, chat)
    stream = _flag(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_usage"}):
        raise RequestError("stream_options takes only include_usage")
    usage_chunk = _flag(opts or {}, "include_usage")
    d = default_sampling
    sampling = Sampling(temperature=_number(body, "temperature", 0, 100, d.temperature),
                        top_p=_number(body, "top_p", 1e-6, 1, d.top_p),
                        seed=_integer(body, "seed", 0, MAX_SEED, None))
    if chat:
        logprobs = _flag(body, "logprobs")
        top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0)
        if top and not logprobs:
            raise RequestError("top_logprobs needs logprobs: true")
        text = render(_messages(body, max_prompt_tokens * MAX_CHARS_PER_TOKEN))
        _check_chars(len(text), max_prompt_tokens * MAX_CHARS_PER_TOKEN)
        ids = encode(text)
    else:
        top = _integer(body, "logprobs", 0, 5, None)
        logprobs, top = top is not None, top or 0
        ids = _prompt_ids(body, encode, max_prompt_tokens)
    _check_tokens(len(ids), max_prompt_tokens)
    return GenRequest(ids=ids, stream=stream, chat=chat, sampling=sampling,
                      max_tokens=_max_tokens(body, default_max_tokens, max_tokens_limit),
                      n=_integer(body, "n", 1, MAX_N, 1), stop=_stop(body),
                      logprobs=logprobs, top_logprobs=top,
                      token_ids=_flag(body, "return_token_ids"), usage_chunk=usage_chunk)
