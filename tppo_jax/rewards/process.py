"""Process rewards: turn step verdicts into dense per-token rewards (pure numpy, no model).

The outcome reward sits on the last response token; these rewards are *added* to that array at the
tokens where checked steps end, so GAE credits an arithmetic slip to the tokens that produced it
instead of smearing the outcome over the whole response.

Modes:
- ``none``: all zeros (the outcome-only baseline).
- ``first_error``: ``penalty`` at the last token of the first invalid step; nothing else. Steps
  after the first error are not judged (they usually inherit it).
- ``per_step``: ``+step_bonus`` at the end of every valid step and ``penalty`` at the end of every
  invalid one; uncheckable steps get nothing.

A step whose end token lies at or beyond ``response_len`` (the response was cut before it ended)
gets nothing: the tokens that would carry the reward do not exist in this row.

``step_token_ends`` finds those tokens: the token holding each step's last character, by prefix
decodes, so it works for byte-level BPE where tokens and characters do not align.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from tppo_jax.rewards.step_verifier import StepReport

Mode = Literal["none", "first_error", "per_step"]
MODES: tuple[str, ...] = ("none", "first_error", "per_step")


def process_rewards(
    reports: Sequence[StepReport],
    token_ends: Sequence[Sequence[int]],
    response_len: Sequence[int] | np.ndarray,
    *,
    mode: Mode = "first_error",
    penalty: float = -0.5,
    step_bonus: float = 0.05,
    num_tokens: int | None = None,
) -> np.ndarray:
    """Per-token process rewards.

    Args:
      reports: one :class:`StepReport` per row (``verify_solution`` of the decoded response).
      token_ends: per row, per step of its report, the response-token index holding the step's
        last character (``step_token_ends``).
      response_len: ``[B]`` number of valid response tokens per row.
      mode / penalty / step_bonus: see the module docstring (``penalty`` is negative).
      num_tokens: ``T`` of the output (default ``max(response_len)``), to match a padded batch.
    Returns:
      ``[B, T]`` float32, zero outside ``[0, response_len)``.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    lens = np.asarray(response_len, dtype=np.int64).reshape(-1)
    b = len(reports)
    if len(token_ends) != b or lens.shape[0] != b:
        raise ValueError(f"batch mismatch: {b} reports, {len(token_ends)} token_ends, "
                         f"{lens.shape[0]} response_len")
    t = int(num_tokens if num_tokens is not None else (lens.max() if b else 0))
    out = np.zeros((b, t), np.float32)
    if mode == "none":
        return out
    for row, (rep, ends) in enumerate(zip(reports, token_ends, strict=True)):
        if len(ends) != len(rep.steps):
            raise ValueError(f"row {row}: {len(ends)} token ends for {len(rep.steps)} steps")
        limit = min(int(lens[row]), t)

        def put(step: int, value: float, row: int = row, ends: Sequence[int] = ends,
                limit: int = limit) -> None:
            pos = int(ends[step])
            if 0 <= pos < limit:
                out[row, pos] += value  # += : two steps may end on one token

        if mode == "first_error":
            if rep.first_invalid is not None:
                put(rep.first_invalid, penalty)
        else:
            for i, s in enumerate(rep.steps):
                if s.verdict == "valid":
                    put(i, step_bonus)
                elif s.verdict == "invalid":
                    put(i, penalty)
    return out


# ------------------------------------------------------------------------- token alignment
def char_to_token_index(text: str, char_pos: int, tokenizer: Any,
                        ids: Sequence[int] | None = None) -> int:
    """Index of the token of ``ids`` (default ``tokenizer.encode(text)``) containing ``char_pos``.

    Uses prefix decodes (``len(decode(ids[:k]))``, binary search), so it works for any tokenizer
    with ``decode``, including byte-level BPE where tokens and characters do not align. A position
    past the end maps to the last token. ``text`` should be ``decode(ids)``.
    """
    if ids is None:
        ids = tokenizer.encode(text)
    ids = list(ids)
    if not ids:
        raise ValueError("no tokens")
    lo, hi = 1, len(ids)  # smallest k with len(decode(ids[:k])) > char_pos
    if len(tokenizer.decode(ids)) <= char_pos:
        return len(ids) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid])) > char_pos:
            hi = mid
        else:
            lo = mid + 1
    return lo - 1


def step_token_ends(report: StepReport, text: str, tokenizer: Any,
                    ids: Sequence[int] | None = None) -> list[int]:
    """For every step of ``report`` (from ``verify_solution(text)``), the index of the token that
    holds its last character -- the ``token_ends`` row ``process_rewards`` expects."""
    if ids is None:
        ids = tokenizer.encode(text)
    return [char_to_token_index(text, max(s.char_end - 1, 0), tokenizer, ids)
            for s in report.steps]
