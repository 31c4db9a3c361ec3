"""``tppo eval --benchmark NAME_OR_SOURCE MODEL``: a run's checkpoint, an HF folder or a Hub
model id scored on a benchmark's test split (``eval/benchmark.py`` has the protocol).

``tppo eval`` (``cli/runs.py``) adds these options with ``add_benchmark_args`` and hands
over to ``cmd_benchmark`` when ``--benchmark`` is given; without it, the options that only
the benchmark eval reads are refused rather than ignored. Everything this module imports
beyond argparse is imported inside the command, so ``tppo --help`` stays fast."""

from __future__ import annotations

import argparse
import sys
import typing
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tppo_jax.cli.args import non_negative_int, positive_int
from tppo_jax.config_checks import ConfigError
from tppo_jax.data.formats import Format

if TYPE_CHECKING:
    from tppo_jax.config import Config
    from tppo_jax.eval.benchmark import Benchmark
    from tppo_jax.weights.restore import LoadedPolicy

# The options only the benchmark eval reads (dest names), each None unless given.
BENCHMARK_ONLY = ("format", "split", "limit", "max_tokens", "batch_size", "seed", "config")
DEFAULT_BATCH = 64
RESULTS_DIR = Path("results-eval")  # where a model that is no run directory's results go
AT_MAX_WARN = 10.0  # percent of greedy answers cut at --max-tokens worth a warning


def add_benchmark_args(p: argparse.ArgumentParser) -> None:
    """``--benchmark`` and the options of the benchmark eval."""
    g = p.add_argument_group("benchmark eval", "score MODEL (a run directory, an HF folder or "
                             "a Hub model id) on a benchmark's test split: greedy accuracy, "
                             "avg@k and unbiased pass@k over -k samples (--greedy: the "
                             "greedy answers only); --out defaults to RUN/bench_<name>_<step>"
                             ".json or results-eval/<model>/<name>.json (docs/eval.md)")
    g.add_argument("--benchmark", default=None, metavar="NAME_OR_SOURCE",
                   help="gsm8k, math500, aime24, or a .jsonl / .parquet file, dataset folder "
                   "or Hub dataset id (then --format)")
    g.add_argument("--format", choices=typing.get_args(Format), default=None,
                   help="row format of a benchmark file or Hub id (AIME-style problem/answer: "
                   "math)")
    g.add_argument("--split", default=None, help="split of a Hub dataset (default: test)")
    g.add_argument("--limit", type=positive_int, default=None, metavar="N",
                   help="the first N questions only (a quick look)")
    g.add_argument("--max-tokens", type=positive_int, default=None,
                   help="response length (default: the config's rollout.max_response_len)")
    g.add_argument("--batch-size", type=positive_int, default=None,
                   help=f"decode slots (default {DEFAULT_BATCH})")
    g.add_argument("--seed", type=non_negative_int, default=None, help="sampling seed (0)")
    g.add_argument("--config", default=None,
                   help="for an HF folder / Hub id: the config whose prompt and reward "
                   "settings apply (default: the embedded default)")


def refuse_benchmark_options(args: argparse.Namespace) -> None:
    """A held-out eval given options only ``--benchmark`` reads: one line, not silence."""
    given = [f"--{d.replace('_', '-')}" for d in BENCHMARK_ONLY if getattr(args, d) is not None]
    if given:
        raise ConfigError(f"{', '.join(given)}: only with --benchmark (the held-out eval "
                          f"reads the run's own config)")


