"""The records ``rollout.engine.DecodeEngine`` takes and returns: the policy weights it decodes
with, a prefilled prompt, the decode state of every slot, one window's result."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from flax import struct

Array = jax.Array


class PoolExhaustedError(RuntimeError):
    """``insert`` found too few free pages. The decode state passed in was donated; the one
    to keep using (the slot left empty, nothing else touched) is ``decode_state``."""

    def __init__(self, msg: str, decode_state: Any = None) -> None:
        super().__init__(msg)
        self.decode_state = decode_state


@struct.dataclass
class EngineParams:
    """Model weights (``nnx.State``) + the policy version that every sampled token records."""

    state: Any
    version: Array  # () int32


@struct.dataclass
class Prefix:
    """A prefilled prompt (batch 1). k/v: ``[L, P, Hkv, D]``; length: () tokens cached
    (``true_length - 1``); next_token: () the prompt's last token, fed by the first step."""

    k: Array
    v: Array
    length: Array
    next_token: Array


@struct.dataclass
class DecodeState:
    """Everything a decode step transforms; ``S`` slots.

    cache: ``DenseKVCache`` or ``PagedKVCache``; next_token / position / generated: ``[S]``
    int32 (pending token, its position = tokens cached, response tokens so far); seq_id:
    ``[S]`` uint32 (RNG stream); live: ``[S]`` bool; rng: the engine's PRNG key;
    temperature / top_p: ``[S]`` float32 each slot's sampling (read only when the engine
    samples per row, ``SamplingParams.per_row``; set by ``insert``).
    """

    cache: Any
    next_token: Array
    position: Array
    generated: Array
    seq_id: Array
    live: Array
    rng: Array
    temperature: Array
    top_p: Array


class WindowResult(NamedTuple):
    """One ``generate_window`` call. tokens/logprobs: ``[S, W]`` (0 after count); count:
    ``[S]``; hit_eos / finished (EOS, ``max_new_tokens`` or the slot full; its pages freed) /
    stalled (no pages this window; still live): ``[S]`` bool; version, steps: () int32;
    top_ids / top_logprobs: ``[S, W, N]`` (``rollout.decode.WindowOut``)."""

    tokens: Array
    logprobs: Array
    count: Array
    hit_eos: Array
    finished: Array
    stalled: Array
    version: Array
    steps: Array
    top_ids: Array | None = None
    top_logprobs: Array | None = None
