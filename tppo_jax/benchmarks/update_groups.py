"""Update time per step with row groups cut to their own width vs the whole batch at its
longest row's width.

Before this change every row of an update ran at the width bucket of the batch's longest
row: on the long-tail task one 500-token row made 31 short ones pay for 512 columns, and
attention's cost grows with the square of the width. Now each minibatch runs as row groups,
one per width bucket (``train/update_plan.py``), their gradients summed: the same step.

Here both run on the same rollout batches (the warm-started policy's, T-PPO with window
``l`` and PPO with ``l = L``), the same starting weights, interleaved: the critic targets,
then the policy and value updates exactly as the trainer makes them (``fullwidth`` = every
row planned at the batch width, the old cost; the critic targets pass is timed on its own too,
``targets_s_median``). Each update runs twice and the second is
timed (the first compiles the shapes it meets; ``compiles_while_timed`` must be 0). T-PPO's
batches come after ``--skip`` windows, so its slots hold continuing rows of every age as in
training. Rewards are the grader's. The two modes must end at the same weights (max
relative difference reported). Writes ``results/update_groups.json``.

    tppo bench update-groups --config longtail --steps 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def graded_batches(cfg, tok, model, examples, encode, window: int, n: int, skip: int) -> list:
    """``n`` rollout windows from a fresh scheduler after ``skip`` untimed ones (so T-PPO's
    slots hold continuing rows of every age, as in training), graded:
    ``[(rb, reward, correct)]``."""
    from tppo_jax.benchmarks.prefill_width import make_scheduler
    from tppo_jax.rewards.grader import MathGrader

    grader = MathGrader.from_config(cfg.reward, cfg.data.format)
    sched = make_scheduler(cfg, tok, model, examples, encode, window)
    out = []
    for i in range(skip + n):
        rb = sched.step()
        if i < skip:
            sched.release_finished(rb.finished)
            continue
        fin = np.flatnonzero(rb.finished)
        reward, correct = np.zeros(sched.B, np.float32), np.zeros(sched.B, bool)
        if len(fin):
            g = grader.grade([tok.decode(rb.response_tokens(i)) for i in fin],
                             [rb.examples[i].answer for i in fin])
            reward[fin], correct[fin] = g.rewards, g.correct
        out.append((rb, reward, correct))
        sched.release_finished(rb.finished)
    return out


def _update(fns, policy, value, opts, arrays, lengths, finished, shuffle):
    """One step's targets + policy + value update (the trainer's calls); returns the new
    weights, the seconds it took and the seconds of its targets pass."""
    import jax

    targets_fn, pol, val = fns
    t0 = time.perf_counter()
    batch = {**arrays, **jax.block_until_ready(targets_fn(value, arrays, lengths=lengths))}
    t_targets = time.perf_counter() - t0
    w = int(arrays["tokens"].shape[1])
    policy, _, _ = pol(policy, opts[0], batch, plan=pol.plan(lengths, w, shuffle))
    if len(finished):
        value, _, _ = val(value, opts[1], batch, plan=val.plan(lengths, w, shuffle, finished))
    jax.block_until_ready((policy, value))
    return policy, value, time.perf_counter() - t0, t_targets


def _max_rel_diff(a, b) -> float:
    import jax

    return max(float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-12))
               for x, y in zip(jax.tree.leaves(jax.device_get(a)),
                               jax.tree.leaves(jax.device_get(b)), strict=True))


def update_setup(args: argparse.Namespace) -> tuple:
    """What an update benchmark starts from: the warm-started policy and its critic on a
    one-device mesh, with the trainer's optimizers. Returns ``(cfg, mesh, models, txs,
    batches)``: ``models = (policy graphdef, policy params, value graphdef, value params)``,
    ``txs = (policy optimizer, value optimizer)``, ``batches(window, skip)`` the graded
    rollout windows to time (``graded_batches``)."""
    import jax
    from flax import nnx

    from tppo_jax.benchmarks.prefill_width import warm_started
    from tppo_jax.models.value import ValueModel
    from tppo_jax.parallel.mesh import make_mesh
    from tppo_jax.train.step import make_optimizer

    cfg, tok, model, examples, encode = warm_started(args)
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
    pdef, p0 = nnx.split(model)
    vdef, v0 = nnx.split(ValueModel.from_policy(model))
    models = (pdef, nnx.to_pure_dict(p0), vdef, nnx.to_pure_dict(v0))
    txs = (make_optimizer(cfg.optim.policy_lr, cfg.optim),
           make_optimizer(cfg.optim.value_lr, cfg.optim))

    def batches(window: int, skip: int) -> list:
        return graded_batches(cfg, tok, model, examples, encode, window, args.steps, skip)

    return cfg, mesh, models, txs, batches


def run(args: argparse.Namespace) -> dict:
    from tppo_jax.benchmarks.prefill_width import write_result

    cfg, mesh, models, txs, make_batches = update_setup(args)
    r, L = cfg.rollout, cfg.rollout.max_response_len
    out: dict = {"config": args.config, "slots": r.slots, "L": L, "steps": args.steps,
                 "cpu": args.cpu_note, "methods": {}}
    for name, window in (("tppo", r.window), ("ppo", L)):
        batches = make_batches(window, args.skip if name == "tppo" else 1)
        res, diff, timed = _time_method(cfg, models, txs, mesh, min(window, L), batches)
        out["methods"][name] = summary = _summary(res, diff, timed)
        print(f"{name}: update {summary['update_s_median']['fullwidth']:.2f} s/step (batch "
              f"width) -> {summary['update_s_median']['grouped']:.2f} s/step (row groups), "
              f"{summary['speedup']:.2f}x; policy cells {res['cells']['fullwidth']} -> "
              f"{res['cells']['grouped']}; of which the targets pass "
              f"{summary['targets_s_median']['fullwidth']:.2f} -> "
              f"{summary['targets_s_median']['grouped']:.2f} s; max relative weight "
              f"difference {diff:.1e}")
    return write_result(out, args.out, "update_groups.json")


def _time_method(cfg, models, txs, mesh, window: int, batches) -> tuple[dict, float, int]:
    """Every batch's update timed at the batch's full width and in row groups (each
    compiled untimed first), from the same start; the two ends' largest weight difference."""
    import jax
    import jax.numpy as jnp

    from tppo_jax.train.batch import batch_arrays, shuffle_keys
    from tppo_jax.train.shapes import CompileWatch
    from tppo_jax.train.state import commit_to_mesh
    from tppo_jax.train.step import StepConfig
    from tppo_jax.train.targets import make_targets
    from tppo_jax.train.update import make_updater, plan_cells

    r = cfg.rollout
    pdef, p0, vdef, v0 = models
    tx_p, tx_v = txs
    copy = lambda t: jax.tree.map(jnp.copy, t)  # noqa: E731  (the updates donate their inputs)
    scfg = StepConfig.from_config(cfg, window)
    opt_p, opt_v = commit_to_mesh(tx_p.init(p0), mesh), commit_to_mesh(tx_v.init(v0), mesh)
    fns = (make_targets(vdef, scfg, mesh=mesh, params=v0),
           make_updater("policy", pdef, tx=tx_p, cfg=scfg, mesh=mesh, params=p0,
                        opt_state=opt_p),
           make_updater("value", vdef, tx=tx_v, cfg=scfg, mesh=mesh, params=v0,
                        opt_state=opt_v))
    res: dict = {"fullwidth": [], "grouped": [], "width": [],
                 "cells": {"fullwidth": 0, "grouped": 0},
                 "targets": {"fullwidth": [], "grouped": []}}
    diff, timed_compiles = 0.0, 0
    with CompileWatch() as watch:
        for i, (rb, reward, correct) in enumerate(batches):
            arrays = batch_arrays(rb, reward, correct, mesh)
            width = int(arrays["tokens"].shape[1])
            shuffle = shuffle_keys(cfg, i, r.slots)
            fin = np.flatnonzero(rb.finished)
            ends = {}
            for mode in ("fullwidth", "grouped"):
                lengths = rb.total_len if mode == "grouped" else np.full(r.slots, width)
                args_ = (arrays, lengths, fin, shuffle)
                # Untimed first: it compiles whatever shapes this batch meets.
                _update(fns, copy(p0), copy(v0), (copy(opt_p), copy(opt_v)), *args_)
                watch.take()
                p, v, dt, dt_targets = _update(fns, copy(p0), copy(v0),
                                               (copy(opt_p), copy(opt_v)), *args_)
                res["targets"][mode].append(dt_targets)
                timed_compiles += watch.take()[0]
                ends[mode] = (p, v)
                res[mode].append(dt)
                res["cells"][mode] += plan_cells(fns[1].plan(lengths, width, shuffle))
            res["width"].append(width)
            diff = max(diff, _max_rel_diff(ends["grouped"], ends["fullwidth"]))
    return res, diff, timed_compiles


