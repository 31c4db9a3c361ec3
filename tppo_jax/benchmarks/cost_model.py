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
``results/cost_model.json``.

    tppo bench cost-model --config longtail --cpu-units results/cost_model.json \\
        --measured results/tppo_vs_ppo_longtail.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np

from tppo_jax.benchmarks.accelerator import PEAKS

# The targets pass (old log-probs and values before the update) as a share of one forward +
# backward over the policy's rows: a forward is about a third of forward + backward.
TARGETS = 1 / 3
# Causal attention FLOPs per layer of a trained row of T tokens, in units of d T (T + 1)
# (d = heads x head_dim): the forward is 2 (QK^T and PV over the T (T + 1) / 2 causal pairs, 2
# FLOPs a multiply-add each); a flash backward recomputes the scores (2.5 forwards); remat
# (every paper config trains with it) runs the forward once more. XLA's cost analysis counts
# the Pallas (splash) kernels as ~0 FLOPs, so the update's compiled FLOPs leave this out.
ATTN_FORWARD = 2.0
ATTN_TRAIN = ATTN_FORWARD * (1 + 2.5 + 1)
ATTN_TARGETS = ATTN_FORWARD / ATTN_TRAIN  # the targets pass: one forward

# Published rollout shares of a synchronous step (phase times), to set beside the model's f.
PUBLISHED_SHARES = [
    {"source": "verl fully-async README, 7B DAPO, 28k responses", "f": 0.41},
    {"source": "verl fully-async README, 7B DAPO, 28k responses", "f": 0.50},
    {"source": "verl fully-async README, Qwen3-30B-A3B", "f": 0.70},
    {"source": "marin #8653, 235B", "f": 0.60},
    {"source": "tpu-inference PR #3165, decode share", "f": 0.64},
]


@dataclass
class Counts:
    """Totals over a set of windows (``replay``). Update tokens: the policy trains every live
    row, the critic every finished row, either padded to the window's longest row
    (``*_padded``) or each row at its own length (``*_packed``: this trainer's row groups
    come close to it); ``*_sq_*`` sum ``T (T + 1)`` over those rows (attention)."""

    steps: int = 0
    decode_steps: int = 0
    useful_tokens: int = 0
    finished: int = 0
    kv_reads: int = 0
    policy_padded: int = 0
    policy_packed: int = 0
    value_padded: int = 0
    value_packed: int = 0
    policy_sq_padded: int = 0
    policy_sq_packed: int = 0
    value_sq_padded: int = 0
    value_sq_packed: int = 0

    def __add__(self, other: Counts) -> Counts:
        return Counts(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                         for f in fields(self)})

    def occupancy(self, slots: int) -> float:
        return self.useful_tokens / max(self.decode_steps * slots, 1)


@dataclass
class Replay:
    """``steady``: windows that start with every slot busy; ``drain``: the rest (the queue
    ran dry and slots sit idle), reported apart."""

    slots: int
    steady: Counts = field(default_factory=Counts)
    drain: Counts = field(default_factory=Counts)

    @property
    def total(self) -> Counts:
        return self.steady + self.drain


