"""T-PPO vs PPO time-to-target from per-token costs: measured here, projected to the paper.

A training step of either method costs

    decode_steps * t_step  +  kv_reads * t_kv                       (rollout)
    + policy_tokens * t_policy * (1 + TARGETS)  +  value_tokens * t_value
    + (policy_sq * (1 + TARGETS) + value_sq) * t_attn                (update)
    + steps * t_reshard  +  finished * t_grade

where the counts come from replaying the rollout schedule (``replay``: every window each
slot decodes up to ``l`` tokens, the window lasts as long as its busiest slot, finished slots
take the next prompt; ``l = L`` is synchronous PPO) on a response-length distribution. The
replay runs ``--batches`` (32) batches' worth of samples and reports the windows with every
slot busy (``steady``: the queue still feeds every finished slot) apart from the ``drain``
(the windows after the queue ran dry, which only a finite replay has); the projection uses
the steady state. ``*_sq`` counts sum ``T (T + 1)`` over trained rows of ``T`` tokens: the
causal attention's FLOPs, ``6 layers d_attn T (T + 1)`` per row forward + backward.

Unit costs come from

- this machine: ``measure`` reads the per-step metrics of a T-PPO and a PPO run (e.g. the
  runs of ``tppo bench tppo-vs-ppo --config longtail``): seconds per decode step of all
  slots, per update cell (forward + backward; the targets pass a third of one), per graded
  sample. Attention is inside the measured cell cost there. The model is checked against the
  same runs (``cpu_check``), phase by phase.
- an accelerator (``accelerator_units``): a decode step costs ``--step-floor-ms`` (launch,
  the tensor-parallel all-reduces, sampling: independent of the batch) plus the larger of
  reading the weights once per decode replica of ``--decode-tp`` chips and ``2 N_mm`` FLOPs
  per slot; each decoded token reads its KV prefix; an update token is ``6 N_mm`` FLOPs
  (``N_mm``: the matmul params, the input embedding being a lookup; the critic has no LM head)
  plus attention, at ``--mfu``; after each update the policy is resharded from the training
  layout into the decode layout (``t_reshard``, ``--reshard-s`` or its ICI estimate); grading
  is the measured CPU cost per sample over ``--grader-workers`` processes. With ``--compiled
  FILE`` the decode and update FLOPs and bytes come from compiled programs (``load_compiled``;
  at paper scale two small unrolled compiles extrapolated per layer, ``compiled_units.py``).

Both methods are assumed to reach the target after the same number of finished samples
(``--sample-ratio``), so the time-to-target ratio is the ratio of seconds per finished
sample, written as ``1 / (f / r_d + (1 - f) r_u)`` (``projection``). Writes
``results/cost_model.json``. The replay, the unit costs and the projection are in ``costs.py``;
this module measures from runs and is the command.

    tppo bench cost-model --config longtail --cpu-units results/cost_model.json \\
        --measured results/tppo_vs_ppo_longtail.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from tppo_jax.benchmarks.accelerator import PEAKS
from tppo_jax.benchmarks.costs import (
    ATTN_TRAIN,
    TARGETS,
    Counts,
    Units,
    accelerator_units,
    closed,
    compare,
    load_compiled,
    lognormal_lengths,
    matmul_params,
    projection,
    speedup_at,
    step_costs,
)

# Published rollout shares of a synchronous step (phase times), to set beside the model's f.
PUBLISHED_SHARES = [
    {"source": "verl fully-async README, 7B DAPO, 28k responses", "f": 0.41},
    {"source": "verl fully-async README, 7B DAPO, 28k responses", "f": 0.50},
    {"source": "verl fully-async README, Qwen3-30B-A3B", "f": 0.70},
    {"source": "marin #8653, 235B", "f": 0.60},
    {"source": "tpu-inference PR #3165, decode share", "f": 0.64},
]


def run_window(run_dir: Path, default: int) -> int:
    """The window the T-PPO run in ``run_dir`` trained with (its ``config.yaml``), so the
    CPU check replays the schedule the measured run had, whatever the config says now;
    ``default`` when the run dir holds no config."""
    from tppo_jax.config import load_config

    path = run_dir / "config.yaml"
    return load_config(path).rollout.window if path.exists() else default


def measure(run_dir: Path, slots: int) -> dict:
    """Unit costs from a run's metrics.jsonl (medians over its steps; compile time excluded:
    the trainer reports it apart)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r and "update_width" in r]
    if not steps:
        raise SystemExit(f"{run_dir}: no steps with update_width (needs this version's trainer)")
    t_step, t_upd, t_grade = [], [], []
    for r in steps:
        decode_steps = r["tokens"] / max(r["occupancy"] * slots, 1e-9)
        t_step.append(r["time_rollout_s"] / max(decode_steps, 1.0))
        w = r["update_width"]
        # Token cells the updates ran over: the row groups' (this trainer) or, in runs that
        # predate them, every row at the batch width. The targets pass (forward only, ~1/3
        # of forward + backward) runs at the batch width.
        policy = r.get("policy_cells", slots * w) if "pg_loss" in r else 0
        value = r.get("value_cells", r["value_rows"] * w)
        t_upd.append(r["time_update_s"] / (policy + slots * w * TARGETS + value))
        if r.get("finished"):
            t_grade.append(r["time_grading_s"] / r["finished"])
    return {"t_step": statistics.median(t_step), "t_kv": 0.0,
            "t_update": statistics.median(t_upd),
            "t_grade": statistics.median(t_grade) if t_grade else 0.0, "steps": len(steps)}


