"""What one training step reports (``Update``) and the metrics row written for it
(``step_metrics``): host-local counts summed over hosts, then turned into means."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, NamedTuple

from tppo_jax.buckets import CompileWatch
from tppo_jax.config import Config
from tppo_jax.learner.state import scheduled_lrs
from tppo_jax.parallel import multihost as mh
from tppo_jax.rollout.scheduler import TruncatedRolloutScheduler
from tppo_jax.trainer.collect import Rollout


class Reshard(NamedTuple):
    """One move of the policy into the decode layout: its wall time (until the copy is
    on the devices) and the bytes of the copy."""

    seconds: float
    bytes: int


@dataclass
class Update:
    """What one step's updates report."""

    pstats: dict[str, Any]  # policy stats (empty during critic warm-up)
    vstats: dict[str, Any]
    width: int  # the batch's columns (a width bucket: the widest row group)
    value_rows: int  # rows the critic trained on (0: none finished anywhere)
    policy_cells: int  # rows x columns the policy's forward passes ran over (0: none)
    value_cells: int  # the same for the critic
    n_compiles: int  # update-side compiles and their seconds
    compile_s: float
    t_update: float
    reshard: Reshard | None = None  # the policy's move to the decode layout (None: none)


def _merge_counts(per_host: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for counts in per_host:
        for k, v in counts.items():
            out[k] = out.get(k, 0) + int(v)
    return out


def step_metrics(cfg: Config, step: int, roll: Rollout, upd: Update,
                 sched: TruncatedRolloutScheduler, watch: CompileWatch, train_time: float
                 ) -> dict[str, Any]:
    """The metrics row of ``step`` (its rollout ``roll``, its updates ``upd``; ``sched``,
    ``watch``: the run's scheduler and compile counter); ``train_time``: the training
    wall-clock before this step."""
    rb, fin, pstats, vstats = roll.rb, roll.fin, upd.pstats, upd.vstats
    resp_len = rb.total_len - rb.prompt_len
    tot = mh.sum_over_hosts({
        "fin": len(fin), "reward": roll.reward[fin].sum(),
        "correct": roll.correct[fin].sum(), "resp_len": resp_len[fin].sum(),
        "rows": sched.B, "tokens": rb.window_len.sum(), "idle": roll.idle})
    top = mh.max_over_hosts({"resp_len": resp_len.max(), "window": rb.window_len.max()})
    counts = _merge_counts(mh.gather_json({k: int(v) for k, v in roll.counts.items()}))
    sched_m = mh.sum_over_hosts(sched.step_metrics())
    nfin = max(tot["fin"], 1.0)
    c_roll, c_upd, t0 = roll.c_roll, upd.compile_s, roll.t0
    return {
        "reward_mean": tot["reward"] / nfin,
        "accuracy": 100.0 * tot["correct"] / nfin,  # percent, as every accuracy
        "finished_frac": tot["fin"] / tot["rows"],
        "finished": int(tot["fin"]),
        "response_len_mean": tot["resp_len"] / nfin,
        "response_len_max": int(top["resp_len"]),
        "occupancy": tot["tokens"] / max(1.0, cfg.rollout.slots * top["window"]),
        **scheduled_lrs(cfg.optim, step),
        "policy_loss": float(pstats.get("policy_loss", 0.0)),
        **{k: float(v) for k, v in pstats.items() if k != "policy_loss"},
        **{k: float(v) for k, v in vstats.items()},  # none without a critic
        **{f"grade_{k}": v for k, v in counts.items()},
        "tokens": int(tot["tokens"]),
        "idle_slots": int(tot["idle"]),
        **{f"sched_{k}": v for k, v in sched_m.items()},
        # Compile seconds are split out of the phase they happened in.
        "time_rollout_s": roll.t_roll - c_roll, "time_grading_s": roll.t_grade,
        "time_update_s": upd.t_update - c_upd, "time_compile_s": c_roll + c_upd,
        "compiles": roll.n_roll + upd.n_compiles, "compiles_total": watch.total_count,
        # What the updates ran on (the cost model's update tokens: rows x width).
        "update_width": upd.width,
        "value_rows": upd.value_rows,
        "policy_cells": upd.policy_cells,
        "value_cells": upd.value_cells,
        **{f"compiled_shapes_{k}": v for k, v in watch.sizes().items()},
        **({"reshard_s": upd.reshard.seconds, "reshard_gb": upd.reshard.bytes / 1e9}
           if upd.reshard is not None else {}),
        "tokens_per_s": tot["tokens"] / max(time.time() - t0, 1e-9),
        "train_time_s": train_time + (time.time() - t0),
    }
