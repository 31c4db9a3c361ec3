"""Where a step's update time goes (the critic's targets pass, the policy's update, the
critic's update), and what ``algo.detach_prefix`` saves of the policy's.

T-PPO trains a continuation's current window only, but its policy update ran a forward and
a backward pass over the row's whole prefix (prompt and every earlier window): on the
long-tail task a row in its 8th window paid for ~500 columns to train 64. With
``algo.detach_prefix`` each row group runs the columns before its rows' windows forward
only (``models/transformer.py``'s ``grad_from``).

Here, on the same rollout batches (the warm-started policy's; T-PPO after ``--skip``
windows, so its slots hold continuations of every age as in training; PPO with l = L), each
piece is timed on its own from the same weights, blocked, after an untimed run that compiles
what the batch meets (``compiles_while_timed`` must be 0). Per method: the median and total
seconds of each piece; the policy's forward cells (rows x columns, padding included) and
the cells its backward covers, full and detached; and how the detached step compares with
the full one (the cosine of the two parameter moves; their reported losses must agree,
since the forward's values are the same). Writes ``results/update_split.json``.

    tppo bench update-split --config longtail --steps 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

PIECES = ("targets", "policy", "policy_detached", "value")


def _timed(watch, fn, *args, **kw) -> tuple[object, float, int]:
    """``fn(*args(copied), **kw)`` run untimed (it compiles), then timed: ``(result,
    seconds, compiles while timed)``. The arguments are copied for each call (the updates
    donate their inputs)."""
    import jax
    import jax.numpy as jnp

    def fresh():
        return jax.block_until_ready(jax.tree.map(jnp.copy, args))

    jax.block_until_ready(fn(*fresh(), **kw))
    watch.take()
    inputs = fresh()
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*inputs, **kw))
    return out, time.perf_counter() - t0, watch.take()[0]


def _move(new, old) -> np.ndarray:
    """The parameter move ``new - old`` as one flat vector."""
    import jax

    return np.concatenate([np.ravel(a - b) for a, b in zip(
        jax.tree.leaves(jax.device_get(new)), jax.tree.leaves(jax.device_get(old)),
        strict=True)])


def _fns(cfg, models, txs, mesh, window: int) -> dict:
    """The trainer's jitted pieces, with the policy's update built twice (prefix trained /
    forward only)."""
    import dataclasses

    from tppo_jax.train.step import StepConfig
    from tppo_jax.train.targets import make_targets
    from tppo_jax.train.update import make_updater

    pdef, p0, vdef, v0 = models
    (tx_p, opt_p), (tx_v, opt_v) = txs
    base = StepConfig.from_config(cfg, window)
    scfg = {d: dataclasses.replace(base, algo=dataclasses.replace(cfg.algo, detach_prefix=d))
            for d in (False, True)}
    pol = {d: make_updater("policy", pdef, tx=tx_p, cfg=scfg[d], mesh=mesh, params=p0,
                           opt_state=opt_p) for d in (False, True)}
    return {"targets": make_targets(vdef, scfg[False], mesh=mesh, params=v0),
            "policy": pol[False], "policy_detached": pol[True],
            "value": make_updater("value", vdef, tx=tx_v, cfg=scfg[False], mesh=mesh,
                                  params=v0, opt_state=opt_v)}


def _time_method(cfg, models, txs, mesh, window: int, batches, ref) -> dict:
    """Every batch's pieces timed from the same weights; per-piece seconds, cells and the
    detached step's agreement with the full one."""
    from tppo_jax.train.batch import batch_arrays, row_plan, shuffle_keys
    from tppo_jax.train.shapes import CompileWatch
    from tppo_jax.train.update import plan_cells

    _, p0, _, v0 = models
    (_, opt_p), (_, opt_v) = txs
    fns = _fns(cfg, models, txs, mesh, window)
    res = {k: [] for k in (*PIECES, "cos", "loss_rel_diff")}
    cells = {f"policy_{pas}_{mode}": 0 for pas in ("forward", "backward")
             for mode in ("full", "detached")}
    cells["value"] = 0
    timed_compiles = 0
    extra = {"ref": ref} if fns["policy"].uses_ref else {}
    with CompileWatch() as watch:
        for i, (rb, reward, correct) in enumerate(batches):
            arrays = batch_arrays(rb, reward, correct, mesh)
            width = int(arrays["tokens"].shape[1])
            positive = rb.finished & correct if cfg.algo.nll_coef > 0 else None
            rp = row_plan(rb, shuffle_keys(cfg, i, rb.tokens.shape[0]), positive)
            lengths, fin, shuffle = rp.lengths, rp.finished, rp.shuffle
            tgt, dt, n = _timed(watch, fns["targets"], v0, arrays, lengths=lengths)
            batch, timed_compiles = {**arrays, **tgt}, timed_compiles + n
            res["targets"].append(dt)
            ends = {}
            for name in ("policy", "policy_detached"):
                upd = fns[name]
                plan = upd.plan(lengths, width, shuffle, train_start=rp.train_start)
                ends[name], dt, n = _timed(watch, upd, p0, opt_p, batch, plan=plan, **extra)
                res[name].append(dt)
                timed_compiles += n
                mode = "full" if name == "policy" else "detached"
                cells[f"policy_backward_{mode}"] += sum(
                    g.rows.size * (g.width - g.grad_from) for mb in plan for g in mb.groups)
                cells[f"policy_forward_{mode}"] += plan_cells(plan)
            a, b = _move(ends["policy"][0], p0), _move(ends["policy_detached"][0], p0)
            res["cos"].append(float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30)))
            la, lb = (float(ends[k][2]["policy_loss"]) for k in ("policy", "policy_detached"))
            res["loss_rel_diff"].append(abs(la - lb) / max(abs(la), 1e-12))
            if len(fin):
                plan = fns["value"].plan(lengths, width, shuffle, fin)
                _, dt, n = _timed(watch, fns["value"], v0, opt_v, batch, plan=plan)
                res["value"].append(dt)
                timed_compiles += n
                cells["value"] += plan_cells(plan)
    return _summary(res, cells, timed_compiles)