def cpu_units(per_run: dict) -> Units:
    """One unit cost per phase: the mean of the runs' (same model and machine). Attention is
    inside the measured cell cost; the CPU trainer decodes in its training layout."""
    m = {k: statistics.fmean(u[k] for u in per_run.values())
         for k in ("t_step", "t_kv", "t_update", "t_grade")}
    return Units(t_step=m["t_step"], t_kv=m["t_kv"], t_policy=m["t_update"],
                 t_value=m["t_update"], t_attn=0.0, t_reshard=0.0, t_grade=m["t_grade"])


def measured_from_runs(runs: Path, seed: int) -> dict:
    """Per-phase seconds per finished sample of the measured runs (train time, compile
    excluded), and their occupancy."""
    out = {}
    for m in ("tppo", "ppo"):
        rows = [json.loads(x) for x in (runs / f"{m}-seed{seed}" / "metrics.jsonl")
                .read_text().splitlines()]
        steps = [r for r in rows if "reward_mean" in r]
        fin = max(sum(r.get("finished", 0) for r in steps), 1)
        out[m] = {"decode": sum(r["time_rollout_s"] for r in steps) / fin,
                  "grading": sum(r["time_grading_s"] for r in steps) / fin,
                  "update": sum(r["time_update_s"] for r in steps) / fin,
                  "occupancy": statistics.fmean(r["occupancy"] for r in steps),
                  "update_per_step": statistics.fmean(r["time_update_s"] for r in steps),
                  "steps_per_sample": len(steps) / fin,
                  "tokens_per_sample": sum(r["tokens"] for r in steps) / fin}
    return _with_totals(out)


def measured_from_summary(path: Path, seed: int) -> dict:
    """The same from a ``tppo bench tppo-vs-ppo`` summary JSON (its ``time_split_s``,
    ``finished_samples`` and ``occupancy_mean`` of seed ``seed``)."""
    d = json.loads(Path(path).read_text())["seeds"][str(seed)]
    out = {}
    for m in ("tppo", "ppo"):
        s, fin = d[m]["time_split_s"], d[m]["finished_samples"]
        out[m] = {"decode": s["rollout"] / fin, "grading": s["grading"] / fin,
                  "update": s["update"] / fin, "occupancy": d[m]["occupancy_mean"],
                  "update_per_step": s["update"] / d[m]["steps"],
                  "steps_per_sample": d[m]["steps"] / fin,
                  "tokens_per_sample": d[m]["tokens_generated"] / fin}
    return _with_totals(out)


def _with_totals(out: dict) -> dict:
    for m in ("tppo", "ppo"):
        o = out[m]
        o["total"] = o["per_finished_sample"] = o["decode"] + o["grading"] + o["update"]
    out["projection"] = projection(out["ppo"], out["tppo"])
    out["ratio"] = out["ppo"]["per_finished_sample"] / out["tppo"]["per_finished_sample"]
    return out


