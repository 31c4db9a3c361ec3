"""Decode throughput vs the memory-bandwidth roofline and train-step MFU on an accelerator.

A random Qwen2-shaped model (``--arch qwen2-0.5b``: Qwen2.5-0.5B sizes, bf16) at batch 256:
- decode: one training window of ``--new-tokens`` greedy tokens through the rollout engine
  (``DecodeEngine``'s window: the decode core's ``lax.while_loop`` over a dense KV cache), the
  decode state donated; the engine's batched prefill timed apart.
  Roofline = bytes a step must read (all weights + the live KV cache) / peak HBM bandwidth;
- train: one optimizer step of the policy and of the value update (forward + backward + AdamW) on
  ``--train-batch`` x ``--train-len`` tokens; MFU = 6 * params * tokens/s / peak bf16 FLOP/s;
- XLA proxies (``xla_cost``; the same numbers on any backend, so CPU runs check them): the
  compiled decode's bytes per step vs weights + KV and the cache-sized buffers it writes per
  step / per call, with and without donating the cache; the train steps' FLOPs vs 6N;
- baseline: ``transformers.generate`` (greedy; static and dynamic cache) on the same random
  shape when torch and transformers import (``benchmarks/hf_baseline.py``), else skipped.

Peaks come from a table keyed by ``jax.devices()[0].device_kind``; unknown devices report raw
numbers only. ``benchmarks/gpu.sh`` / ``tpu.sh`` run this on an accelerator machine in < 5
minutes; ``--arch tiny`` runs anywhere (CPU smoke check). Writes
``<out>/accelerator_<backend>.json``.

    tppo bench accelerator --arch qwen2-0.5b --batch 256
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tppo_jax.rollout.engine import DecodeEngine

# device_kind substring -> (peak bf16 dense FLOP/s, peak HBM bytes/s)
PEAKS = {
    "H200": (989e12, 4.8e12), "H100": (989e12, 3.35e12), "A100": (312e12, 2.0e12),
    "TPU v5p": (459e12, 2.765e12), "TPU v5 lite": (197e12, 0.819e12),
    "TPU v4": (275e12, 1.2e12), "TPU v6": (918e12, 1.64e12),
}
_PACKAGES = ("jax", "jaxlib", "flax", "optax", "numpy", "tppo-jax", "torch", "transformers")


def _peaks(kind: str) -> tuple[float, float] | None:
    return next((v for k, v in PEAKS.items() if k.lower() in kind.lower()), None)


def versions() -> dict:
    """Python, installed package versions (None when absent) and jax's backend plugins."""
    out: dict = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["jax_plugins"] = sorted(d.metadata["Name"] for d in metadata.distributions()
                                if d.metadata["Name"] and "jax" in d.metadata["Name"].lower()
                                and ("plugin" in d.metadata["Name"].lower()
                                     or "libtpu" in d.metadata["Name"].lower()))
    return out


def _nbytes(tree) -> int:
    import jax

    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def decoding_engine(model: Any, b: int, s: int) -> DecodeEngine:
    """The rollout engine the scheduler decodes with: ``b`` slots of ``s`` positions, dense
    cache, greedy, no EOS (every row generates the whole window)."""
    from tppo_jax.rollout.decode import SamplingParams
    from tppo_jax.rollout.engine import DecodeEngine

    return DecodeEngine(model, eos_ids=(), max_slots=b, max_target_length=s, kv_cache="dense",
                        sampling=SamplingParams(greedy=True))


def window_programs(engine: DecodeEngine, params: Any, ds: Any, window: int) -> dict[str, Any]:
    """The engine's training window of ``window`` tokens compiled for ``ds`` and ``params``:
    ``donated``, its own program from the engine's table (``rollout.programs``: what
    ``generate_window`` runs, the decode state donated), and ``not_donated``, the same window
    (the public ``generate_window``) jitted without donating the state, to compare the
    buffers each writes. Each is called as ``f(decode_state, params, budget, first)``."""
    import jax

    from tppo_jax.benchmarks import xla_cost
    from tppo_jax.rollout.programs import window_program

    prog = window_program(engine, params, ds, window, name="rollout_window", kind="rollout",
                          mesh=None)
    plain = jax.jit(lambda d, p, budget, first: engine.generate_window(d, p, window, budget,
                                                                       first))
    return {"donated": prog.lower().compile(),
            "not_donated": xla_cost.compile_fn(plain, (ds, params, *prog.args[3:]))}


