"""A run's rows: its train and held-out split from the ``data`` section, and the prompts it
trains on. The one place the trainer, ``tppo eval`` and the benchmarks get them from, so an
eval sees exactly the rows and prompts training did."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from tppo_jax.config import Config, ConfigError
from tppo_jax.data.prompts import prompt_builder
from tppo_jax.data.readers import MathExample
from tppo_jax.data.sources import read_source
from tppo_jax.data.synthetic import SyntheticMathTask

if TYPE_CHECKING:
    from tppo_jax.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def synthetic_task(cfg: Config) -> SyntheticMathTask:
    """The embedded task as configured in ``cfg.data``."""
    d = cfg.data
    return SyntheticMathTask(seed=d.seed, difficulty=d.difficulty, max_operand=d.max_operand,
                             max_value=d.max_value, max_steps=d.max_steps, style=d.style)


def load_data(cfg: Config) -> tuple[list[MathExample], list[MathExample]]:
    """(train, held-out) rows; prompts are built from them by ``data/prompts.py``."""
    d = cfg.data
    if d.source == "synthetic":
        task = synthetic_task(cfg)
        return task.sample(20000, "train"), task.sample(d.eval_size, "test")
    rows = _read(cfg, d.source)
    if d.eval_source:  # a separate held-out file: every source row trains
        return rows, _read(cfg, d.eval_source)[:d.eval_size]
    if len(rows) <= d.eval_size:
        raise ConfigError(
            f"data.source {d.source} has {len(rows)} rows; the last data.eval_size="
            f"{d.eval_size} are held out, so it needs more: set data.eval_size="
            f"{max(1, len(rows) // 5)} (a smaller held-out set) or data.eval_source=FILE "
            f"(a separate held-out file)")
    return rows[:-d.eval_size], rows[-d.eval_size:]


def _read(cfg: Config, source: str) -> list[MathExample]:
    """The rows of ``source`` read as ``cfg.data`` says (format, fields, bad-row policy)."""
    d = cfg.data
    rows, report = read_source(source, format=d.format, fields=d.fields or None,
                               on_bad_row=d.on_bad_row, split=d.split, hf_config=d.hf_config,
                               hf_revision=d.hf_revision)
    if report.num_bad:
        log.warning("data: skipped %d bad rows of %s", report.num_bad, source)
    return rows


def prompt_rows(cfg: Config, tok: Tokenizer
                ) -> tuple[list[MathExample], list[MathExample], Callable]:
    """(train rows, held-out rows, prompt encoder), rows whose prompt does not fit dropped."""
    r = cfg.rollout
    train_rows, eval_rows = load_data(cfg)
    prompter = prompt_builder(cfg, tok)
    encode = lambda e: prompter.ids(e, tok)  # noqa: E731
    # A truncated prompt loses its question, so over-long prompts are skipped, not cut.
    fits = [e for e in train_rows if len(encode(e)) <= r.max_prompt_len]
    if len(fits) < len(train_rows):
        log.warning("data: skipped %d of %d prompts longer than rollout.max_prompt_len=%d",
                    len(train_rows) - len(fits), len(train_rows), r.max_prompt_len)
    if not fits:
        raise ConfigError(f"every prompt is longer than rollout.max_prompt_len="
                          f"{r.max_prompt_len} tokens")
    eval_rows = [e for e in eval_rows if len(encode(e)) <= r.max_prompt_len] or eval_rows
    return fits, eval_rows, encode
