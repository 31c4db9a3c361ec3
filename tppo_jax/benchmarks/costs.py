"""The cost model's parts (``cost_model.py`` has the formula and the command): the counts of
a replayed rollout schedule (``replay``), unit costs per token (``Units``: measured on this
machine, or from an accelerator's roofline, ``accelerator_units``, or from compiled programs,
``load_compiled``), a step's seconds per phase (``step_costs``) and the projection of both
methods to a time-to-target ratio (``projection``, ``compare``, ``closed``). Pure numpy: no jax.
"""

from __future__ import annotations

import json
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
