"""``tppo bench NAME ...``: the benchmarks shipped as ``tppo_jax.benchmarks``."""

from __future__ import annotations

import argparse
from collections.abc import Callable

BENCHMARKS = {"tppo-vs-ppo": "tppo_vs_ppo", "decode": "decode", "intensity": "intensity",
              "accelerator": "accelerator", "cost-model": "cost_model",
              "compiled-units": "compiled_units", "page-replay": "page_replay",
              "prefill-width": "prefill_width", "learning": "learning",
              "lora-export": "lora_export"}


def _available_benchmarks() -> list[str]:
    import importlib.util

    return sorted(n for n, m in BENCHMARKS.items()
                  if importlib.util.find_spec(f"tppo_jax.benchmarks.{m}") is not None)


def _bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=_available_benchmarks(), help="which benchmark")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own arguments")


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    mod = importlib.import_module(f"tppo_jax.benchmarks.{BENCHMARKS[args.name]}")
    parser = argparse.ArgumentParser(prog=f"tppo bench {args.name}", description=mod.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mod.add_args(parser)
    mod.run(parser.parse_args(args.args))
    return 0


def register(register_fn: Callable) -> None:
    register_fn("bench", f"benchmarks: {' | '.join(_available_benchmarks())}", _bench_args,
                cmd_bench)