def decode_section(model, cfg, args) -> dict:
    """Prefills a random batch into the engine's slots, then times (and analyses) one donated
    training window."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tppo_jax.benchmarks import xla_cost

    b, p, new = args.batch, args.prompt_len, args.new_tokens
    s = p + new + 1
    eng = decoding_engine(model, b, s)
    params = eng.load_params(model)
    toks = np.random.default_rng(0).integers(4, cfg.vocab_size, (b, s)).astype(np.int32)
    lens = np.full((b,), p, np.int32)

    def fresh() -> Any:  # a new state each time: the timed call donates it
        return jax.block_until_ready(eng.prefill_prompts(params, toks, lens)[0])

    rest = (params, jnp.full((b,), new, jnp.int32), jnp.zeros(b, bool))
    ds = fresh()
    layer = (b, s, cfg.num_kv_heads, cfg.head_dim)
    weights, kv_all = _nbytes(params.state), _nbytes((ds.cache.k, ds.cache.v))
    programs = window_programs(eng, params, ds, new)
    proxies = {k: xla_cost.decode_report(c, layer_dims=layer, weight_bytes=weights,
                                         kv_bytes=kv_all) for k, c in programs.items()}
    compiled = programs["donated"]
    t0 = time.perf_counter()
    fresh()
    prefill_s = time.perf_counter() - t0
    secs = []
    for _ in range(2):  # the first call may still pay one-time transfers
        ds = fresh()
        t0 = time.perf_counter()
        ds, out = compiled(ds, *rest)
        jax.block_until_ready(out.count)
        secs.append(time.perf_counter() - t0)
    dt = min(secs)
    itemsize = jnp.dtype(cfg.dtype).itemsize
    kv_live = (p + new / 2) * b * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize
    return {"batch": b, "prompt_len": p, "new_tokens": new, "seconds": dt,
            "prefill_seconds": prefill_s, "tokens_per_s": b * new / dt,
            "step_ms": 1e3 * dt / new, "bytes_per_step": weights + kv_live,
            "weight_bytes": weights, "xla": proxies}


def learner_for(policy, value, batch_size: int, seq: int):
    """A ``Learner`` over ``policy`` and ``value`` (one minibatch, one epoch), its
    ``TrainState`` and a random batch of ``batch_size`` finished rows of ``seq`` tokens
    (a one-token prompt): ``(learner, state, batch, rows)``."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from tppo_jax.config import AlgoConfig, OptimConfig
    from tppo_jax.learner import Learner, LearnerConfig, RowPlan, TrainBatch, TrainState

    (pdef, p), (vdef, v) = nnx.split(policy), nnx.split(value)
    p, v = nnx.to_pure_dict(p), nnx.to_pure_dict(v)
    cfg = LearnerConfig(AlgoConfig(), OptimConfig(warmup_steps=1, minibatches=1), window=seq,
                        temperature=1.0)
    learner = Learner(pdef, vdef, cfg)
    state = TrainState(p, v, learner.tx_policy.init(p), learner.tx_value.init(v))
    rng = np.random.default_rng(1)
    b = batch_size
    ones = lambda dt: jnp.ones((b,), dt)  # noqa: E731
    batch = TrainBatch(
        tokens=jnp.asarray(rng.integers(4, policy.config.vocab_size, (b, seq)), jnp.int32),
        attn=jnp.ones((b, seq), bool), sample_logprobs=jnp.full((b, seq), -2.0),
        prompt_len=ones(jnp.int32), window_start=ones(jnp.int32),
        window_len=jnp.full((b,), seq - 1, jnp.int32), finished=ones(bool),
        reward=ones(jnp.float32), correct=jnp.zeros((b,), bool))
    rows = RowPlan(np.full(b, seq), None, np.arange(b))
    return learner, state, batch, rows


def compile_train_step(policy, value, kind: str, batch_size: int, seq: int):
    """The learner's row-group gradient of the policy or the critic at the widest width,
    as its program table lists it for a batch of ``batch_size`` rows of ``seq`` tokens
    (``learner.programs``: the rows a group of that width has), compiled:
    ``(compiled, n_params, program meta)`` for XLA's cost analysis of a training step's
    dominant program."""
    import jax
    import numpy as np

    from tppo_jax.buckets import width_buckets
    from tppo_jax.learner import TrainBatch
    from tppo_jax.learner.programs import step_programs

    learner, state, _, _ = learner_for(policy, value, batch_size, seq)
    [prog] = step_programs(learner, state, TrainBatch.abstract(batch_size, seq),
                           widths=width_buckets(seq)[-1:], kinds=[f"{kind}_update"])
    params = state.policy if kind == "policy" else state.value
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    return prog.lower().compile(), n_params, prog.meta


def train_section(policy, value, args) -> dict:
    """``Learner.step`` timed on one batch (policy and critic updates, targets first), each
    model's update alone, and XLA's cost analysis of each model's group gradient."""
    import jax

    from tppo_jax.benchmarks import xla_cost

    tb, tl = args.train_batch, args.train_len
    learner, state, batch, rows = learner_for(policy, value, tb, tl)
    out: dict = {"batch": tb, "seq": tl}
    for kind in ("policy", "value"):
        compiled, n, group = compile_train_step(policy, value, kind, tb, tl)
        out[kind] = {"params": n, "group": {k: group[k] for k in ("rows", "width")},
                     "xla": xla_cost.train_report(compiled, n_params=n,
                                                  tokens=group["tokens"])}

    def timed(fn):
        nonlocal state
        state, _ = fn(state)  # warm-up: compiles (params/opt are donated)
        jax.block_until_ready(state.policy)
        t0 = time.perf_counter()
        state, _ = fn(state)
        jax.block_until_ready((state.policy, state.value))
        return time.perf_counter() - t0

    out["step_seconds"] = timed(lambda st: learner.step(st, batch, rows))
    value_s = timed(lambda st: learner.step(st, batch, rows, train_policy=False))
    out["value"] |= {"seconds": value_s, "tokens_per_s": tb * tl / value_s}
    policy_s = out["step_seconds"] - value_s  # the targets pass rides with the critic's
    out["policy"] |= {"seconds": policy_s, "tokens_per_s": tb * tl / max(policy_s, 1e-9)}
    return out


