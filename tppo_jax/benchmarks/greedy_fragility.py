"""Is RL's loss of greedy accuracy the direction of its update, or only its size?

RL runs on the long-tail task lose 15-25 points of held-out greedy accuracy at an approx. KL
of ~1e-4 per step. This measures the same starting policy moved by random updates of exactly
the RL update's size, tensor by tensor: ``theta_0 + |delta_t| * u_t / |u_t|`` for every param
tensor ``t`` (``delta = theta_RL - theta_0``, ``u`` Gaussian), and evaluates each (greedy, and
sampled avg@k / pass@k) beside the starting and the RL-trained policy. If random moves of
that size cost as much greedy accuracy, the warm-start's greedy answers sit on near-ties and
the drop says little about RL; if they do not, RL's direction is what costs it.

    python -m tppo_jax.benchmarks.greedy_fragility RUN_DIR [--directions 3] [-k 8]

``RUN_DIR``: a finished run (its newest checkpoint is the RL policy; its warm-start or base
model is the start). Writes ``results/greedy_fragility.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def same_size_random(start: dict, moved: dict, key: jax.Array) -> dict:
    """``start`` moved, tensor by tensor, by a random direction of the norm of
    ``moved - start`` in that tensor (a zero move stays zero)."""
    leaves, treedef = jax.tree.flatten(start)
    keys = jax.random.split(key, len(leaves))
    out = []
    for k, a, b in zip(keys, leaves, jax.tree.leaves(moved), strict=True):
        d = jnp.linalg.norm((b - a).astype(jnp.float32))
        u = jax.random.normal(k, a.shape, jnp.float32)
        out.append((a + (d * u / jnp.maximum(jnp.linalg.norm(u), 1e-30))).astype(a.dtype))
    return jax.tree.unflatten(treedef, out)


def run(args: argparse.Namespace) -> dict:
    from tppo_jax.cli.runs import load_run_policy
    from tppo_jax.data.run_data import prompt_rows
    from tppo_jax.eval.heldout import EvalEngines, evaluate
    from tppo_jax.rewards.grader import MathGrader
    from tppo_jax.rollout.decode import SamplingParams
    from tppo_jax.trainer.models import load_models

    run_dir = Path(args.run_dir)
    cfg, tok, policy, step, _ = load_run_policy(run_dir, None)
    graphdef, moved = nnx.split(policy)
    moved = nnx.to_pure_dict(moved)
    start = load_models(cfg, run_dir, progress=False).policy
    _, rows, encode = prompt_rows(cfg, tok)
    grader = MathGrader.from_config(cfg.reward, cfg.data.format)
    r = cfg.rollout
    kw = dict(max_prompt_len=r.max_prompt_len, max_response_len=r.max_response_len,
              engines=EvalEngines())  # every scored point reuses the compiled engines
    sampling = SamplingParams(r.temperature, r.top_p, r.top_k)

    def score(params: dict) -> dict:
        state = nnx.state(nnx.merge(graphdef, moved))
        nnx.replace_by_pure_dict(state, params)
        model = nnx.merge(graphdef, state)
        g = evaluate(model, tok, rows, encode, grader, **kw)
        s = evaluate(model, tok, rows, encode, grader, k=args.k, sampling=sampling,
                     seed=cfg.train.seed, **kw)
        return {"greedy": g["avg@1"], f"avg@{args.k}": s[f"avg@{args.k}"],
                f"pass@{args.k}": s[f"pass@{args.k}"]}

    delta = jax.tree.map(lambda a, b: float(jnp.linalg.norm((b - a).astype(jnp.float32))),
                         start, moved)
    out = {"run_dir": str(run_dir), "step": step, "questions": len(rows),
           "update_norm": float(np.sqrt(sum(x * x for x in jax.tree.leaves(delta)))),
           "start": score(start), "rl": score(moved), "random": []}
    for i in range(args.directions):
        out["random"].append(score(same_size_random(start, moved, jax.random.key(i))))
        print(json.dumps(out["random"][-1]), flush=True)
    grader.close()
    print(json.dumps({k: v for k, v in out.items() if k != "random"}, indent=1))
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir")
    p.add_argument("--directions", type=int, default=3)
    p.add_argument("-k", type=int, default=8)
    p.add_argument("--out", default="results/greedy_fragility.json")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    run(p.parse_args())


if __name__ == "__main__":
    main()
