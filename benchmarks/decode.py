"""Decode throughput (paged vs dense cache vs no cache) and slot occupancy (truncated vs sync).

Run from the repository root: ``python -m benchmarks.decode`` (or ``tppo bench decode``).
Writes ``results/decode_bench.json`` and prints a markdown table.

Throughput: the tiny model, random prompts of 16 tokens, ``--new-tokens`` (128) sampled at
temperature 1 with EOS disabled, so every row generates the same count. Each path is one
jitted on-device loop, compiled ahead of time (``.lower().compile()``) so compilation is
excluded, then run ``--repeats`` times; the best time is reported.

Occupancy: a simulation with the scheduler's arithmetic (each window decodes until every
slot is done or ``l`` steps; finished slots refill at window boundaries) on response lengths
drawn from a clipped log-normal (long-tailed, like reasoning traces). Occupancy = useful
tokens / (slots x decode steps).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import types
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tppo_jax.models.transformer import ModelConfig, create_model
from tppo_jax.rollout.engine import TPPOEngine
from tppo_jax.rollout.generate import SamplingParams, decode_window, prefill
from tppo_jax.rollout.sampling import sample, slot_keys

PROMPT = 16
NO_EOS = -1


def _best(fn, repeats: int) -> float:
    """Best wall time of ``fn()`` (which must block until its result is ready)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_paged(model, prompts: np.ndarray, new: int, repeats: int) -> tuple[float, int]:
    b = prompts.shape[0]
    tok = types.SimpleNamespace(eos_id=NO_EOS, bos_id=None, pad_id=0, backend="none")
    eng = TPPOEngine(model, tok, max_slots=b, page_size=16, max_target_length=PROMPT + new + 16,
                     max_prefill_length=PROMPT, eos_id=NO_EOS)
    params = eng.load_params()

    def fresh():
        ds = eng.init_decode_state()
        for s in range(b):
            pre = eng.prefill(params=params, padded_tokens=jnp.asarray(prompts[s]),
                              true_length=PROMPT)
            ds = eng.insert(pre, ds, s)
        return jax.block_until_ready(ds)

    compiled = eng._window_fn.lower(fresh(), params, new).compile()
    pages = 0

    def run():
        nonlocal pages
        ds, out = compiled(fresh_state[0], params)
        jax.block_until_ready(out.tokens)
        assert int(out.count.min()) == new
        pages = eng.pages_in_use(ds)

    times = []
    for _ in range(repeats):
        fresh_state = [fresh()]  # prefill/insert is not timed; only the decode window
        times.append(_best(run, 1))
    return b * new / min(times), pages


def bench_dense(model, prompts: np.ndarray, new: int, repeats: int) -> float:
    b = prompts.shape[0]
    s = PROMPT + new
    toks = jnp.zeros((b, s), jnp.int32).at[:, :PROMPT].set(jnp.asarray(prompts))
    total = jnp.full((b,), PROMPT, jnp.int32)
    pre = nnx.jit(prefill)
    dec = nnx.jit(decode_window, static_argnames=("window", "eos_id", "params"))
    args = (jnp.asarray(prompts[:, -1]), total, jnp.full((b,), new, jnp.int32),
            jnp.ones(b, bool), jax.random.key(0), jnp.arange(b, dtype=jnp.uint32), jnp.int32(0))
    kw = dict(window=new, eos_id=NO_EOS, params=SamplingParams())
    cache0 = pre(model, model.init_cache(b, s), toks, total, jnp.ones(b, bool))
    dec(model, cache0, *args, **kw)[0].tokens.block_until_ready()  # compile (nnx.jit has no AOT)

    def run():
        out, _ = dec(model, cache0, *args, **kw)
        assert int(out.count.min()) == new
        out.tokens.block_until_ready()

    return b * new / _best(run, repeats)