def run(args: argparse.Namespace) -> dict:
    import jax
    from flax import nnx

    from tppo_jax.benchmarks.intensity import ARCHS
    from tppo_jax.models.transformer import create_model
    from tppo_jax.models.value import ValueModel

    kind = jax.devices()[0].device_kind
    remat = args.remat != "none"
    # Unrolled layers: XLA's cost analysis (the xla.* proxies) counts a scan's body once.
    cfg = ARCHS[args.arch].model_config(args.dtype, remat=remat,
                                        remat_policy=args.remat if remat else "full",
                                        unroll_layers=True)
    out: dict = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": kind,
                 "device_count": jax.device_count(), "backend": jax.default_backend(),
                 "arch": args.arch, "dtype": args.dtype, "remat": args.remat,
                 "versions": versions()}
    path = Path(args.out) / f"accelerator_{jax.default_backend()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    policy = create_model(cfg, seed=0)
    # Saved after every section: a run cut short by the script's timeout keeps what it got.
    out["decode"] = decode_section(policy, cfg, args)
    out["params"] = out["decode"]["weight_bytes"] // jax.numpy.dtype(args.dtype).itemsize
    path.write_text(json.dumps(out, indent=2))
    train = train_section(policy, ValueModel(cfg, rngs=nnx.Rngs(1)), args)
    out["train_step_seconds"] = train["step_seconds"]
    out["train_policy"] = {"batch": train["batch"], "seq": train["seq"], **train["policy"]}
    out["train_value"] = {"batch": train["batch"], "seq": train["seq"], **train["value"]}
    path.write_text(json.dumps(out, indent=2))
    peaks = _peaks(kind)
    if peaks:
        flops, bw = peaks
        d = out["decode"]
        d["roofline_fraction"] = (d["bytes_per_step"] / bw) / (d["seconds"] / d["new_tokens"])
        for k in ("train_policy", "train_value"):
            t = out[k]
            t["mfu"] = 6.0 * t["params"] * t["tokens_per_s"] / flops
        out["peaks"] = {"bf16_flops": flops, "hbm_bytes_per_s": bw}
    out["hf_generate"] = _hf(args)
    out["notes"] = [
        "xla.*: XLA's compiled-program analysis (benchmarks/xla_cost.py); a while/scan body "
        "is counted once, so decode bytes are per step and the chunked log-prob head in the "
        "train FLOPs is counted for one chunk",
    ]
    if out["backend"] == "cpu" and args.dtype == "bfloat16":
        out["notes"].append("XLA:CPU emulates bf16 by converting whole buffers: read the "
                            "decode proxies from a --dtype float32 run")
    path.write_text(json.dumps(out, indent=2))
    print(json.dumps(_summary(out), indent=2))
    print(f"-> {path}")
    return out


def _hf(args) -> dict:
    """The transformers baseline, or why it was skipped (never fails the run)."""
    if args.no_hf:
        return {"skipped": "--no-hf"}
    from tppo_jax.benchmarks import hf_baseline

    try:
        return hf_baseline.run(args.arch, args.batch, args.prompt_len, args.new_tokens,
                               args.dtype)
    except Exception as e:  # a broken torch install must not lose the jax numbers
        return {"error": f"{type(e).__name__}: {e}"}


def _summary(out: dict) -> dict:
    d, p, v = out["decode"], out["train_policy"], out["train_value"]
    return {"device": out["device"], "decode_tokens_per_s": round(d["tokens_per_s"]),
            "decode_step_ms": round(d["step_ms"], 3),
            "roofline_fraction": d.get("roofline_fraction"),
            "policy_tokens_per_s": round(p["tokens_per_s"]), "policy_mfu": p.get("mfu"),
            "value_tokens_per_s": round(v["tokens_per_s"]), "value_mfu": v.get("mfu"),
            "decode_bytes_vs_weights_plus_kv":
                round(d["xla"]["donated"]["bytes_vs_weights_plus_kv"], 3),
            "decode_cache_writes_per_step": len(d["xla"]["donated"]["cache_writes_per_step"]),
            "policy_flops_vs_6n": round(p["xla"]["flops_vs_6n"], 3),
            "hf_generate": out["hf_generate"]}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", default="qwen2-0.5b", choices=["tiny", "qwen2-0.5b"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--train-batch", type=int, default=16)
    p.add_argument("--train-len", type=int, default=1024)
    p.add_argument("--remat", default="full", choices=["none", "full", "dots"],
                   help="train-step rematerialisation (ModelConfig.remat_policy)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--out", default="results")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_args(parser)
    run(parser.parse_args())