def cmd_benchmark(args: argparse.Namespace) -> int:
    """Reads the benchmark and the model (cheap checks first), runs the protocol, prints
    the table and writes the JSON report."""
    from tppo_jax.eval.benchmark import load_questions, resolve_benchmark
    from tppo_jax.weights.named import policy_from_name, resolve_policy_path
    from tppo_jax.weights.restore import is_run_dir

    fmt = args.format
    if fmt is None and Path(args.benchmark).is_file():
        fmt = infer_format(Path(args.benchmark))
        if fmt is not None:
            print(f"--benchmark {args.benchmark}: rows read as --format {fmt} (their fields "
                  f"say so; --format overrides)", file=sys.stderr)
    bench = resolve_benchmark(args.benchmark, fmt, args.split)
    path = resolve_policy_path(args.run_dir, "model")
    base = None
    if is_run_dir(path):
        if args.config is not None:
            raise ConfigError(f"--config: {args.run_dir} is a run directory; it is evaluated "
                              f"with its own config.yaml")
    else:
        from tppo_jax.config import load_config

        base = load_config(args.config)
    rows = load_questions(bench, args.limit)
    print(f"{bench.name}: {len(rows)} questions from {bench.describe()}", file=sys.stderr)
    policy = policy_from_name(str(path), dtype=base.model.dtype if base else "float32",
                              step=args.step, flag="model")
    policy = replace(policy, ref=args.run_dir)  # a Hub id as written, not its cache path
    cfg = _benchmark_config(policy, base, bench)
    report = _evaluate(args, bench, rows, policy, cfg)
    from tppo_jax.eval.benchmark import format_table, report_json
    from tppo_jax.eval.diagnose import no_answer_warning, protocol_tag

    tag = protocol_tag(report["protocol"], greedy=args.greedy)
    out = Path(args.out) if args.out else default_out(policy, bench, args.limit, tag)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report_json(report))
    if args.show:
        from tppo_jax.data.prompts import prompt_builder

        prompts = prompt_builder(cfg, policy.tokenizer)
        show_questions(report, [prompts.text(e) for e in rows[:args.show]])
    print(format_table(report))
    m = report["metrics"]
    at_max = m["greedy_at_max_tokens"]
    if at_max is not None and at_max > AT_MAX_WARN:
        print(f"warning: {at_max:.0f}% of greedy answers ran to --max-tokens "
              f"{report['protocol']['max_tokens']} (cut off); raise it", file=sys.stderr)
    if warn := no_answer_warning(m["greedy_no_answer"], report["protocol"]["answer_format"]):
        print(warn, file=sys.stderr)
    print(f"wrote {out}")
    return 0


def show_questions(report: dict[str, Any], prompts: list[str]) -> None:
    """Prints the first ``len(prompts)`` questions' prompt, greedy completion, the answer
    found and its grade, with why it was not graded (``--show N``)."""
    for q, prompt in zip(report["per_question"], prompts, strict=False):
        why = f" ({q['greedy_why']})" if q.get("greedy_why") else ""
        print(f"=== question {q['index']} ({q['id']})\n{prompt}"
              f"\n--- greedy completion\n{q['greedy_completion']}\n--- found "
              f"{q['greedy_answer']!r}, gold {q['answer']!r}: {q['greedy_reason']}{why}\n")


def infer_format(path: Path, rows: int = 20) -> str | None:
    """The row format (``data.formats``) a benchmark file's first ``rows`` rows name without
    doubt, from the fields every one of them has; None when they fit none or several (then
    ``--format`` is needed). ``question`` + ``answer`` is ``gsm8k`` when every answer ends in a
    ``#### N`` line, ``generic`` (or ``asdiv`` with its ``body`` / ``formula``) when none does."""
    head = _first_rows(path, rows)
    if not head or not all(isinstance(r, dict) for r in head):
        return None
    keys = set.intersection(*(set(r) for r in head))
    if {"prompt", "reward_model"} <= keys:
        return "dapo"
    if {"Problem", "Rationale", "options", "correct"} <= keys:
        return "mathqa"
    if {"Body", "Question", "Answer"} <= keys:
        return "svamp"
    if "problem" in keys and keys & {"answer", "solution"}:
        return "math"
    if {"question", "answer"} <= keys:
        hashes = [isinstance(r["answer"], str) and "####" in r["answer"] for r in head]
        if all(hashes):
            return "gsm8k"
        if not any(hashes):
            return "asdiv" if keys & {"body", "formula"} else "generic"
    return None


