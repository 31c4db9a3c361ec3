"""Rollout arithmetic intensity of T-PPO vs PPO (ops/byte), from XLA's cost analysis.

One decode step of B slots costs the same FLOPs and bytes whether a slot is busy or idle
(static shapes); what differs is how many of those slots do useful work. So

    useful ops/byte = occupancy * FLOPs(decode step) / bytes(decode step)

where occupancy = useful tokens / slot-steps of the rollout schedule. FLOPs and bytes come
from ``compiled.cost_analysis()`` of one jitted decode step (``Transformer.forward_with_cache``
on ``[B, 1]`` tokens against a ``[B, S]`` dense KV cache); occupancy comes from replaying
the window schedule (the scheduler's arithmetic) on response lengths drawn from the
embedded task's long-tailed distribution, scaled to the chosen ``L``.

    tppo bench intensity --arch qwen2-0.5b --slots 256 --max-len 4096 --window 1024
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from tppo_jax.plan import ARCHITECTURES, Arch

ARCHS = {  # sizes from tppo_jax.plan's table (HF config.json), plus the CPU default's
    "tiny": Arch("tiny", 128, 128, 384, 4, 4, 2, 32, False, True),
    "qwen2-0.5b": ARCHITECTURES["qwen2.5-0.5b"],
}


def schedule_occupancy(lengths: np.ndarray, slots: int, window: int, max_len: int) -> dict:
    """Replays successive batching: every window, each slot decodes min(window, remaining)
    tokens; the window lasts as long as its busiest slot; finished slots take the next
    sequence. With ``window >= max_len`` every row finishes in its window: synchronous PPO."""
    queue = [int(x) for x in np.minimum(lengths, max_len)][::-1]
    remaining = [queue.pop() if queue else 0 for _ in range(slots)]
    useful = slot_steps = 0
    while any(remaining):
        work = [min(window, r) for r in remaining]
        useful += sum(work)
        slot_steps += slots * max(work)
        remaining = [r - w if r - w > 0 else (queue.pop() if queue else 0)
                     for r, w in zip(remaining, work, strict=True)]
    return {"useful_tokens": int(useful), "slot_steps": int(slot_steps),
            "occupancy": useful / max(slot_steps, 1)}


def decode_step_cost(arch: str, slots: int, seq: int) -> dict:
    """FLOPs and bytes accessed of one compiled decode step (abstract shapes; no allocation)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from tppo_jax.models.cache import DenseKVCache
    from tppo_jax.models.transformer import Transformer

    # Unrolled layers: XLA's cost analysis counts a scan's body (one layer) once.
    cfg = ARCHS[arch].model_config("bfloat16", unroll_layers=True)
    n, hkv, d = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    cache = jax.eval_shape(lambda: DenseKVCache.init(n, slots, seq, hkv, d, jnp.bfloat16))

    def step(state, cache, tok, pos):
        model = nnx.merge(graphdef, state)
        logits, cache = model.forward_with_cache(tok, pos, cache, valid=jnp.ones_like(tok, bool))
        return logits, cache

    tok = jax.ShapeDtypeStruct((slots, 1), jnp.int32)
    compiled = jax.jit(step).lower(state, cache, tok, tok).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
    return {"flops": float(cost.get("flops", 0.0)),
            "bytes": float(cost.get("bytes accessed", 0.0)), "params": n_params}


def run(args: argparse.Namespace) -> dict:
    from tppo_jax.data.synthetic import SyntheticMathTask

    # Long-tailed lengths: the embedded task's solution lengths, rescaled so the longest
    # sample hits max_len (the paper's regime: a few responses run to L).
    task = SyntheticMathTask(seed=0, difficulty=args.difficulty)
    chars = np.array([len(e.solution or "") for e in task.sample(args.samples)], float)
    lengths = np.maximum(1, np.round(chars / chars.max() * args.max_len)).astype(int)
    cost = decode_step_cost(args.arch, args.slots, args.max_len + args.prompt_len)
    raw = cost["flops"] / max(cost["bytes"], 1.0)
    out = {"arch": args.arch, "slots": args.slots, "max_len": args.max_len,
           "window": args.window, "decode_step": cost, "raw_ops_per_byte": raw,
           "length_median": float(np.median(lengths)), "length_max": int(lengths.max()),
           "paper": {"tppo": 249, "ppo": 84}}
    # Weights-only view (the memory-bound part of decode the paper's numbers reflect): a
    # step reads every bf16 weight once (2 bytes/param) and does 2 FLOPs/param per busy
    # slot, so useful ops/byte = occupancy * slots.
    weights_only = 2.0 * cost["params"] * args.slots / (2.0 * cost["params"])
    for name, window in (("tppo", args.window), ("ppo", args.max_len)):
        occ = schedule_occupancy(lengths, args.slots, window, args.max_len)
        out[name] = {**occ, "useful_ops_per_byte": raw * occ["occupancy"],
                     "weights_only_ops_per_byte": weights_only * occ["occupancy"]}
    out["ratio"] = out["tppo"]["useful_ops_per_byte"] / max(out["ppo"]["useful_ops_per_byte"],
                                                            1e-12)
    path = Path(args.out) / "intensity.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print("| method | occupancy | useful ops/byte (XLA cost, dense KV) | "
          "useful ops/byte (weights only) | paper |\n|---|---|---|---|---|")
    for m in ("tppo", "ppo"):
        print(f"| {m} | {out[m]['occupancy']:.3f} | {out[m]['useful_ops_per_byte']:.2f} | "
              f"{out[m]['weights_only_ops_per_byte']:.0f} | {out['paper'][m]} |")
    print(f"raw decode step: {raw:.1f} ops/byte ({cost['flops']:.3g} FLOPs, "
          f"{cost['bytes']:.3g} bytes); T-PPO/PPO = {out['ratio']:.2f}x (paper 2.96x). -> {path}")
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", choices=sorted(ARCHS), default="qwen2-0.5b")
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--max-len", type=int, default=4096, help="L")
    p.add_argument("--window", type=int, default=1024, help="l")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--difficulty", type=float, default=1.5)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--out", default="results")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_args(parser)
    run(parser.parse_args())