def replay(lengths: np.ndarray, slots: int, window: int, max_len: int, prompt: int) -> Replay:
    """Counts of one pass over ``lengths`` (response tokens per sample, in queue order)."""
    queue = list(np.minimum(np.asarray(lengths, np.int64), max_len)[::-1])
    rem = np.array([queue.pop() if queue else 0 for _ in range(slots)], np.int64)
    prog = np.zeros(slots, np.int64)
    out = Replay(slots)
    while rem.any():
        live = rem > 0
        t = out.steady if live.all() else out.drain
        work = np.minimum(window, rem)
        t.steps += 1
        t.decode_steps += int(work.max())
        t.useful_tokens += int(work.sum())
        t.kv_reads += int((work * (prompt + prog) + work * (work - 1) // 2).sum())
        prog = prog + work
        rem = rem - work
        width = prompt + int(prog[live].max())
        fin = live & (rem == 0)
        rows_p, rows_v = prompt + prog[live], prompt + prog[fin]
        t.finished += int(fin.sum())
        t.policy_padded += int(live.sum()) * width
        t.policy_packed += int(rows_p.sum())
        t.value_padded += int(fin.sum()) * width
        t.value_packed += int(rows_v.sum())
        t.policy_sq_padded += int(live.sum()) * width * (width + 1)
        t.policy_sq_packed += int((rows_p * (rows_p + 1)).sum())
        t.value_sq_padded += int(fin.sum()) * width * (width + 1)
        t.value_sq_packed += int((rows_v * (rows_v + 1)).sum())
        for i in np.flatnonzero(fin):  # refill
            rem[i], prog[i] = (queue.pop() if queue else 0), 0
    return out


@dataclass(frozen=True)
class Units:
    """Seconds per unit of each count: ``t_step`` per decode step of all slots (its floor
    included), ``t_kv`` per KV-prefix token read, ``t_policy`` / ``t_value`` per policy /
    critic token (forward + backward), ``t_attn`` per ``T (T + 1)`` of a trained row (0 where
    attention is inside the token costs: measured or compiled), ``t_reshard`` per training
    step, ``t_grade`` per graded sample."""

    t_step: float
    t_kv: float
    t_policy: float
    t_value: float
    t_attn: float
    t_reshard: float
    t_grade: float


def step_costs(c: Counts, u: Units, packed: bool) -> dict:
    """Seconds spent in each phase for counts ``c`` at unit costs ``u``."""
    k = "packed" if packed else "padded"
    pol, val = getattr(c, f"policy_{k}"), getattr(c, f"value_{k}")
    sq = getattr(c, f"policy_sq_{k}") * (1 + ATTN_TARGETS) + getattr(c, f"value_sq_{k}")
    out = {"decode": c.decode_steps * u.t_step + c.kv_reads * u.t_kv,
           "update": pol * (1 + TARGETS) * u.t_policy + val * u.t_value + sq * u.t_attn,
           "reshard": c.steps * u.t_reshard,
           "grading": c.finished * u.t_grade}
    out["total"] = sum(out.values())
    out["per_finished_sample"] = out["total"] / max(c.finished, 1)
    return out


def projection(ppo: dict, tppo: dict, sample_ratio: float = 1.0) -> dict:
    """``speedup = 1 / (f / r_d + (1 - f) r_u)`` from two ``step_costs`` (per finished
    sample): ``f`` PPO's rollout share of its step, ``r_d`` PPO's decode seconds over
    T-PPO's, ``r_u`` T-PPO's other seconds (update, reshard, grading) over PPO's."""
    dp, dt = ppo["decode"] / ppo["total"], tppo["decode"] / tppo["total"]
    sp, st = ppo["per_finished_sample"], tppo["per_finished_sample"]
    r_d = (dp * sp) / (dt * st) if dt else float("inf")
    r_u = ((1 - dt) * st) / ((1 - dp) * sp) if dp < 1 else float("nan")
    # Equal to 1 / (f / r_d + (1 - f) r_u) wherever that is defined.
    return {"f": dp, "r_d": r_d, "r_u": r_u, "speedup": sample_ratio * sp / st}


def speedup_at(f: float, r_d: float, r_u: float) -> float:
    return 1.0 / (f / r_d + (1 - f) * r_u)


@dataclass(frozen=True)
class Compiled:
    """Per-chip costs read from compiled programs (``load_compiled``)."""

    source: str
    decode_flops_per_token: float
    decode_bytes_per_step: float
    update_flops_per_token: float
    update_bytes_per_token: float
    value_flops_per_token: float | None = None
    value_bytes_per_token: float | None = None


def _program_role(name: str, rec: dict) -> str | None:
    """Which unit cost a compiled program gives: ``decode`` (a rollout window), ``policy`` or
    ``value`` (an update's forward + backward); None for the rest (prefill, targets, eval,
    optimizer applies)."""
    n, kind = name.lower(), str(rec.get("kind", "")).lower()
    if "apply" in n or "prefill" in n or "eval" in n or "targets" in n:
        return None
    if "decode" in n or (kind == "rollout" and "window" in n):
        return "decode"
    if kind == "value_update" or "value" in n or "critic" in n:
        return "value"
    if kind == "policy_update" or any(s in n for s in ("policy", "train", "update")):
        return "policy"
    return None


def load_compiled(path: Path) -> Compiled:
    """Unit FLOPs and bytes from a compile-path JSON (``results/compiled_<config>_<topology>
    .json``, ``tppo_jax.compile``). Its ``programs`` (a list of records with ``name`` and
    ``kind``, or a mapping of name to record) carry ``flops`` and ``bytes_accessed`` per
    chip (XLA's cost analysis of an SPMD program) and what the program covers. Used: the
    decode window (``rollout_window[...]`` / ``*decode*``: ``slots``, optional
    ``decode_steps``, default 1 as XLA counts a loop body once, and ``kv_bytes``, its cache
    read, subtracted since the replay charges the live prefix) and the policy and value
    updates (``policy_update[w=...]`` / ``value_update[...]``: ``tokens``, or ``rows x
    width``; the width buckets summed: FLOPs over tokens across them, attention inside).
    Programs that did not compile, and the rest, are skipped. Accepted: unrolled compiles of
    the whole model, or two compiles of fewer layers extrapolated to it
    (``compiled_units.py``, ``model.extrapolated_from``); refused: scanned layers."""
    try:
        data = json.loads(Path(path).read_text())
        progs = data["programs"]
        recs = (list(progs.items()) if isinstance(progs, dict)
                else [(p["name"], p) for p in progs])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{path}: not a compiled-programs JSON ({e})") from None
    model = data.get("model") or {}
    if model.get("scanned_layers"):
        raise SystemExit(f"{path}: its programs scan the layers and XLA counts a loop body once "
                         f"(one layer's FLOPs and bytes); compile with `tppo plan ... --compile "
                         f"--unroll-layers` for unit costs")
    compiled_layers = model.get("num_layers_compiled")
    if not model.get("extrapolated_from") and compiled_layers not in (None, model.get("layers")):
        raise SystemExit(f"{path}: compiled with {compiled_layers} of the model's "
                         f"{model.get('layers')} layers; extrapolate two such compiles "
                         f"(`tppo bench compiled-units`)")
    roles: dict[str, list[dict]] = {}
    for name, rec in recs:
        role = _program_role(name, rec)
        if role and rec.get("compiled", True):
            roles.setdefault(role, []).append(rec)
    if "decode" not in roles or "policy" not in roles:
        raise SystemExit(f"{path}: needs a compiled *decode* (rollout window) and a "
                         f"policy/train/update program; has {sorted(n for n, _ in recs)}")

    def per_token(rs: list[dict]) -> tuple[float, float]:
        tokens = sum(r["tokens"] if "tokens" in r else r["rows"] * r["width"] for r in rs)
        return (sum(float(r["flops"]) for r in rs) / tokens,
                sum(float(r["bytes_accessed"]) for r in rs) / tokens)

    try:
        dec = roles["decode"][0]
        steps = dec.get("decode_steps", 1)
        pol_f, pol_b = per_token(roles["policy"])
        out = Compiled(str(path), float(dec["flops"]) / (steps * dec["slots"]),
                       (float(dec["bytes_accessed"]) - dec.get("kv_bytes", 0)) / steps,
                       pol_f, pol_b)
        if "value" in roles:
            val_f, val_b = per_token(roles["value"])
            out = replace(out, value_flops_per_token=val_f, value_bytes_per_token=val_b)
    except (KeyError, TypeError, ZeroDivisionError) as e:
        raise SystemExit(f"{path}: program entry lacks {e}") from None
    return out


def matmul_params(arch) -> tuple[int, int]:
    """Params each token multiplies through: (policy, critic). The input embedding is a
    lookup (no FLOPs) unless tied to the LM head; the critic has no LM head, but a scalar
    value head."""
    vh = arch.vocab_size * arch.hidden_size
    policy = arch.n_params - (0 if arch.tie_embeddings else vh)
    critic = arch.n_value_params - vh
    return policy, critic


def accelerator_units(arch, slots: int, chips: int, device: str, mfu: float, bw_eff: float,
                      t_grade: float, grader_workers: int, decode_tp: int = 8,
                      step_floor_s: float = 0.0, reshard_s: float | None = None,
                      ici_bw: float = 600e9, compiled: Compiled | None = None) -> Units:
    """Unit costs on ``chips`` accelerators of kind ``device`` (bf16 weights), decoding on
    replicas of ``decode_tp`` chips (each reads its whole copy of the weights per step)."""
    flops, bw = PEAKS[device]
    n_pol, n_val = matmul_params(arch)
    weight_bytes = 2 * n_pol
    kv = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2  # bf16 K and V
    # A decode step: its matmuls (the weights read once per replica, 2 N_mm FLOPs per slot)
    # and a fixed cost; attention is charged apart by the live KV it reads (t_kv per token
    # of prefix), never by a compiled program's whole page table.
    dec_bytes = weight_bytes / decode_tp  # per chip of a replica, per step
    dec_tok = 2 * n_pol / chips  # per chip, per decoded token
    if compiled is None:
        pol_tok, val_tok = 6 * n_pol / chips, 6 * n_val / chips
        pol_bytes = val_bytes = 0.0
    else:  # the update's matmuls as compiled (its attention is the analytic term below)
        pol_tok, pol_bytes = compiled.update_flops_per_token, compiled.update_bytes_per_token
        val_tok = compiled.value_flops_per_token or pol_tok * n_val / n_pol
        val_bytes = compiled.value_bytes_per_token or pol_bytes * n_val / n_pol
    attn = ATTN_TRAIN * arch.num_layers * arch.num_heads * arch.head_dim / (chips * flops * mfu)
    t_step = step_floor_s + max(dec_bytes / (bw * bw_eff), dec_tok * slots / (flops * mfu))
    if reshard_s is None:  # each chip receives its decode shard, less what it holds
        received = weight_bytes / decode_tp * max(1 - decode_tp / chips, 0.0)
        reshard_s = received / (ici_bw * bw_eff)
    return Units(t_step=t_step, t_kv=kv / (chips * bw * bw_eff),
                 t_policy=max(pol_tok / (flops * mfu), pol_bytes / (bw * bw_eff)),
                 t_value=max(val_tok / (flops * mfu), val_bytes / (bw * bw_eff)),
                 t_attn=attn, t_reshard=reshard_s, t_grade=t_grade / grader_workers)


def lognormal_lengths(n: int, median: float, sigma: float, max_len: int, seed: int = 0
                      ) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(median), sigma, n), 16, max_len).astype(np.int64)