def explain_gap(predicted: dict, measured: dict) -> dict:
    """Which of ``f``, ``r_d``, ``r_u`` carries the gap: the speedup with each of the
    measured terms put into the prediction in turn, and the per-sample phase seconds."""
    p, m = predicted["projection"], measured["projection"]
    out = {"predicted": {k: p[k] for k in ("f", "r_d", "r_u", "speedup")},
           "measured": {k: m[k] for k in ("f", "r_d", "r_u", "speedup")}}
    for k in ("f", "r_d", "r_u"):
        q = {**out["predicted"], k: m[k]}
        out[f"with_measured_{k}"] = speedup_at(q["f"], q["r_d"], q["r_u"])
    q = {**out["measured"], "r_u": p["r_u"]}
    out["with_measured_f_r_d"] = speedup_at(q["f"], q["r_d"], q["r_u"])
    out["per_sample_s"] = {meth: {ph: {"predicted": predicted[meth]["seconds"][ph] /
                                       max(predicted[meth]["counts"]["finished"], 1),
                                       "measured": measured[meth][ph]}
                                  for ph in ("decode", "update", "grading")}
                           for meth in ("tppo", "ppo")}
    return out


def run(args: argparse.Namespace) -> dict:
    from tppo_jax.config import load_config
    from tppo_jax.plan import ARCHITECTURES

    out: dict = {"command": _command(args), "assumptions": vars(args).copy()}
    cpu = load_config(args.config)
    r = cpu.rollout
    runs = Path(args.runs) if args.runs else None
    sample_ratio = args.sample_ratio if args.sample_ratio is not None else 1.0
    if runs is not None and all((runs / f"{m}-seed{args.seed}" / "metrics.jsonl").exists()
                                for m in ("tppo", "ppo")):
        per_run = {m: measure(runs / f"{m}-seed{args.seed}", r.slots) for m in ("tppo", "ppo")}
        measured = measured_from_runs(runs, args.seed)
        window = run_window(runs / f"tppo-seed{args.seed}", r.window)
        source = f"run dirs {runs}"
    elif args.cpu_units and args.measured:
        per_run = json.loads(Path(args.cpu_units).read_text())["cpu_units"]["per_run"]
        measured = measured_from_summary(Path(args.measured), args.seed)
        window = json.loads(Path(args.measured).read_text()).get("window", r.window)
        source = f"units {args.cpu_units}, measured split {args.measured} (seed {args.seed})"
    else:
        raise SystemExit("needs --runs DIR with tppo-seed<N>/ and ppo-seed<N>/ run dirs, or "
                         "--cpu-units COST_MODEL_JSON and --measured TPPO_VS_PPO_JSON")
    unit = cpu_units(per_run)
    out["cpu_units"] = {"source": source, "per_run": per_run, "used": asdict(unit)}
    lengths = _task_lengths(cpu, runs, args.samples)
    out["cpu_window"] = window
    pred = {mode: compare(lengths, r.slots, window, r.max_response_len, args.cpu_prompt_len,
                          unit, mode == "packed", sample_ratio) for mode in ("padded", "packed")}
    out["cpu_check"] = {"predicted": pred, "measured": measured,
                        "gap": explain_gap(pred["padded"], measured),
                        "closed": closed(lengths, r.slots, window, r.max_response_len,
                                         args.cpu_prompt_len, per_run, measured)}
    out["paper_scale"] = paper_scale(args, ARCHITECTURES[args.arch], unit.t_grade, sample_ratio)
    path = Path(args.out) / "cost_model.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    _print(out)
    return out