def _first_rows(path: Path, n: int) -> list[Any]:
    """Up to ``n`` rows of a ``.jsonl`` / ``.json`` / ``.ndjson`` / ``.parquet`` file ([] when
    it is none of these or they do not read: the full read reports why)."""
    import json

    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return next(pq.ParquetFile(path).iter_batches(batch_size=n)).to_pylist()
        if path.suffix not in (".jsonl", ".json", ".ndjson"):
            return []
        out = []
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    out.append(json.loads(line))
                if len(out) == n:
                    break
        return out
    except (OSError, ValueError, StopIteration, ImportError):
        return []


def _benchmark_config(policy: LoadedPolicy, base: Config | None, bench: Benchmark) -> Config:
    """The config prompts and grading are built from: the run's own (a run directory) or
    ``--config`` with this HF model; its data section naming the benchmark, so the prompt
    template and the answer format (``reward.answer_format: auto``) follow its row format."""
    cfg = policy.cfg
    if cfg is None:
        assert base is not None
        cfg = replace(base, model=replace(base.model, source="hf", path=policy.ref))
    data = replace(cfg.data, source=bench.source, format=bench.format, split=bench.split,
                   hf_config=bench.hf_config, hf_revision=bench.hf_revision,
                   fields=dict(bench.fields))
    return replace(cfg, data=data)


def _evaluate(args: argparse.Namespace, bench: Benchmark, rows: list, policy: LoadedPolicy,
              cfg: Config) -> dict[str, Any]:
    """Runs the protocol with the training prompt builder and grader; the report dict."""
    from tppo_jax.data.prompts import prompt_builder
    from tppo_jax.eval.benchmark import build_report, run_benchmark
    from tppo_jax.eval.protocol import protocol_named
    from tppo_jax.rewards.grader import MathGrader, answer_format_for

    tok = policy.tokenizer
    prompts = prompt_builder(cfg, tok)
    answer_format = answer_format_for(bench.format, cfg.reward.answer_format)
    protocol = protocol_named(args.protocol or "paper", cfg).overridden(
        samples=0 if args.greedy else args.k, temperature=args.temperature, top_p=args.top_p,
        max_tokens=args.max_tokens, seed=args.seed)
    with MathGrader.from_config(cfg.reward, cfg.data.format) as grader:
        result = run_benchmark(policy.model, tok, rows, lambda e: prompts.ids(e, tok), grader,
                               answer_format, protocol, args.batch_size or DEFAULT_BATCH)
    style = ("short (tiny model)" if prompts.short else
             "chat template" if prompts.chat_template is not None else "plain")
    prompt = {"style": style, "user_template": prompts.template,
              "system_prompt": prompts.system_prompt}
    model = {"ref": policy.ref, "description": policy.description, "step": policy.step}
    return build_report(bench, model, protocol, answer_format, prompt, args.limit, result)


def default_out(policy: LoadedPolicy, bench: Benchmark, limit: int | None,
                tag: str = "greedy") -> Path:
    """``RUN/bench_<name>_<step>_<tag>.json`` for a run's checkpoint, else
    ``results-eval/<model>/<name>_<tag>.json`` (a Hub id's ``/`` as ``--``); ``tag`` names
    the protocol (``eval.diagnose.protocol_tag``) and a ``--limit`` look gets its own file,
    so no eval overwrites one drawn differently."""
    name = bench.name + (f"-limit{limit}" if limit else "")
    if policy.cfg is not None:
        return Path(policy.ref) / f"bench_{name}_{policy.step}_{tag}.json"
    local = Path(policy.ref)
    model = local.resolve().name if local.is_dir() else policy.ref.replace("/", "--")
    return RESULTS_DIR / model / f"{name}_{tag}.json"
