"""Per-chip compiled temporaries of the training backbone's gradient, dense vs splash attention,
compiled ahead of time with the TPU compiler on this machine (no TPU needed: ``jax[tpu]``).

    python -m tppo_jax.benchmarks.attention_memory --layers 4 --seq 8192 --batch 8 \
        --topology v5e:2x2 --impls dense,splash --out results/attention_memory.json

Qwen2.5-0.5B layer shapes, bf16, remat, FSDP over every chip; the loss is a sum over the
final hidden states (no LM head), so the figures isolate the layers' activations.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from tppo_jax.kernels.choice import traced_on
from tppo_jax.models.transformer import Backbone, param_shardings
from tppo_jax.parallel.mesh import make_mesh
from tppo_jax.plan import ARCHITECTURES

GIB = 1024**3


def tpu_devices(topology: str) -> list:
    from jax.experimental import topologies

    x, y = (int(n) for n in topology.split(":")[1].split("x")[:2])
    desc = topologies.get_topology_desc(
        topology_name=topology, platform="tpu", chip_config_name="default",
        chips_per_host_bounds=(min(x, 2), min(y, 2), 1), num_slices=1,
        wrap=(False, False, False))
    return list(desc.devices)


def compile_grad(impl: str, layers: int, seq: int, batch: int, devices: list) -> dict:
    """Lowers and compiles the backbone's gradient; returns the per-chip memory figures."""
    cfg = dataclasses.replace(ARCHITECTURES["qwen2.5-0.5b"].model_config("bfloat16", remat=True),
                              num_layers=layers, attention=impl)
    mesh = make_mesh({"fsdp": len(devices)}, devices=devices)
    abstract = nnx.eval_shape(lambda: Backbone(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    shardings = param_shardings(state, mesh)
    params = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
                          state, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None))
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=rows)
    mask = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=rows)

    def loss(params, tokens, mask):
        hidden = nnx.merge(graphdef, params)(tokens, attention_mask=mask)
        return jnp.sum(hidden.astype(jnp.float32) * mask[..., None])

    start = time.time()
    # traced on the mesh: splash runs per shard (``kernels.choice.traced_on``)
    compiled = jax.jit(traced_on(jax.grad(loss), mesh)).lower(params, tokens, mask).compile()
    mem = compiled.memory_analysis()
    return {"impl": impl, "temp_gib": mem.temp_size_in_bytes / GIB,
            "argument_gib": mem.argument_size_in_bytes / GIB,
            "output_gib": mem.output_size_in_bytes / GIB,
            "compile_s": round(time.time() - start, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--topology", default="v5e:2x2")
    ap.add_argument("--impls", default="dense,splash")
    ap.add_argument("--out", default="results/attention_memory.json")
    args = ap.parse_args()
    devices = tpu_devices(args.topology)
    runs = []
    for impl in args.impls.split(","):
        try:
            runs.append(compile_grad(impl, args.layers, args.seq, args.batch, devices))
        except Exception as e:  # the compiler refusing a program (HBM) is a result too
            runs.append({"impl": impl, "error": str(e).splitlines()[0][:300]})
        print(json.dumps(runs[-1]), flush=True)
    import libtpu

    out = {"model": "qwen2.5-0.5b layers", "layers": args.layers, "seq": args.seq,
           "batch": args.batch, "topology": args.topology, "mesh": {"fsdp": len(devices)},
           "dtype": "bfloat16", "remat": True, "jax": jax.__version__,
           "libtpu": getattr(libtpu, "__version__", "?"), "per_chip": runs}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