def paper_scale(args: argparse.Namespace, arch, t_grade: float, sample_ratio: float) -> dict:
    slots = args.prompts * args.group
    compiled = load_compiled(Path(args.compiled)) if args.compiled else None

    def units(**kw) -> Units:
        a = {"decode_tp": args.decode_tp, "step_floor_s": args.step_floor_ms / 1e3,
             "reshard_s": args.reshard_s, "ici_bw": args.ici_gbs * 1e9, "compiled": compiled,
             **kw}
        mfu, bw_eff = a.pop("mfu", args.mfu), a.pop("bw_eff", args.bw_eff)
        return accelerator_units(arch, slots, args.chips, args.device, mfu, bw_eff,
                                 t_grade, args.grader_workers, **a)

    acc = units()
    n_pol, n_val = matmul_params(arch)
    big = lognormal_lengths(slots * args.batches, args.median_frac * args.L, args.sigma, args.L)
    pages = page_occupancy(Path(args.page_replay))

    def cmp(lengths=big, u=acc, mode="packed", occ=pages["demand"]) -> dict:
        return compare(lengths, slots, args.l, args.L, args.prompt_len, u, mode == "packed",
                       sample_ratio, occupancy=occ)

    out: dict = {
        "arch": args.arch, "params": arch.n_params, "matmul_params": {"policy": n_pol,
                                                                      "critic": n_val},
        "units_from": ("decode: matmuls + fixed cost, attention by live KV bytes; update: "
                       + (f"compiled matmul FLOPs ({compiled.source})" if compiled else
                          "6 N_mm FLOPs") + " + analytic attention (forward, flash backward, "
                       "remat)"),
        "slots": slots, "L": args.L, "window": args.l, "batches": args.batches,
        "units": asdict(acc), "lengths": _stats(big), "pages": pages,
        "packed": cmp(), "padded": cmp(mode="padded")}
    p = out["packed"]["projection"]
    out["headline"] = {"mode": "packed", "pages": "on demand, shipped pool (page replay)", **p,
                       "occupancy": {m: out["packed"][m]["occupancy"] for m in ("tppo", "ppo")},
                       "decode_step_ratio": out["packed"]["decode_step_ratio"]}
    out["by_pages"] = {
        "unlimited pages (what the model assumed before)": cmp(occ=None)["projection"],
        # not a comparison: the window rule starves PPO (l = L) of pages far more than T-PPO
        "whole-window reservation, shipped pool (the engine today): UNFAIR, PPO starved of "
        "pages": cmp(occ=pages["window"])["projection"]}
    out["miscounts"] = miscounts(arch, args, out["packed"])
    out["published_shares"] = [
        {**s, "speedup_at_model_r_d_r_u": speedup_at(s["f"], p["r_d"], p["r_u"])}
        for s in PUBLISHED_SHARES]
    # f that 2.5x needs at the model's r_d and r_u (None: beyond reach, r_d <= 2.5).
    den = 1 / p["r_d"] - p["r_u"]
    out["f_for_2_5x"] = (0.4 - p["r_u"]) / den if p["r_d"] > 2.5 and den else None
    out["sensitivity"] = sensitivity(args, slots, units, sample_ratio)
    out["other"] = {
        **{f"step_floor_ms={ms}": cmp(u=units(step_floor_s=ms / 1e3))["projection"]
           for ms in (0.0, 10.0, 30.0)},
        "decode_tp=1 (a full copy of the weights read by every chip per step)":
            cmp(u=units(decode_tp=1))["projection"]}
    if compiled is not None:
        # The compiled decode program's FLOPs and bytes, for comparison only: on this CPU's
        # compile its attention is the reference kernel over every slot's whole page table
        # and bytes_accessed counts whole pool operands, neither what a TPU kernel does.
        flops, bw = PEAKS[args.device]
        out["decode_step_s"] = {
            "used: matmuls + fixed cost": acc.t_step,
            "compiled program (not used)": args.step_floor_ms / 1e3 + max(
                compiled.decode_bytes_per_step / (bw * args.bw_eff),
                compiled.decode_flops_per_token * slots / (flops * args.mfu))}
    return out


def page_occupancy(path: Path) -> dict:
    """Each method's steady-state slot occupancy from a page replay (``tppo bench
    page-replay``, ``results/page_replay.json``): the on-demand allocator (the headline) and
    the whole-window reservation, both with the shipped pool."""
    try:
        runs = json.loads(path.read_text())["runs"]
        occ = {a: {m: runs[f"{m}/{a}/shipped"]["steady"]["occupancy"] for m in ("tppo", "ppo")}
               for a in ("demand", "window")}
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"{path}: needs a page replay of both methods and both allocators "
                         f"with the shipped pool (`tppo bench page-replay`): {e}") from None
    return {"source": str(path), **occ}


