"""Benchmark eval: a policy scored on a benchmark's test split with the protocol papers report.

A benchmark is a named test set (``gsm8k``, ``math500``, ``aime24``: a Hub dataset, its
config, split and row format) or any source ``data.source`` accepts (a ``.jsonl`` /
``.parquet`` file, a dataset folder, a Hub dataset id) with its row format. Rows are read by
``data.sources.read_source`` and the row formats of ``data.formats``, prompts built by the
one prompt builder (``data.prompts``, with the model's chat template), answers graded by
the training grader (``rewards.grader``, the format's answer extractor): what RL optimised
is what is measured, before and after it.

The protocol: one greedy answer per question (accuracy, with its binomial standard error),
and ``n`` sampled answers per question (avg@n and the unbiased pass@k for k = 1, 2, 4, ...,
n, with standard errors over questions), all through ``eval.metrics.score`` (the held-out
eval's metrics); answers the grader could not find are counted apart from wrong ones. The
report keeps every question's greedy answer and verdicts, so two checkpoints compare
question by question.
"""

from __future__ import annotations

import json
import math
import typing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from tppo_jax.config_checks import ConfigError
from tppo_jax.data.formats import Format, MathExample
from tppo_jax.eval.diagnose import why_not_graded
from tppo_jax.eval.heldout import EvalEngines, GradedSamples, decode_and_grade
from tppo_jax.eval.metrics import score
from tppo_jax.eval.protocol import EvalProtocol
from tppo_jax.parallel import multihost as mh
from tppo_jax.rewards.grader import MathGrader
from tppo_jax.rewards.grading import extract_answer

FORMATS: tuple[str, ...] = typing.get_args(Format)


@dataclass(frozen=True)
class Benchmark:
    """Where a benchmark's questions come from; ``fields``: row keys that differ from the
    format's defaults (``data.fields``)."""

    name: str
    source: str
    format: str
    split: str = "test"
    hf_config: str | None = None
    hf_revision: str | None = None
    fields: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        """``openai/gsm8k (main, test)`` / ``aime.jsonl``: how tables and logs name it."""
        if Path(self.source).is_file():
            return self.source
        inner = ", ".join(x for x in (self.hf_config, self.split) if x)
        return f"{self.source} ({inner})"


BENCHMARKS: dict[str, Benchmark] = {
    "gsm8k": Benchmark("gsm8k", "openai/gsm8k", "gsm8k", "test", "main"),
    "math500": Benchmark("math500", "HuggingFaceH4/MATH-500", "math", "test"),
    # 30 problems of AIME 2024 I and II; the dataset's only split is "train".
    "aime24": Benchmark("aime24", "HuggingFaceH4/aime_2024", "math", "train",
                        fields=(("id", "id"),)),
}


def resolve_benchmark(name: str, fmt: str | None = None, split: str | None = None
                      ) -> Benchmark:
    """The benchmark ``name`` means: a named one (``BENCHMARKS``), else a local file or
    folder, else a Hub dataset id; ``fmt`` / ``split`` override its row format / split.
    One ``ConfigError`` line for an unknown name, a missing file or an unknown format."""
    from tppo_jax.data.sources import KNOWN_FORMATS, is_hub_id

    named = BENCHMARKS.get(name.lower())
    if named is not None:
        return replace(named, format=fmt or named.format, split=split or named.split)
    path = Path(name)
    if not path.exists() and not is_hub_id(name):
        kind = "no such file" if path.suffix or "/" in name else "no such benchmark"
        raise ConfigError(f"--benchmark {name}: {kind} (named benchmarks: "
                          f"{', '.join(BENCHMARKS)}; or a .jsonl / .parquet file, a dataset "
                          f"folder, a Hub dataset id owner/name)")
    fmt = fmt or KNOWN_FORMATS.get(name.lower())
    if fmt is None:
        raise ConfigError(f"--benchmark {name}: give its row format with --format (one of "
                          f"{', '.join(FORMATS)}; AIME-style problem/answer rows are math)")
    label = path.stem if path.exists() else name.rsplit("/", 1)[-1]
    return Benchmark(label, name, fmt, split or "test")


