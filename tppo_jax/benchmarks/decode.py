"""Decode throughput of what trains (paged vs dense vs no cache, and transformers) and slot
occupancy (truncated vs synchronous).

Run ``tppo bench decode`` (or ``python -m tppo_jax.benchmarks.decode``). Writes
``results/decode_bench.json`` and prints a markdown table.

Throughput: the tiny model, random prompts of 16 tokens, ``--new-tokens`` (128) sampled at
temperature 1 with no EOS, so every row generates the same count. The paged and dense rows
time exactly what the training scheduler runs per window: ``DecodeEngine.generate_window``
(the decode core's jitted loop) after the engine's batched prefill into slots
(``prefill_prompts``), which is not timed. The jit is warmed up first (compile excluded);
best of ``--repeats``. The no-cache row recomputes the whole buffer per token. Where torch +
transformers are importable, the same weights (``save_pretrained``) run
``generate(do_sample=False)`` with the static and the dynamic cache on the CPU (skipped
otherwise).

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
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tppo_jax.models.transformer import ModelConfig, create_model
from tppo_jax.rollout.decode import SamplingParams, sequence_keys
from tppo_jax.rollout.engine import DecodeEngine
from tppo_jax.rollout.sampling import sample

PROMPT = 16


def _best(fn, repeats: int) -> float:
    """Best wall time of ``fn()`` (which must block until its result is ready)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_engine(model, prompts: np.ndarray, new: int, repeats: int, kind: str
                 ) -> tuple[float, int]:
    """Tokens/s of one training window of ``new`` tokens per slot through the engine (the
    scheduler's batched prefill + ``generate_window``); also the KV pages it held."""
    b = prompts.shape[0]
    s = PROMPT + new
    eng = DecodeEngine(model, eos_ids=(), max_slots=b, max_target_length=s, kv_cache=kind,
                       page_size=16, sampling=SamplingParams())
    params = eng.load_params(model)
    tokens = np.zeros((b, s), np.int32)
    tokens[:, :PROMPT] = prompts
    lens = np.full(b, PROMPT, np.int32)

    def fresh() -> Any:
        return jax.block_until_ready(eng.prefill_prompts(params, tokens, lens)[0])

    pages = 0
    times = []
    for i in range(repeats + 1):  # the first call compiles
        ds = fresh()  # prefill is not timed; only the decode window
        t0 = time.perf_counter()
        ds, out = eng.generate_window(ds, params, new)
        jax.block_until_ready(out.tokens)
        if i:
            times.append(time.perf_counter() - t0)
        assert int(out.count.min()) == new
        pages = max(pages, eng.pages_in_use(ds) if kind == "paged" else 0)
    return b * new / min(times), pages


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
            keys = sequence_keys(jax.random.key(0), jnp.full(b, i), jnp.arange(b))
            nxt, _ = sample(logits, keys)
            return buf.at[:, PROMPT + i].set(nxt)

        return jax.lax.fori_loop(0, new, body, buf)

    buf = jnp.zeros((b, s), jnp.int32).at[:, :PROMPT].set(jnp.asarray(prompts))
    compiled = gen.lower(state, buf).compile()
    return b * new / _best(lambda: compiled(state, buf).block_until_ready(), repeats)


def bench_transformers(model, prompts: np.ndarray, new: int, repeats: int
                       ) -> dict[str, float] | None:
    """``generate(do_sample=False)`` tokens/s of the same weights in transformers (static
    and dynamic cache), or None where torch / transformers are not installed."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    from tppo_jax.models.hf import save_pretrained

    with tempfile.TemporaryDirectory() as d:
        save_pretrained(model, d)
        hf = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    ids = torch.from_numpy(prompts).long()
    out = {}
    for cache in ("static", "dynamic"):
        kw = dict(do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                  attention_mask=torch.ones_like(ids))
        if cache == "static":
            kw["cache_implementation"] = "static"
        with torch.no_grad():
            hf.generate(ids, **kw)  # warm-up
            out[f"transformers_{cache}_tok_s"] = prompts.size // PROMPT * new / _best(
                lambda kw=kw: hf.generate(ids, **kw), repeats)
    return out


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
        paged, pages = bench_engine(model, prompts, new, repeats, "paged")
        row = {"batch": b, "new_tokens": new, "paged_tok_s": paged,
               "dense_tok_s": bench_engine(model, prompts, new, repeats, "dense")[0],
               "nocache_tok_s": bench_nocache(model, prompts, new, repeats),
               "paged_pages_in_use": pages}
        row.update(bench_transformers(model, prompts, new, repeats) or {})
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
                      "note": "tiny model (~0.8M params); paged/dense = the scheduler's window "
                              "through DecodeEngine; compile excluded; best of repeats"}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))

    print("| B | paged tok/s | dense tok/s | no-cache tok/s | paged/dense "
          "| transformers static / dynamic tok/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        hf = (f"{r['transformers_static_tok_s']:.0f} / {r['transformers_dynamic_tok_s']:.0f}"
              if "transformers_static_tok_s" in r else "(no torch)")
        print(f"| {r['batch']} | {r['paged_tok_s']:.0f} | {r['dense_tok_s']:.0f} | "
              f"{r['nocache_tok_s']:.0f} | {r['paged_tok_s'] / r['dense_tok_s']:.2f} | {hf} |")
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
