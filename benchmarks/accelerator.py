"""Decode throughput vs the memory-bandwidth roofline and train-step MFU on an accelerator.

A ~0.5B Qwen2-shaped random model in bf16 (``--arch qwen2-0.5b``), batch 256:
- decode: one jitted window of ``--new-tokens`` greedy tokens (``rollout.generate``, dense
  KV cache, ``lax.while_loop``); roofline = bytes a step must read (all weights + the live
  KV cache) / peak HBM bandwidth;
- train: one jitted ``policy_update`` (forward + backward + AdamW) on ``--train-batch`` x
  ``--train-len`` tokens; MFU = 6 * params * tokens/s / peak bf16 FLOP/s.

Peaks come from a table keyed by ``jax.devices()[0].device_kind``; unknown devices report raw
numbers only. ``benchmarks/gpu.sh`` runs this on a fresh GPU/TPU machine in < 5 minutes;
``--arch tiny`` runs anywhere (CPU smoke check).

    tppo bench accelerator --arch qwen2-0.5b --batch 256
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

# device_kind substring -> (peak bf16 dense FLOP/s, peak HBM bytes/s)
PEAKS = {
    "H200": (989e12, 4.8e12), "H100": (989e12, 3.35e12), "A100": (312e12, 2.0e12),
    "TPU v5p": (459e12, 2.765e12), "TPU v5 lite": (197e12, 0.819e12),
    "TPU v4": (275e12, 1.2e12), "TPU v6": (918e12, 1.64e12),
}


def _peaks(kind: str) -> tuple[float, float] | None:
    return next((v for k, v in PEAKS.items() if k.lower() in kind.lower()), None)


def run(args: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from tppo_jax.benchmarks.intensity import ARCHS

    from tppo_jax.config import AlgoConfig, OptimConfig
    from tppo_jax.models.transformer import create_model
    from tppo_jax.rollout.generate import SamplingParams, prefill_and_decode
    from tppo_jax.train.step import StepConfig, make_optimizer, policy_update

    cfg = ARCHS[args.arch].model_config(args.dtype, remat=True)
    v, n, hkv, d = cfg.vocab_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    model = create_model(cfg, seed=0)
    params = nnx.to_pure_dict(nnx.state(model))
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    kind = jax.devices()[0].device_kind
    out: dict = {"device": kind, "backend": jax.default_backend(), "arch": args.arch,
                 "params": n_params, "dtype": args.dtype}
    rng = np.random.default_rng(0)

    # ---- decode ------------------------------------------------------------------------
    b, p, new = args.batch, args.prompt_len, args.new_tokens
    s = p + new + 1
    tokens = jnp.asarray(rng.integers(4, v, size=(b, s)), jnp.int32)
    lens = jnp.full((b,), p, jnp.int32)

    def decode_once():
        cache = model.init_cache(b, s)
        res, _ = prefill_and_decode(
            model, cache, tokens, lens, jnp.ones(b, bool), jnp.ones(b, bool),
            jnp.full(b, new, jnp.int32), jax.random.key(0), jnp.arange(b, dtype=jnp.uint32),
            jnp.int32(0), window=new, eos_id=-1, params=SamplingParams(greedy=True))
        return jax.block_until_ready(res.count)

    decode_once()  # compile
    t0 = time.perf_counter()
    decode_once()
    dt = time.perf_counter() - t0
    # Prefill is included in dt; it is small next to `new` sequential decode steps.
    bytes_w = n_params * (2 if args.dtype == "bfloat16" else 4)
    kv_mean = (p + new / 2) * b * n * 2 * hkv * d * (2 if args.dtype == "bfloat16" else 4)
    out["decode"] = {"batch": b, "new_tokens": new, "seconds": dt, "tokens_per_s": b * new / dt,
                     "bytes_per_step": bytes_w + kv_mean}
    # ---- train step ----------------------------------------------------------------------
    tb, tl = args.train_batch, args.train_len
    gd = nnx.graphdef(model)
    optim = OptimConfig(warmup_steps=1, minibatches=1)
    tx = make_optimizer(1e-5, optim)
    scfg = StepConfig(algo=AlgoConfig(), optim=optim, window=tl, temperature=1.0)
    toks = jnp.asarray(rng.integers(4, v, size=(tb, tl)), jnp.int32)
    batch = {"tokens": toks, "attn": jnp.ones((tb, tl), bool),
             "sample_logprobs": jnp.full((tb, tl), -2.0), "advantages": jnp.ones((tb, tl)),
             "policy_mask": jnp.ones((tb, tl)), "positive_mask": jnp.zeros((tb, tl))}
    opt = tx.init(params)
    params, opt, _ = policy_update(gd, params, opt, batch, tx=tx, cfg=scfg)  # compile
    jax.block_until_ready(params)
    t0 = time.perf_counter()
    params, opt, stats = policy_update(gd, params, opt, batch, tx=tx, cfg=scfg)
    jax.block_until_ready(params)
    dt = time.perf_counter() - t0
    out["train"] = {"batch": tb, "seq": tl, "seconds": dt, "tokens_per_s": tb * tl / dt}
    peaks = _peaks(kind)
    if peaks:
        flops, bw = peaks
        step_s = out["decode"]["seconds"] / new
        out["decode"]["roofline_fraction"] = (out["decode"]["bytes_per_step"] / bw) / step_s
        out["train"]["mfu"] = 6.0 * n_params * out["train"]["tokens_per_s"] / flops
        out["peaks"] = {"bf16_flops": flops, "hbm_bytes_per_s": bw}
    path = Path(args.out) / f"accelerator_{jax.default_backend()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", default="qwen2-0.5b", choices=["tiny", "qwen2-0.5b"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--train-batch", type=int, default=16)
    p.add_argument("--train-len", type=int, default=1024)
    p.add_argument("--out", default="results")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_args(parser)
    run(parser.parse_args())