def load_questions(bench: Benchmark, limit: int | None = None) -> list[MathExample]:
    """The benchmark's questions in file order (the first ``limit``). A bad row is an
    error, never skipped: a benchmark is scored on all of its questions."""
    from tppo_jax.data.sources import read_source

    rows, _ = read_source(bench.source, format=bench.format,  # type: ignore[arg-type]
                          fields=dict(bench.fields) or None, on_bad_row="error",
                          split=bench.split, hf_config=bench.hf_config,
                          hf_revision=bench.hf_revision, limit=limit)
    if not rows:
        raise ConfigError(f"--benchmark {bench.name}: {bench.describe()} has no questions")
    return rows


def run_benchmark(model: Any, tok: Any, rows: list[MathExample],
                  encode: typing.Callable[[MathExample], list[int]], grader: MathGrader,
                  answer_format: str, protocol: EvalProtocol, batch_size: int = 64
                  ) -> dict[str, Any]:
    """Greedy and ``protocol``'s sampled answers to every question (``batch_size`` decode
    slots), graded; returns ``{"metrics", "per_question", "max_prompt_tokens"}`` (see
    :func:`benchmark_metrics`). The prompt window is the longest prompt: no question is
    cut."""
    cache = {e: encode(e) for e in rows}
    kw = dict(max_prompt_len=max(len(ids) for ids in cache.values()),
              max_response_len=protocol.max_tokens, engines=EvalEngines(),
              batch_size=batch_size, check_steps=False)
    greedy = decode_and_grade(model, tok, rows, cache.__getitem__, grader, k=1, **kw)
    sampled = None
    if protocol.samples > 0:
        sampled = decode_and_grade(model, tok, rows, cache.__getitem__, grader,
                                   k=protocol.samples, sampling=protocol.sampling,
                                   seed=protocol.seed, **kw)
    g, s = _ordered(greedy, answer_format), _ordered(sampled, answer_format)
    return {"metrics": benchmark_metrics(g, s, protocol.max_tokens),
            "per_question": per_question(rows, g, s, answer_format),
            "max_prompt_tokens": kw["max_prompt_len"]}


@dataclass(frozen=True)
class _Ordered:
    """One pass's results in question order; ``answers``: the extracted answer of every
    sample (None: none found), ``[N][k]``; ``texts``: every completion, ``[N][k]``."""

    correct: np.ndarray
    reasons: np.ndarray
    lengths: np.ndarray
    answers: list[list[str | None]]
    texts: list[list[str]]


def _ordered(g: GradedSamples | None, answer_format: str) -> _Ordered | None:
    """``g`` sorted back into question order, with every host's extracted answers."""
    if g is None:
        return None
    k = g.correct.shape[1]
    mine = [extract_answer(t, answer_format=answer_format) for t in g.texts]
    flat = [a for part in mh.gather_json(mine) for a in part]
    texts = [t for part in mh.gather_json(list(g.texts)) for t in part]
    order = np.argsort(g.index, kind="stable").tolist()
    return _Ordered(g.correct[order], g.reasons[order], g.lengths.reshape(-1, k)[order],
                    [flat[i * k:(i + 1) * k] for i in order],
                    [texts[i * k:(i + 1) * k] for i in order])


def benchmark_metrics(greedy: _Ordered, sampled: _Ordered | None,
                      max_tokens: int) -> dict[str, float | None]:
    """Percent metrics: ``greedy_accuracy`` (+ ``_se``, ``greedy_no_answer``,
    ``greedy_wrong``, ``greedy_grade_error``); with samples ``avg@n``, ``pass@k`` (+
    ``_se``), ``no_answer``, ``wrong``, ``grade_error`` over all samples; the mean response
    length and the share of responses that ran to ``max_tokens`` (cut off, likely unanswered)
    for each. nan (fewer than 2 questions) is written as None."""
    g = score(greedy.correct, ks=(), reasons=greedy.reasons)
    out: dict[str, float] = {
        "greedy_accuracy": g["avg@1"], "greedy_accuracy_se": g["avg@1_se"],
        **{f"greedy_{key}": g[key] for key in ("no_answer", "wrong", "grade_error")},
        "greedy_response_len_mean": float(greedy.lengths.mean()),
        "greedy_at_max_tokens": float(100.0 * (greedy.lengths >= max_tokens).mean()),
    }
    if sampled is not None:
        out.update(score(sampled.correct, reasons=sampled.reasons))
        out["response_len_mean"] = float(sampled.lengths.mean())
        out["at_max_tokens"] = float(100.0 * (sampled.lengths >= max_tokens).mean())
    return {key: None if math.isnan(v) else v for key, v in out.items()}