def _summary(res: dict, diff: float, timed_compiles: int) -> dict:
    t_full, t_grp = sum(res["fullwidth"]), sum(res["grouped"])
    return {"update_s_median": {m: statistics.median(res[m]) for m in ("fullwidth", "grouped")},
            "update_s_total": {"fullwidth": t_full, "grouped": t_grp},
            "speedup": t_full / t_grp, "policy_cells": res["cells"],
            "targets_s_median": {m: statistics.median(res["targets"][m])
                                 for m in ("fullwidth", "grouped")},
            "batch_width_median": statistics.median(res["width"]),
            "max_rel_weight_diff": diff, "compiles_while_timed": timed_compiles}


def add_args(p: argparse.ArgumentParser, steps_help: str = "timed steps per method and mode"
             ) -> None:
    p.add_argument("--config", default="longtail")
    p.add_argument("--steps", type=int, default=8, help=steps_help)
    p.add_argument("--skip", type=int, default=16,
                   help="T-PPO rollout windows run (no update) before the timed ones")
    p.add_argument("--out", default="results",
                   help="results dir; the warm-start cache is read from (or built in) its runs/")
    p.add_argument("--cpu-note", default="", help="the machine, recorded in the JSON")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("overrides", nargs="*", metavar="key=value")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_args(parser)
    run(parser.parse_args())
