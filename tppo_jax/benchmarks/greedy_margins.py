"""Where does RL flip a greedy answer? The starting policy's greedy path of a held-out
question, teacher-forced through every checkpoint of a run: at each response token, the
log-prob margin of the starting policy's choice over its best rival. A greedy answer flips
where a margin goes below 0; the curve over checkpoints says when.

    python -m tppo_jax.benchmarks.greedy_margins RUN_DIR --questions 16,107 [--lowest 3]

Prints, per question, each policy's greedy answer and the ``--lowest`` margins on the
starting path (token, margin in nats, runner-up); writes nothing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def path_margins(model, ids: list[int], response: list[int]) -> list[tuple[int, float, int]]:
    """``(token, margin, runner-up)`` at every token of ``response`` after ``ids``: the
    log-prob of ``response``'s token minus the best other token's, teacher-forced."""
    full = jnp.asarray([ids + response])
    logits = model(full)[0, len(ids) - 1:-1].astype(jnp.float32)
    lp = np.asarray(jax.nn.log_softmax(logits, -1))
    out = []
    for t, tok in enumerate(response):
        rival = np.where(np.arange(lp.shape[1]) == tok, -np.inf, lp[t])
        out.append((tok, float(lp[t, tok] - rival.max()), int(rival.argmax())))
    return out


def main(argv: list[str] | None = None) -> None:
    from flax import nnx

    from tppo_jax.cli.runs import load_run_policy
    from tppo_jax.config import load_config
    from tppo_jax.data.run_data import prompt_rows
    from tppo_jax.eval.heldout import generate_answers
    from tppo_jax.rollout.decode import SamplingParams
    from tppo_jax.runs.checkpoint import Checkpointer
    from tppo_jax.trainer.models import load_models

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--questions", required=True, help="held-out indices, comma-separated")
    p.add_argument("--lowest", type=int, default=3)
    args = p.parse_args(argv)
    run = Path(args.run_dir)
    cfg = load_config(run / "config.yaml")
    models = load_models(cfg, run, False)
    tok, r = models.tokenizer, cfg.rollout
    _, rows, encode = prompt_rows(cfg, tok)
    policies = {0: nnx.merge(models.policy_def, nnx.State(models.policy))}
    steps = Checkpointer(cfg.checkpoint.dir or run / "checkpoints", every=0, keep=1000)
    for s in sorted(steps.mngr.all_steps()):
        policies[s] = load_run_policy(run, s)[2]
    greedy = SamplingParams(greedy=True)
    for q in (int(x) for x in args.questions.split(",")):
        ids = encode(rows[q])
        print(f"== #{q}: {rows[q].question}")
        path = None
        for s, model in policies.items():
            resp = generate_answers(model, tok, [ids], max_prompt_len=r.max_prompt_len,
                                    max_response_len=r.max_response_len, sampling=greedy)[0]
            path = resp if path is None else path
            low = sorted(path_margins(model, ids, path), key=lambda m: m[1])[:args.lowest]
            shown = ", ".join(f"{tok.decode([a])!r} {m:+.2f} (vs {tok.decode([b])!r})"
                              for a, m, b in low)
            print(f"  step {s:>4}: {tok.decode(resp)!r}\n             lowest margins: {shown}")


if __name__ == "__main__":
    main()