def bench_nocache(model, prompts: np.ndarray, new: int, repeats: int) -> float:
    """Full recompute of the whole (static-shape) buffer for every new token."""
    b = prompts.shape[0]
    s = PROMPT + new
    graphdef, state = nnx.split(model)

    @jax.jit
    def gen(state, buf):
        m = nnx.merge(graphdef, state)

        def body(i, buf):
            logits = m(buf)[:, PROMPT - 1 + i]  # causal: padding beyond i does not leak in
            keys = slot_keys(jax.random.key(0), jnp.arange(b), i)
            nxt, _ = sample(logits, keys)
            return buf.at[:, PROMPT + i].set(nxt)

        return jax.lax.fori_loop(0, new, body, buf)

    buf = jnp.zeros((b, s), jnp.int32).at[:, :PROMPT].set(jnp.asarray(prompts))
    compiled = gen.lower(state, buf).compile()
    return b * new / _best(lambda: compiled(state, buf).block_until_ready(), repeats)


def simulate_occupancy(lengths: np.ndarray, slots: int, window: int, max_len: int
                       ) -> dict[str, float]:
    """Slot occupancy of window-``window`` rollout over ``lengths`` (response tokens each):
    the scheduler's arithmetic, ``intensity.schedule_occupancy`` (fed last-first, the order
    this benchmark has always drawn its queue in)."""
    from tppo_jax.benchmarks.intensity import schedule_occupancy

    occ = schedule_occupancy(np.asarray(lengths)[::-1], slots, window, max_len)
    return {"window": window, "decode_steps": occ["slot_steps"] // slots,
            "useful_tokens": occ["useful_tokens"], "occupancy": occ["occupancy"]}


def run(args: argparse.Namespace) -> int:
    batches = [int(x) for x in str(args.batches).split(",")]
    new, repeats = int(args.new_tokens), int(getattr(args, "repeats", 3))
    model = create_model(ModelConfig.tiny(vocab_size=128), seed=0)
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    for b in batches:
        prompts = rng.integers(4, 128, size=(b, PROMPT)).astype(np.int32)
        paged, pages = bench_paged(model, prompts, new, repeats)
        row = {"batch": b, "new_tokens": new, "paged_tok_s": paged,
               "dense_tok_s": bench_dense(model, prompts, new, repeats),
               "nocache_tok_s": bench_nocache(model, prompts, new, repeats),
               "paged_pages_in_use": pages}
        rows.append(row)
        print(f"B={b}: " + ", ".join(f"{k}={v:.0f}" for k, v in row.items()
                                     if k.endswith("tok_s")), file=sys.stderr, flush=True)

    lengths = np.clip(rng.lognormal(np.log(96), 0.9, size=4096), 8, 1024).astype(np.int64)
    occ = {name: simulate_occupancy(lengths, 64, w, 1024)
           for name, w in (("truncated_l32", 32), ("synchronous_lL", 1024))}
    result = {"decode": rows, "occupancy": occ,
              "occupancy_setup": {"slots": 64, "L": 1024, "sequences": len(lengths),
                                  "length_p50": float(np.median(lengths)),
                                  "length_p99": float(np.percentile(lengths, 99))},
              "env": {"backend": jax.default_backend(), "devices": len(jax.devices()),
                      "jax": jax.__version__, "machine": platform.machine(),
                      "note": "tiny model (~0.8M params); compile excluded; best of repeats"}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))

    print("| B | paged tok/s | dense tok/s | no-cache tok/s | paged/dense |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['paged_tok_s']:.0f} | {r['dense_tok_s']:.0f} | "
              f"{r['nocache_tok_s']:.0f} | {r['paged_tok_s'] / r['dense_tok_s']:.2f} |")
    print("\n| rollout (64 slots, L=1024) | decode steps | occupancy |")
    print("|---|---|---|")
    for name, o in occ.items():
        print(f"| {name} | {o['decode_steps']} | {o['occupancy']:.1%} |")
    print(f"\nwrote {out}")
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", default="8,32,64", help="comma-separated batch sizes")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per path (best kept)")
    p.add_argument("--out", default="results/decode_bench.json")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