def compare(lengths: np.ndarray, slots: int, window: int, max_len: int, prompt: int,
            unit: Units, packed: bool, sample_ratio: float = 1.0,
            occupancy: dict | None = None) -> dict:
    """Both methods on ``lengths``: steady-state phase seconds, occupancy, the drain apart,
    and the projection (``f``, ``r_d``, ``r_u``, speedup). ``occupancy``: each method's slot
    occupancy where pages bound it (a page replay); its decode steps are then the tokens
    over it (unlimited pages without it)."""
    per: dict = {}
    for name, w in (("tppo", window), ("ppo", max_len)):
        rp = replay(lengths, slots, w, max_len, prompt)
        if not rp.steady.finished:
            raise SystemExit(f"{len(lengths)} samples over {slots} slots leave no steady-state "
                             f"window for l = {w}: replay more batches")
        c = rp.steady
        if occupancy is not None:
            c = replace(c, decode_steps=round(c.useful_tokens / (occupancy[name] * slots)))
        per[name] = {"counts": asdict(c), "seconds": step_costs(c, unit, packed),
                     "occupancy": c.occupancy(slots),
                     "occupancy_unlimited_pages": rp.steady.occupancy(slots),
                     "drain": {"counts": asdict(rp.drain),
                               "occupancy": rp.drain.occupancy(slots),
                               "occupancy_with_drain": rp.total.occupancy(slots)}}
    per["projection"] = projection(per["ppo"]["seconds"], per["tppo"]["seconds"], sample_ratio)
    per["decode_step_ratio"] = (per["ppo"]["counts"]["decode_steps"] / per["ppo"]["counts"]
                                ["finished"]) / (per["tppo"]["counts"]["decode_steps"] /
                                                 per["tppo"]["counts"]["finished"])
    per["time_to_target_ratio"] = per["projection"]["speedup"]
    return per


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


