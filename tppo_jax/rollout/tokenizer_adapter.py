"""JetStream's tokenizer interface over ours, and the one rule for encoding a served text.

The served prompt is the prompt the user sent: a BOS token only where the model's own
tokenizer adds one (an HF post-processor such as Llama's), never doubled; JetStream's habit
of prepending ``bos_id`` (or the pad id, for tokenizers without BOS) is switched off in
``rollout.server``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import tppo_jax.compat.jetstream  # noqa: F401  (before any jetstream import)

# isort: split
from jetstream.engine import token_utils, tokenizer_api

from tppo_jax.models.tokenizer import Tokenizer


def model_adds_bos(tok: Tokenizer) -> bool:
    """Whether the model's own tokenizer puts BOS in front of a text (an HF post-processor
    such as Llama's; sentencepiece models trained here do not)."""
    if tok.backend != "hf" or tok.bos_id is None:
        return False
    ids = tok._impl.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0] == tok.bos_id


def encode_request_text(tok: Tokenizer, text: str) -> list[int]:
    """A served text prompt as the model's tokenizer encodes it: BOS only where that
    tokenizer adds one, never doubled (a chat-templated text may already start with it)."""
    ids = tok.encode(text)
    if model_adds_bos(tok) and (not ids or ids[0] != tok.bos_id):
        ids = [tok.bos_id] + ids
    return ids


class JetStreamTokenizer(tokenizer_api.Tokenizer):
    """Adapts ``models.tokenizer.Tokenizer`` to JetStream's tokenizer interface, stopping on
    every id of ``eos_ids``."""

    def __init__(self, tok: Tokenizer, eos_ids: tuple[int, ...] | None = None) -> None:
        self.tok = tok
        self._eos = tuple(tok.eos_ids if eos_ids is None else eos_ids)

    def encode(self, s: str, is_bos: bool = True, max_prefill_length: int | None = None,
               jax_padding: bool = True, **kwargs: Any) -> tuple[Any, int]:
        # JetStream's is_bos would prepend bos_id (or pad, for a tokenizer without BOS) to
        # every prompt; the served prompt is exactly the model tokenizer's encoding instead.
        ids = np.asarray(encode_request_text(self.tok, s), np.int32)
        return token_utils.pad_tokens(ids, self.bos_id, self.pad_id, is_bos=False,
                                      max_prefill_length=max_prefill_length,
                                      jax_padding=jax_padding)

    def decode(self, token_ids: list[int], **kwargs: Any) -> str:
        if self.tok.backend == "sentencepiece" and len(token_ids) == 1:
            # Streaming one piece at a time: decode() would drop the word-initial space.
            return self.tok._impl.id_to_piece(int(token_ids[0])).replace("\u2581", " ")
        return self.tok.decode(token_ids)

    @property
    def pad_id(self) -> int:
        return 0 if self.tok.pad_id is None else self.tok.pad_id

    @property
    def eos_id(self) -> int:
        return self._eos[0] if self._eos else -1

    @property
    def bos_id(self) -> int:
        return self.pad_id if self.tok.bos_id is None else self.tok.bos_id

    @property
    def stop_tokens(self) -> set[int]:
        return set(self._eos)  # the engine stops on EOS ids only; pad is a normal token