def _summary(res: dict, cells: dict, timed_compiles: int) -> dict:
    med = {k: statistics.median(res[k]) if res[k] else 0.0 for k in PIECES}
    tot = {k: sum(res[k]) for k in PIECES}
    return {"seconds_median": med, "seconds_total": tot,
            "policy_share_of_update": tot["policy"] / (tot["policy"] + tot["value"]),
            "detached_policy_speedup": tot["policy"] / tot["policy_detached"],
            "update_speedup": (tot["policy"] + tot["value"])
            / (tot["policy_detached"] + tot["value"]),
            "cells": cells, "step_cosine_min": min(res["cos"]),
            "step_cosine_median": statistics.median(res["cos"]),
            "loss_rel_diff_max": max(res["loss_rel_diff"]),
            "compiles_while_timed": timed_compiles}


def run(args: argparse.Namespace) -> dict:
    from tppo_jax.benchmarks.prefill_width import write_result
    from tppo_jax.benchmarks.update_groups import update_setup
    from tppo_jax.train.state import commit_to_mesh

    cfg, mesh, models, txs, make_batches = update_setup(args)
    r, L = cfg.rollout, cfg.rollout.max_response_len
    txs = tuple((tx, commit_to_mesh(tx.init(params), mesh))
                for tx, params in zip(txs, (models[1], models[3]), strict=True))
    ref = models[1] if cfg.algo.kl_coef > 0 else None  # the KL's reference: the start
    out: dict = {"config": args.config, "overrides": list(args.overrides),
                 "slots": r.slots, "L": L, "window": r.window, "steps": args.steps,
                 "cpu": args.cpu_note, "methods": {}}
    for name, window in (("tppo", r.window), ("ppo", L)):
        batches = make_batches(window, args.skip if name == "tppo" else 1)
        out["methods"][name] = s = _time_method(cfg, models, txs, mesh, min(window, L),
                                                batches, ref)
        m, c = s["seconds_median"], s["cells"]
        print(f"{name}: per step (median) targets {m['targets']:.2f} s, policy "
              f"{m['policy']:.2f} s -> {m['policy_detached']:.2f} s detached "
              f"({s['detached_policy_speedup']:.2f}x; backward cells "
              f"{c['policy_backward_full']} -> {c['policy_backward_detached']}), critic "
              f"{m['value']:.2f} s; the whole update {s['update_speedup']:.2f}x; step cosine "
              f"median {s['step_cosine_median']:.3f} (min {s['step_cosine_min']:.3f})")
    return write_result(out, args.out, "update_split.json")


def add_args(p: argparse.ArgumentParser) -> None:
    from tppo_jax.benchmarks.update_groups import add_args as update_args

    update_args(p, steps_help="timed steps per method")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_args(parser)
    run(parser.parse_args())
