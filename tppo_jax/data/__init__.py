"""Data layer: dataset readers, the synthetic default task, and the grain prompt pipeline."""

from __future__ import annotations

from typing import Any

from tppo_jax.data.readers import (
    BadRowReport,
    DataError,
    MathExample,
    last_boxed,
    read_examples,
)
from tppo_jax.data.synthetic import (
    SyntheticMathTask,
    TeacherRecord,
    length_histogram,
    length_stats,
)

__all__ = [
    "BadRowReport",
    "DataError",
    "MathExample",
    "PromptPipeline",
    "SyntheticMathTask",
    "TeacherRecord",
    "default_shard",
    "last_boxed",
    "length_histogram",
    "length_stats",
    "read_examples",
]


def __getattr__(name: str) -> Any:
    # The pipeline pulls in grain (~1 s to import); grading worker processes import
    # `tppo_jax.data.readers` and must not pay for it.
    if name in ("PromptPipeline", "default_shard", "shard_dataset"):
        from tppo_jax.data import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
