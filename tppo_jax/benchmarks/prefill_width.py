"""Rollout time per step with the prefill over the columns it needs vs over the whole buffer.

Before this change the scheduler prefilled new prompts (and, with ``reprefill``, every
continuation) over the full ``[B, P + L]`` token buffer, a forward pass as wide as the longest
possible row, once per window. Now it runs over the width bucket of the longest prefilled row
(``HostSlots._prefill_rows``, the scheduler's). Both are run here on the same scheduler, weights,
prompts and seed, T-PPO (``l``) and PPO (``l = L``), interleaved, ``--steps`` timed windows each
after ``--warmup`` untimed ones (their compiles); the sampled tokens of the two modes must be
identical (the trimmed prefill is exact). Writes ``results/prefill_width.json``.

    tppo bench prefill-width --config longtail --steps 20
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import time
from pathlib import Path

import numpy as np


def make_scheduler(cfg, tok, model, examples, encode, window: int, full_width: bool = False):
    from tppo_jax.rollout.decode import SamplingParams
    from tppo_jax.rollout.scheduler import TruncatedRolloutScheduler

    class FullWidth(TruncatedRolloutScheduler):
        """The old prefill: every column of the buffer."""

        def _prefill_rows(self, rows):
            st = self.state
            return self.engine.prefill_slots(self.params, self.ds, self._put(st.tokens),
                                             self._put(st.total_len), self._put(rows))

    r = dataclasses.replace(cfg.rollout, window=window, kv_cache="dense")
    cls = FullWidth if full_width else TruncatedRolloutScheduler
    return cls(model, itertools.cycle(examples), encode, r, eos_ids=tok.eos_ids,
               sampling=SamplingParams(temperature=r.temperature), seed=0)


def _time(sched, warmup: int, steps: int) -> tuple[list[float], list[np.ndarray]]:
    times, tokens = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        rb = sched.step()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
        tokens.append(rb.tokens.copy())
        sched.release_finished(rb.finished)
    return times, tokens


def warm_started(args: argparse.Namespace):
    """``(cfg, tokenizer, policy, prompt rows, prompt encoder)`` for ``args.config``: the
    cached warm-start under ``args.out``'s ``runs/`` (as tppo-vs-ppo), the trainer's rows."""
    from tppo_jax.config import load_config
    from tppo_jax.data.run_data import prompt_rows
    from tppo_jax.weights.warmstart import warmstart

    cfg = load_config(args.config, args.overrides)
    stem = Path(args.config).stem
    runs = Path(args.out) / "runs" / ("" if stem == "default" else stem)
    tok, model, _ = warmstart(cfg, runs, progress=not args.no_progress)
    examples, _, encode = prompt_rows(cfg, tok)
    return cfg, tok, model, examples, encode


def write_result(out: dict, results_dir: str, name: str) -> dict:
    """Writes ``out`` to ``results_dir/name`` (JSON) and returns it."""
    path = Path(results_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    return out


def run(args: argparse.Namespace) -> dict:
    cfg, tok, model, examples, encode = warm_started(args)
    L = cfg.rollout.max_response_len
    out: dict = {"config": args.config, "slots": cfg.rollout.slots, "L": L,
                 "buffer": cfg.rollout.max_prompt_len + L, "steps": args.steps, "methods": {}}
    for name, window in (("tppo", cfg.rollout.window), ("ppo", L)):
        res, toks = {}, {}
        for mode in ("full_width", "bucketed"):
            sched = make_scheduler(cfg, tok, model, examples, encode, window, mode == "full_width")
            times, toks[mode] = _time(sched, args.warmup, args.steps)
            res[mode] = {"rollout_s_median": statistics.median(times),
                         "rollout_s_total": sum(times)}
        same = all(np.array_equal(a, b) for a, b in zip(toks["full_width"], toks["bucketed"],
                                                         strict=True))
        res["speedup"] = res["full_width"]["rollout_s_total"] / res["bucketed"]["rollout_s_total"]
        res["identical_tokens"] = bool(same)
        out["methods"][name] = res
        print(f"{name}: rollout {res['full_width']['rollout_s_median']:.3f} s/step (full width) "
              f"-> {res['bucketed']['rollout_s_median']:.3f} s/step (bucketed), "
              f"{res['speedup']:.2f}x; identical tokens: {same}")
    return write_result(out, args.out, "prefill_width.json")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="longtail")
    p.add_argument("--steps", type=int, default=20, help="timed windows per mode")
    p.add_argument("--warmup", type=int, default=3, help="untimed windows first (compiles)")
    p.add_argument("--out", default="results",
                   help="results dir; the warm-start cache is read from (or built in) its runs/")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("overrides", nargs="*", metavar="key=value")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_args(parser)
    run(parser.parse_args())