def closed(lengths: np.ndarray, slots: int, window: int, max_len: int, prompt: int,
           per_run: dict, measured: dict) -> dict:
    """The CPU prediction with two inputs from the measured split in place of the model's:
    each method's decode steps from its measured occupancy (the policy's own response lengths,
    not the task's solutions, set how long PPO's batches run) and its update as measured
    seconds per update step (on CPU an update step costs about the same for both methods,
    whatever its cells: bucketed widths and fixed per-step work), times the replay's steps.
    ``residual``: measured ratio over this prediction, minus 1."""
    out: dict = {}
    for name, w in (("tppo", window), ("ppo", max_len)):
        c = replay(lengths, slots, w, max_len, prompt).steady
        fin = max(c.finished, 1)
        m = measured[name]
        decode = c.useful_tokens / (m["occupancy"] * slots) * per_run[name]["t_step"]
        update = c.steps * m["update_per_step"]
        grading = c.finished * per_run[name]["t_grade"]
        out[name] = {"decode": decode / fin, "update": update / fin, "grading": grading / fin,
                     "steps_per_sample": {"replayed": c.steps / fin,
                                          "measured": m["steps_per_sample"]},
                     "tokens_per_sample": {"replayed": c.useful_tokens / fin,
                                           "measured": m["tokens_per_sample"]}}
        out[name]["total"] = out[name]["per_finished_sample"] = decode / fin + update / fin \
            + grading / fin
    out["projection"] = projection(out["ppo"], out["tppo"])
    out["residual"] = measured["ratio"] / out["projection"]["speedup"] - 1
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