def per_question(rows: list[MathExample], greedy: _Ordered, sampled: _Ordered | None,
                 answer_format: str = "boxed") -> list[dict[str, Any]]:
    """One entry per question, in benchmark order: its id, the gold answer, the greedy
    completion, the answer found in it (None: no answer), its verdict, grader reason and
    (when it was not graded) why; with samples each sample's verdict, reason, answer and
    completion."""
    out = []
    for i, e in enumerate(rows):
        reason = str(greedy.reasons[i, 0])
        q: dict[str, Any] = {
            "index": i, "id": e.id, "answer": e.answer,
            "greedy_answer": greedy.answers[i][0], "greedy_correct": bool(greedy.correct[i, 0]),
            "greedy_reason": reason, "greedy_why": why_not_graded(reason, answer_format),
            "greedy_completion": greedy.texts[i][0]}
        if sampled is not None:
            q.update(correct=[bool(c) for c in sampled.correct[i]],
                     reasons=[str(r) for r in sampled.reasons[i]],
                     sample_answers=sampled.answers[i], sample_completions=sampled.texts[i])
        out.append(q)
    return out


def format_table(report: dict[str, Any]) -> str:
    """The few numbers a reader looks for, as a small aligned table (percent, +- one
    standard error)."""
    m, n = report["metrics"], report["protocol"]["samples"]
    lines = [f"{report['benchmark']['name']}: {report['benchmark']['described']}, "
             f"{report['questions']} questions; {report['model']['description']}",
             f"{'metric':<22}{'%':>8}{'± se':>8}"]

    def row(label: str, key: str, se: bool = True) -> None:
        v, e = m.get(key), m.get(f"{key}_se") if se else None
        shown = "-" if v is None else f"{v:.2f}"
        lines.append(f"{label:<22}{shown:>8}{'' if e is None else f'{e:.2f}':>8}")

    row("greedy accuracy", "greedy_accuracy")
    row("greedy no answer", "greedy_no_answer", se=False)
    row("greedy wrong", "greedy_wrong", se=False)
    if n:
        row(f"avg@{n}", f"avg@{n}")
        for key in (k for k in m if k.startswith("pass@") and not k.endswith("_se")):
            row(key, key)
        row(f"no answer (of {n})", "no_answer", se=False)
        row(f"wrong (of {n})", "wrong", se=False)
    row("greedy at max tokens", "greedy_at_max_tokens", se=False)
    return "\n".join(lines)


def build_report(bench: Benchmark, model: dict[str, Any], protocol: EvalProtocol,
                 answer_format: str, prompt: dict[str, Any], limit: int | None,
                 result: dict[str, Any]) -> dict[str, Any]:
    """The JSON ``tppo eval --benchmark`` writes: what was evaluated, how, the metrics, and
    the per-question results."""
    return {
        "benchmark": {"name": bench.name, "source": bench.source, "config": bench.hf_config,
                      "split": None if Path(bench.source).is_file() else bench.split,
                      "revision": bench.hf_revision,
                      "format": bench.format, "described": bench.describe()},
        "model": model,
        "protocol": {**protocol.to_dict(), "max_prompt_tokens": result["max_prompt_tokens"],
                     "answer_format": answer_format, "prompt": prompt, "limit": limit},
        "questions": len(result["per_question"]),
        "metrics": result["metrics"],
        "per_question": result["per_question"],
    }


def report_json(report: dict[str, Any]) -> str:
    """``report`` as JSON text, one line per question: a large benchmark's file stays
    readable, and two checkpoints' files diff question by question."""
    head = {key: v for key, v in report.items() if key != "per_question"}
    rows = ",\n".join(f"  {json.dumps(q)}" for q in report["per_question"])
    return f'{json.dumps(head, indent=1)[:-2]},\n "per_question": [\n{rows}\n ]\n}}\n'
