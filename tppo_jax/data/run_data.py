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
        held_out = _read(cfg, d.eval_source)[:d.eval_size]
        if not held_out:
            raise ConfigError(f"data.eval_source {d.eval_source} has no rows"
                              f"{' (every row was bad and skipped)' * (d.on_bad_row == 'skip')}"
                              f": give a held-out file with rows, or leave data.eval_source "
                              f"empty to hold out the last data.eval_size rows of data.source")
        return disjoint(rows, held_out)
    if len(rows) <= d.eval_size:
        raise ConfigError(
            f"data.source {d.source} has {len(rows)} rows; the last data.eval_size="
            f"{d.eval_size} are held out, so it needs more: set data.eval_size="
            f"{max(1, len(rows) // 5)} (a smaller held-out set) or data.eval_source=FILE "
            f"(a separate held-out file)")
    return disjoint(rows[:-d.eval_size], rows[-d.eval_size:])


def _read(cfg: Config, source: str) -> list[MathExample]:
    """The rows of ``source`` read as ``cfg.data`` says (format, fields, bad-row policy)."""
    d = cfg.data
    rows, report = read_source(source, format=d.format, fields=d.fields or None,
                               on_bad_row=d.on_bad_row, split=d.split, hf_config=d.hf_config,
                               hf_revision=d.hf_revision)
    if report.num_bad:
        log.warning("data: skipped %d bad rows of %s", report.num_bad, source)
    return rows


def disjoint(train: list[MathExample], held_out: list[MathExample]
             ) -> tuple[list[MathExample], list[MathExample]]:
    """``(train, held_out)`` with every training row whose question is also a held-out
    question dropped (counted in a warning): a held-out score on questions the run trained
    on measures memory, not reasoning."""
    seen = {" ".join(e.question.split()) for e in held_out}
    kept = [e for e in train if " ".join(e.question.split()) not in seen]
    if len(kept) < len(train):
        log.warning("data: dropped %d training rows whose question is also held out",
                    len(train) - len(kept))
    if not kept:
        raise ConfigError("data: every training row's question is also held out")
    return kept, held_out


def prompt_rows(cfg: Config, tok: Tokenizer,
                rows: tuple[list[MathExample], list[MathExample]] | None = None
                ) -> tuple[list[MathExample], list[MathExample], Callable]:
    """(train rows, held-out rows, prompt encoder), rows whose prompt does not fit dropped;
    ``rows``: ``load_data(cfg)`` when the caller read it already."""
    r = cfg.rollout
    train_rows, eval_rows = rows if rows is not None else load_data(cfg)
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
    eval_fits = [e for e in eval_rows if len(encode(e)) <= r.max_prompt_len]
    if len(eval_fits) < len(eval_rows):
        log.warning("data: dropped %d of %d held-out prompts longer than "
                    "rollout.max_prompt_len=%d", len(eval_rows) - len(eval_fits),
                    len(eval_rows), r.max_prompt_len)
    if not eval_fits:
        raise ConfigError(f"every held-out prompt is longer than rollout.max_prompt_len="
                          f"{r.max_prompt_len} tokens")
    eval_rows = eval_fits
    return fits, eval_rows, encode