def sensitivity(args: argparse.Namespace, slots: int, units, sample_ratio: float) -> list:
    """The speedup over the response-length median (L/8, L/4, L/2) and the MFU / bandwidth
    derates; each median's occupancy from a page replay of one of the paper pool's page
    blocks (on demand, the shipped pool's pages per block: ``page_replay.block_occupancy``)."""
    from tppo_jax.benchmarks.page_replay import block_occupancy

    derates = [(args.mfu, args.bw_eff), (0.3, 0.5), (0.5, 0.85)]
    rows = []
    for frac in args.sensitivity_medians:
        lengths = lognormal_lengths(slots * args.batches, frac * args.L, args.sigma, args.L)
        occ = {m: block_occupancy(args.pool_config, frac * args.L, args.sigma, args.prompt_len,
                                  w) for m, w in (("tppo", args.l), ("ppo", args.L))}
        row = {"median_frac": frac, "median": frac * args.L, "occupancy": occ}
        for mfu, bw in derates:
            pr = compare(lengths, slots, args.l, args.L, args.prompt_len,
                         units(mfu=mfu, bw_eff=bw), True, sample_ratio, occupancy=occ)
            row[f"mfu={mfu},bw_eff={bw}"] = {k: pr["projection"][k]
                                             for k in ("f", "r_d", "r_u", "speedup")}
        rows.append(row)
    return rows


