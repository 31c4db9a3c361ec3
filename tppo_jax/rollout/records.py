"""The scheduler's records: one step's ``RolloutBatch`` (what the trainer grades and trains on)
and the host-side ``SlotState`` of every slot (checkpointed with the trainer)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tppo_jax.data.readers import MathExample


@dataclass
class RolloutBatch:
    """One step's rollout, every slot a row (``S = max_prompt_len + max_response_len``).

    tokens: ``[B, S]`` prompt + all windows so far, right-padded with 0.
    prompt_len: ``[B]``; window_start: ``[B]`` index of the first current-window token;
    window_len: ``[B]`` tokens generated this window; total_len = window_start + window_len.
    finished: ``[B]`` bool; window_index: ``[B]`` 0-based window of this row.
    sample_logprobs: ``[B, S]`` log-prob of token ``t`` under the sampling policy (0 elsewhere).
    policy_version: ``[B, S]`` int32 policy version that sampled token ``t`` (-1 for prompts).
    group_id: ``[B]`` int64 id shared by the G samples of a prompt.
    examples: the ``MathExample`` of each row (None for an empty slot).
    """

    tokens: np.ndarray
    prompt_len: np.ndarray
    window_start: np.ndarray
    window_len: np.ndarray
    finished: np.ndarray
    window_index: np.ndarray
    sample_logprobs: np.ndarray
    policy_version: np.ndarray
    group_id: np.ndarray
    examples: list[MathExample | None]  # None for a slot left empty (paged pool short)

    @property
    def total_len(self) -> np.ndarray:
        return self.window_start + self.window_len

    def response_tokens(self, row: int) -> list[int]:
        return self.tokens[row, self.prompt_len[row]:self.total_len[row]].tolist()


@dataclass
class SlotState:
    """Host-side state of every slot; checkpointed with the trainer (numpy only)."""

    tokens: np.ndarray  # [B, S]
    prompt_len: np.ndarray  # [B]
    total_len: np.ndarray  # [B]
    windows_done: np.ndarray  # [B] windows generated so far
    # [B] bool: occupied, a sequence the caller has not released (whether it still decodes
    # is the engine's ``live``)
    live: np.ndarray
    sample_logprobs: np.ndarray  # [B, S]
    policy_version: np.ndarray  # [B, S]
    group_id: np.ndarray  # [B]
    seq_id: np.ndarray  # [B] the sequence's id (``DecodeEngine.new_seq_ids``; its RNG stream)
    example_index: np.ndarray  # [B] index into `examples`

    @classmethod
    def empty(cls, b: int, s: int) -> SlotState:
        z = lambda *shape, dt=np.int32: np.zeros(shape, dt)  # noqa: E731
        return cls(z(b, s), z(b), z(b), z(b), z(b, dt=bool), z(b, s, dt=np.float32),
                   np.full((b, s), -1, np.int32), z(b, dt=np.int64), z(b, dt=np.int64),
                   np.full(b, -1, np.int64))

    def to_dict(self) -> dict[str, np.ndarray]:
        return dict(self.__dict__)