def miscounts(arch, args: argparse.Namespace, packed: dict) -> dict:
    """What the update's hand formula corrects, at the replayed counts: the input embedding
    (a lookup) and an LM head on the critic once inside ``6 N``, attention left out."""
    flops, _ = PEAKS[args.device]
    n_pol, n_val = matmul_params(arch)
    per_token = 6 / (args.chips * flops * args.mfu)
    new = Units(0.0, 0.0, n_pol * per_token, n_val * per_token,
                ATTN_TRAIN * arch.num_layers * arch.num_heads * arch.head_dim
                / (args.chips * flops * args.mfu), 0.0, 0.0)
    old = replace(new, t_policy=arch.n_params * per_token, t_value=arch.n_params * per_token,
                  t_attn=0.0)
    out = {"policy_6N_over_6N_matmul": arch.n_params / n_pol,
           "critic_6N_over_6N_matmul": arch.n_params / n_val}
    for m in ("tppo", "ppo"):
        c = Counts(**packed[m]["counts"])
        s_new = step_costs(c, new, True)["update"]
        s_attn = step_costs(c, replace(new, t_policy=0.0, t_value=0.0), True)["update"]
        out[m] = {"attention_share_of_update": s_attn / s_new,
                  "old_formula_over_new": step_costs(c, old, True)["update"] / s_new}
    return out


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces ``args`` (the options away from their defaults)."""
    p = argparse.ArgumentParser()
    add_args(p)
    default = vars(p.parse_args([]))
    opts = [f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
            if v != default.get(k, v)]
    return " ".join(["tppo bench cost-model", *opts])


def _print(out: dict) -> None:
    ps, cc = out["paper_scale"], out["cpu_check"]
    h = ps["headline"]
    print(f"paper scale ({ps['arch']}, {ps['slots']} slots, L = {ps['L']}, l = {ps['window']}, "
          f"{ps['batches']} batches, steady state, {h['mode']}; units: {ps['units_from']})")
    print(f"  occupancy T-PPO {h['occupancy']['tppo']:.3f}, PPO {h['occupancy']['ppo']:.3f}; "
          f"decode steps per sample PPO / T-PPO {h['decode_step_ratio']:.2f}")
    print(f"  f = {h['f']:.3f}  r_d = {h['r_d']:.3f}  r_u = {h['r_u']:.3f}  ->  "
          f"speedup = 1 / (f / r_d + (1 - f) r_u) = {h['speedup']:.3f}x "
          f"(padded: {ps['padded']['projection']['speedup']:.3f}x)")
    print("  published rollout shares f, speedup at the model's r_d and r_u:")
    for s in ps["published_shares"]:
        print(f"    f = {s['f']:.2f}  {s['speedup_at_model_r_d_r_u']:.2f}x  {s['source']}")
    g = cc["gap"]
    print(f"CPU check (l = {out['cpu_window']}): predicted {g['predicted']['speedup']:.3f}x, "
          f"measured {g['measured']['speedup']:.3f}x")
    for k in ("f", "r_d", "r_u"):
        print(f"  {k}: predicted {g['predicted'][k]:.3f}, measured {g['measured'][k]:.3f}; "
              f"speedup with the measured {k}: {g[f'with_measured_{k}']:.3f}x")
    c = cc["closed"]
    print(f"  closed (measured occupancy and seconds per update step): "
          f"{c['projection']['speedup']:.3f}x, residual {c['residual']:+.1%}")


def _task_lengths(cfg, runs: Path | None, n: int) -> np.ndarray:
    """The CPU task's solution lengths in warm-start tokens (queue order): the runs'
    warm-start tokenizer, or one trained afresh the way the warm-start trains it (the same
    corpus and settings give the same pieces)."""
    import tempfile

    from tppo_jax.data.run_data import synthetic_task
    from tppo_jax.models.tokenizer import Tokenizer

    tok_file = next(runs.glob("warmstart-*/tokenizer.model"), None) if runs else None
    if tok_file is not None:
        tok = Tokenizer.load(tok_file)
    else:
        from tppo_jax.weights import warmstart as ws

        texts = synthetic_task(cfg).teacher_corpus(ws.TEACHER_SIZE,
                                                   cfg.train.warmstart_wrong_step_frac,
                                                   cfg.train.warmstart_no_format_frac)
        with tempfile.TemporaryDirectory() as d:
            tok = ws.train_sentencepiece(texts, Path(d) / "tokenizer", vocab_size=128)
    return np.array([len(tok.encode(e.solution)) + 1 for e in synthetic_task(cfg).sample(n)])


def _stats(x: np.ndarray) -> dict:
    return {"median": float(np.median(x)), "p90": float(np.percentile(x, 90)),
            "p99": float(np.percentile(x, 99)), "max": int(x.max()), "mean": float(x.mean())}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="longtail", help="the CPU runs' config")
    p.add_argument("--runs", default=None,
                   help="folder with tppo-seed<N>/ and ppo-seed<N>/ run dirs (and the warm-start)")
    p.add_argument("--cpu-units", default=None,
                   help="without run dirs: a cost_model.json whose cpu_units.per_run to use")
    p.add_argument("--measured", default=None,
                   help="without run dirs: a tppo-vs-ppo summary JSON (the measured split)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", type=int, default=2000, help="CPU task samples to replay")
    p.add_argument("--cpu-prompt-len", type=int, default=40, help="the CPU task's prompt tokens")
    p.add_argument("--sample-ratio", type=float, default=None,
                   help="PPO / T-PPO finished samples to target (default 1: equal efficiency)")
    p.add_argument("--arch", default="qwen2.5-32b")
    p.add_argument("--device", default="TPU v5p", choices=sorted(PEAKS))
    p.add_argument("--chips", type=int, default=256)
    p.add_argument("--mfu", type=float, default=0.4, help="update (and decode compute) MFU")
    p.add_argument("--bw-eff", type=float, default=0.7,
                   help="achieved / peak HBM (and ICI) bandwidth")
    p.add_argument("--decode-tp", type=int, default=8,
                   help="chips per decode replica (tensor-parallel; each reads its weights "
                        "once per decode step)")
    p.add_argument("--step-floor-ms", type=float, default=3.0,
                   help="per decode step, independent of the batch: launch, 2 all-reduces per "
                        "layer in the replica, sampling")
    p.add_argument("--reshard-s", type=float, default=None,
                   help="seconds per training step to move the policy into the decode layout "
                        "(default: its ICI estimate)")
    p.add_argument("--ici-gbs", type=float, default=600.0,
                   help="ICI bandwidth per chip, GB/s (v5p: 4800 Gbps)")
    p.add_argument("--compiled", default=None,
                   help="compile-path JSON (results/compiled_<config>_<topology>.json) for the "
                        "decode and update FLOPs / bytes; hand formulas without it")
    p.add_argument("--grader-workers", type=int, default=32 * 64)
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--group", type=int, default=16)
    p.add_argument("--batches", type=int, default=32, help="steps' worth of samples replayed")
    p.add_argument("--L", type=int, default=24576)
    p.add_argument("--l", type=int, default=8192)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--median-frac", type=float, default=0.125,
                   help="median response length / L of the log-normal lengths")
    p.add_argument("--sigma", type=float, default=0.9)
    p.add_argument("--page-replay", default="results/page_replay.json",
                   help="occupancy under the paged pool (`tppo bench page-replay`)")
    p.add_argument("--sensitivity-medians", type=float, nargs="*", default=[0.125, 0.25, 0.5],
                   help="response-length medians / L of the sensitivity table")
    p.add_argument("--pool-config", default="configs/paper_qwen25_32b.yaml",
                   help="the paged pool the sensitivity table's page replays use")
    p.add_argument("--out", default="results")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_args(parser)
    run(parser.parse_args())
