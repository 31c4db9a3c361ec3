"""Compile a config's training step for a TPU topology from any machine (``tppo plan CONFIG
--topology T --compile``).

The programs are those the learner and the decode engine list themselves, with the
arguments they run on (``learner.programs.step_programs``, ``rollout.programs``): the
learner built as the trainer builds it, on its state from the real init function
(``learner.init.abstract_state``: float32 masters and AdamW moments of a bfloat16 model),
the rollout's engine as the scheduler builds it and the held-out eval's as the eval does;
every array abstract (``jax.ShapeDtypeStruct`` with the ``NamedSharding`` a run places it
with) on a mesh of the topology's abstract devices (``tppo_jax.platform``), then compiled by
the TPU compiler. Nothing is allocated: a v5p-512 compiles from one CPU process.

Programs (names as ``benchmarks/cost_model.py``'s ``load_compiled`` reads them): the
learner's (``policy_update[w=W]`` / ``value_update[w=W]`` at every width bucket ``W``,
``policy_apply`` / ``value_apply``, ``targets[w=W]`` and ``targets_finish``: see
``learner/programs.py``); ``rollout_prefill[w=W]``: the batched prefill into the slots at
the widest prefill bucket; ``rollout_window[l=l]``: one decode window of ``l`` tokens over
every slot; ``eval_prefill`` / ``eval_window``: the held-out eval's decode (its own dense
engine).

Every program traces on its own mesh of the topology's abstract TPU devices, as the run's
programs trace on the slice's (``kernels.choice.traced_on``): its kernels are chosen for the
platform "tpu", never for this machine. Per program, per chip: ``kernels`` (the Mosaic
kernels named in the lowered text, with their call counts; a paged decode window without the
TPU paged-attention kernel is an error), ``peak`` = arguments + outputs + temporaries -
aliased (XLA's ``memory_analysis()``), ``flops`` and ``bytes_accessed`` (``cost_analysis()``;
a loop body counts once; a Pallas kernel counts as ~0 there), ``kernel_flops_analytic`` (the
kernels' FLOPs from their operand shapes, ``kernels.choice.kernel_calls``) and
``flops_incl_kernels`` (the sum), compile seconds. The state live across programs (params,
optimizer states, the KV cache that unfinished rows keep through the update) is added where a
program does not take it as an argument: ``resident`` = peak + the live state it does not
hold, and the step fits when every program's ``resident`` is within the chip's HBM. A program
the compiler refuses (RESOURCE_EXHAUSTED) does not fit, with the shortfall the compiler
names.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import jax
from flax import nnx

from tppo_jax.buckets import bucket_width, width_buckets
from tppo_jax.config import Config, ConfigError, validate
from tppo_jax.kernels.choice import kernel_calls, kernels_for
from tppo_jax.launch import GIB
from tppo_jax.learner.programs import KINDS as LEARNER_KINDS
from tppo_jax.platform import Topology, TopologyError, abstract_devices, libtpu_version
from tppo_jax.programs import Program, per_chip_bytes, sds

# Groups of programs (``--programs``); each program's kind is one of them.
KINDS = (*LEARNER_KINDS, "rollout", "eval")


def _copied(copy: Any, of: Any) -> list[Any]:
    """The leaves of ``copy`` a run holds besides ``of`` (same tree): those in another
    dtype or layout; the rest (a LoRA run's frozen base) are the same arrays."""
    return [a for a, b in zip(jax.tree.leaves(copy), jax.tree.leaves(of), strict=True)
            if a.dtype != b.dtype or a.sharding != b.sharding]


def model_config(cfg: Config, unroll_layers: bool = False, layers: int | None = None) -> Any:
    """The ``ModelConfig`` a run of ``cfg`` builds (shapes from ``plan.resolve_arch``: the
    Hub/folder name, or the tiny model's sizes), with its remat setting. ``unroll_layers``:
    the layers as straight-line code, so that XLA's cost analysis (which counts a loop body
    once) counts every layer's FLOPs and bytes; ``layers``: that many decoder layers in place
    of the model's (unit costs extrapolated from two small compiles,
    ``benchmarks/compiled_units.py``)."""
    from tppo_jax.plan import resolve_arch

    a = resolve_arch(cfg)
    m = cfg.model
    remat = m.remat or m.source == "tiny"
    # ``auto`` stays: each program resolves it for its mesh's platform (``kernels.choice``),
    # the topology's TPU here as on the slice
    mc = a.model_config(dtype=m.dtype, remat=remat, attention=m.attention,
                        unroll_layers=unroll_layers,
                        max_position_embeddings=max(m.max_seq_len, cfg.rollout.max_prompt_len
                                                    + cfg.rollout.max_response_len))
    if layers is not None:
        if layers < 1:
            raise ConfigError(f"--layers {layers}: needs at least one layer")
        mc = replace(mc, num_layers=layers)
    return mc


def learner_parts(cfg: Config, mesh: Any, models: dict[str, Any]) -> tuple[Any, Any, Any]:
    """``(learner, state, ref)``: the ``Learner`` a run of ``cfg`` builds on ``mesh``, its
    ``TrainState`` from the real init (abstract) and the KL reference's params (the model
    dtype's copy a run keeps when the learner uses one, else None)."""
    from tppo_jax.learner import Learner, LearnerConfig
    from tppo_jax.learner.init import abstract_state
    from tppo_jax.weights.params import trainable_keys

    (pdef, pparams), (vdef, vparams) = models["policy"], models["value"]
    trainable = trainable_keys(cfg)  # LoRA: AdamW states for the adapters alone
    lcfg = LearnerConfig.from_config(cfg)
    state = abstract_state(pparams, vparams, lcfg, trainable=trainable, mesh=mesh)
    learner = Learner(pdef, vdef, lcfg, mesh=mesh, state=state, trainable=trainable)
    return learner, state, pparams if learner.uses_ref else None


def live_state(cfg: Config, state: Any, ref: Any) -> dict[str, int]:
    """Bytes per chip of the learner's state that lives across the step's programs."""
    from tppo_jax.models.lora import split_trainable
    from tppo_jax.weights.params import shares_base

    live = {"policy_params": per_chip_bytes(state.policy),
            "policy_opt": per_chip_bytes(state.policy_opt)}
    if state.value is not None:
        # A critic sharing the policy's frozen base (LoRA) holds only its own leaves
        shared = (per_chip_bytes(split_trainable(state.policy["backbone"])[1])
                  if shares_base(cfg) else 0)
        live.update(value_params=per_chip_bytes(state.value) - shared,
                    value_opt=per_chip_bytes(state.value_opt))
    if ref is not None:
        live["reference_policy"] = per_chip_bytes(ref)
    return live


def decode_policy(cfg: Config, models: dict[str, Any], dmesh: Any) -> nnx.Module:
    """The policy rollouts decode with: the model-dtype copy, moved to the decode layout's
    shardings on the decode mesh with ``mesh.decode_layout: decode``."""
    from tppo_jax.models.transformer import param_shardings
    from tppo_jax.parallel.mesh import layout_rules

    pdef, params = models["policy"]
    if cfg.mesh.decode_layout == "decode":
        dec = nnx.to_pure_dict(param_shardings(models["policy_state"], dmesh,
                                               rules=layout_rules("decode")))
        params = jax.tree.map(sds, params, dec)
    return nnx.merge(pdef, params)


def decode_programs(cfg: Config, mesh: Any, models: dict[str, Any], state: Any,
                    want: Sequence[str], hosts: int, live: dict[str, int],
                    facts: dict[str, Any]) -> list[Program]:
    """The rollout's and the held-out eval's programs (of the kinds in ``want``); ``live``
    and ``facts`` gain the decode copy and the KV cache. The rollout's engine is the
    scheduler's, on the decode mesh (``mesh.decode_tensor``: tensor-parallel replicas) or
    the training mesh; a paged pool is one replicated pool on one host, split into one block
    per batch shard across hosts (each host's own pages)."""
    from tppo_jax.parallel.mesh import decode_mesh
    from tppo_jax.rollout.decode import SamplingParams
    from tppo_jax.rollout.programs import abstract_decode_state, abstract_params
    from tppo_jax.rollout.scheduler import make_engine

    r = cfg.rollout
    dmesh = decode_mesh(mesh, cfg.mesh.decode_tensor) if cfg.mesh.decode_tensor else mesh
    policy = decode_policy(cfg, models, dmesh)
    copied = _copied(nnx.to_pure_dict(nnx.state(policy)), state.policy)
    if copied:  # another layout, or the masters' dtype cast
        live["decode_copy"] = per_chip_bytes(copied)
    sampling = SamplingParams(r.temperature, r.top_p, r.top_k)
    # ``auto`` as it resolves on the slice, not on this machine: paged on TPU
    kv = r.kv_cache if r.kv_cache != "auto" else "paged"
    engine = make_engine(policy, replace(r, kv_cache=kv), eos_ids=(0,), sampling=sampling,
                         seed=cfg.train.seed, mesh=dmesh, split_pages=hosts > 1)
    ds = abstract_decode_state(engine, dmesh)
    live["kv_cache"] = per_chip_bytes(ds.cache)
    facts["kv_cache"] = engine.kv_cache
    params = abstract_params(policy, dmesh)
    held = ("decode_copy",) if "decode_copy" in live else ("policy_params",)
    out = []
    if "rollout" in want:
        out += rollout_programs(cfg, engine, params, ds, dmesh, (*held, "kv_cache"))
    if "eval" in want:  # between steps: the rollout's KV cache is live, its own is not
        out += eval_programs(cfg, policy, params, sampling, dmesh, held)
    return out


def rollout_programs(cfg: Config, engine: Any, params: Any, ds: Any, dmesh: Any,
                     held: tuple[str, ...]) -> list[Program]:
    """The rollout's programs as the scheduler runs them: the prefill (new prompts at their
    bucket; continuations, ``reprefill``, at the widest), the decode window (with pages on
    demand, a chunk of ``page_chunk`` steps: the window runs as such chunks), and, when the
    page pool can run dry on demand, the re-prefill of preempted rows (gathered, a few per
    page block: ``DecodeEngine.prefill_gathered``) at the widest bucket (a row can be
    preempted holding up to ``max_prompt_len + max_response_len`` tokens)."""
    from tppo_jax.rollout.kv_slots import pages_for
    from tppo_jax.rollout.programs import gathered_program, prefill_program, window_program

    r = cfg.rollout
    s = r.max_len
    pw = s if r.kv_policy == "reprefill" else bucket_width(r.max_prompt_len, s)
    window = min(r.window, r.max_response_len)
    on_demand = engine.kv_cache == "paged" and r.page_alloc == "on_demand"
    steps = min(r.page_chunk, window) if on_demand else window
    out = [prefill_program(engine, params, ds, pw, name=f"rollout_prefill[w={pw}]",
                           kind="rollout", mesh=dmesh, holds=held)]
    if on_demand and 0 < r.num_pages < r.slots * pages_for(s, r.page_size):  # can run dry
        out.append(gathered_program(engine, params, ds, s, name=f"rollout_reprefill[w={s}]",
                                    kind="rollout", mesh=dmesh, holds=held))
    win = window_program(engine, params, ds, steps, name=f"rollout_window[l={steps}]",
                         kind="rollout", mesh=dmesh, holds=held)
    out.append(replace(win, meta={**win.meta, "decode_steps": 1,
                                  "kv_bytes": per_chip_bytes(ds.cache)}))
    return out


def eval_programs(cfg: Config, policy: Any, params: Any, sampling: Any, dmesh: Any,
                  held: tuple[str, ...]) -> list[Program]:
    """The held-out eval's prefill and window (its engine as ``eval.heldout`` builds it)."""
    from tppo_jax.eval.heldout import BATCH_SIZE, EvalEngines
    from tppo_jax.eval.protocol import run_protocol
    from tppo_jax.rollout.programs import abstract_decode_state, prefill_program, window_program

    p, r = run_protocol(cfg), cfg.rollout
    es = r.max_prompt_len + p.max_tokens
    engine = EvalEngines().get(policy, (0,), BATCH_SIZE, es, p.sampling or sampling, dmesh)
    ds = abstract_decode_state(engine, dmesh)
    width = bucket_width(r.max_prompt_len, es)
    return [prefill_program(engine, params, ds, width, name="eval_prefill", kind="eval",
                            mesh=dmesh, holds=held),
            window_program(engine, params, ds, p.max_tokens,
                           name=f"eval_window[l={p.max_tokens}]", kind="eval", mesh=dmesh,
                           holds=held)]


def build_programs(cfg: Config, mesh: Any, only: Sequence[str] | None = None, *,
                   hosts: int = 1, widest: bool = False, unroll_layers: bool = False,
                   layers: int | None = None
                   ) -> tuple[list[Program], dict[str, int], dict[str, Any]]:
    """``(programs, live state bytes per chip by name, facts)`` of one step of ``cfg`` on
    ``mesh`` (abstract devices of a slice of ``hosts`` hosts). ``only``: the kinds to build
    (default all), in this order; ``widest``: the row-group programs at the widest width
    bucket only (their peak: every group holds about the same token cells, and attention
    grows with the width); ``unroll_layers``, ``layers``: see ``model_config``."""
    from tppo_jax.learner import TrainBatch, batch_spec
    from tppo_jax.learner.plan import max_group_rows
    from tppo_jax.learner.programs import step_programs

    want = list(only or KINDS)
    o, r = cfg.optim, cfg.rollout
    from tppo_jax.weights.abstract import abstract_models

    models = abstract_models(cfg, mesh, model_config(cfg, unroll_layers, layers))
    learner, state, ref = learner_parts(cfg, mesh, models)
    live = live_state(cfg, state, ref)
    b, s = r.slots, r.max_len
    widths = width_buckets(s)[-1:] if widest else width_buckets(s)
    facts: dict[str, Any] = {"slots": b, "seq_len": s, "widths": widths,
                             "max_group_rows": max_group_rows(b, o.minibatches, o.grad_accum),
                             "batch_ways": learner.unit}
    kinds = [k for k in want if k in LEARNER_KINDS]
    programs = (step_programs(learner, state, TrainBatch.abstract(b, s, batch_spec(mesh)),
                              widths=widths, ref=ref, kinds=kinds) if kinds else [])
    programs += decode_programs(cfg, mesh, models, state, want, hosts, live, facts)
    if only:
        order = {k: i for i, k in enumerate(only)}
        programs.sort(key=lambda p: order[p.kind])
    return programs, live, facts


_OOM = re.compile(r"RESOURCE_EXHAUSTED[^\n]*")
_NEED = re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT])\) exceeds available HBM "
                   r"\(([\d.]+)([KMGT])\)")
_UNITS = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def _oom_message(err: Exception) -> str | None:
    """The compiler's out-of-memory line (with the shortfall when it names one), else None."""
    text = str(err)
    m = _OOM.search(text)
    if not m:
        return None
    n = _NEED.search(text)
    if n:
        need = float(n.group(1)) * _UNITS[n.group(2)]
        have = float(n.group(3)) * _UNITS[n.group(4)]
        return (f"temporaries need {need / GIB:.2f} GiB of {have / GIB:.2f} GiB available "
                f"({(need - have) / GIB:.2f} GiB short)")
    return m.group(0).strip()[:300]


def _cost(compiled: Any) -> dict[str, float]:
    c = compiled.cost_analysis()
    c = c[0] if isinstance(c, list | tuple) else (c or {})
    return {"flops": float(c.get("flops", 0.0)),
            "bytes_accessed": float(c.get("bytes accessed", 0.0))}


def _kernel_summary(lowered: Any) -> dict[str, Any]:
    calls = kernel_calls(lowered.as_text())
    names = sorted({c["name"] for c in calls})
    return {"kernels": {n: sum(c["name"] == n for c in calls) for n in names},
            "kernel_flops_analytic": sum(c["flops"] for c in calls)}


def compile_program(p: Program, live: dict[str, int], hbm: int, needs_paged: bool = False
                    ) -> dict[str, Any]:
    """Compiles ``p`` with the TPU compiler; its record (see the module docstring).
    ``needs_paged``: ``p`` is a paged decode window, which must hold a TPU paged-attention
    kernel (without one it is not what a TPU runs: an error, not a fit)."""
    rec: dict[str, Any] = {"name": p.name, "kind": p.kind, **p.meta}
    others = sum(v for k, v in live.items() if k not in p.holds)
    t0 = time.perf_counter()
    try:
        lowered = p.lower()
        rec.update(_kernel_summary(lowered))
        if needs_paged and not any("paged" in n for n in rec["kernels"]):
            raise ConfigError(f"{p.name}: no TPU paged-attention kernel in the lowered decode "
                              f"window (kernels: {sorted(rec['kernels']) or 'none'})")
        compiled = lowered.compile()
    except Exception as e:  # the compiler's errors are XlaRuntimeError / ValueError
        oom = _oom_message(e)
        if oom is None:
            raise
        rec.update(compiled=False, fits_alone=False, fits=False, error=oom,
                   compile_s=round(time.perf_counter() - t0, 1))
        return rec
    ma = compiled.memory_analysis()
    peak = (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
            - ma.alias_size_in_bytes)
    resident = peak + others
    rec.update(compiled=True, compile_s=round(time.perf_counter() - t0, 1),
               arguments=ma.argument_size_in_bytes, outputs=ma.output_size_in_bytes,
               temporaries=ma.temp_size_in_bytes, aliased=ma.alias_size_in_bytes,
               peak=peak, live_outside=others, resident=resident,
               peak_gib=round(peak / GIB, 3), resident_gib=round(resident / GIB, 3),
               fits_alone=peak <= hbm, fits=resident <= hbm, **_cost(compiled))
    rec["flops_incl_kernels"] = rec["flops"] + rec["kernel_flops_analytic"]
    return rec


def compile_plan(cfg: Config, topo: Topology, *, only: Sequence[str] | None = None,
                 stop_early: bool = False, widest: bool = False, config_name: str = "",
                 progress: Callable[[str], None] | None = None,
                 out: str | None = None, unroll_layers: bool = False,
                 layers: int | None = None) -> dict[str, Any]:
    """Builds and compiles every program of a step of ``cfg`` for ``topo``; the report (JSON
    data). ``only``: program kinds (``KINDS``), compiled in that order; ``stop_early``: stop at
    the first program that does not fit; ``widest``: see ``build_programs``; ``out``: the
    report is written there after every program (a long compile keeps what it has done);
    ``unroll_layers``, ``layers``: see ``model_config``.
    Raises ``TopologyError`` / ``ConfigError`` (one line) on bad input."""
    from tppo_jax.parallel.mesh import make_mesh
    from tppo_jax.plan import resolve_mesh

    bad = sorted(set(only or ()) - set(KINDS))
    if bad:
        raise ConfigError(f"--programs: unknown {', '.join(bad)}; known: {', '.join(KINDS)}")
    devices = abstract_devices(topo)
    sizes = resolve_mesh(cfg, len(devices))
    validate(cfg, num_devices=len(devices), num_processes=topo.hosts)
    mesh = make_mesh(sizes, devices)
    t0 = time.perf_counter()
    programs, live, facts = build_programs(cfg, mesh, only, hosts=topo.hosts, widest=widest,
                                           unroll_layers=unroll_layers, layers=layers)
    records: list[dict[str, Any]] = []

    def report() -> dict[str, Any]:
        worst = max(records, key=lambda r: r.get("resident", math.inf), default=None)
        return {
            "config": config_name, "topology": topo.name, "topology_desc": topo.topology_name,
            "chips": topo.chips, "hosts": topo.hosts, "hbm_per_chip": topo.hbm_bytes,
            "hbm_gib": round(topo.hbm_bytes / GIB, 2), "mesh": sizes,
            "model": models_summary(cfg, unroll_layers, layers), **facts,
            "attention": model_config(cfg).attention, "kernels": kernels_for("tpu", mesh),
            "jax": jax.__version__, "libtpu": libtpu_version(),
            "live": live, "live_gib": round(sum(live.values()) / GIB, 3),
            "programs": records, "compile_s": round(time.perf_counter() - t0, 1),
            "fits": all(r["fits"] for r in records) and len(records) == len(programs),
            "worst": worst["name"] if worst else None, "widest_only": widest,
            "complete": len(records) == len(programs),
            "not_compiled": [p.name for p in programs[len(records):]],
        }

    for p in programs:
        if progress:
            progress(p.name)
        # Each program traces on its own mesh (the learner's and the engines', as a run
        # builds them): its kernels are chosen for the topology's platform, nothing here.
        rec = compile_program(p, live, topo.hbm_bytes,
                              needs_paged=p.name.startswith("rollout_window")
                              and facts["kv_cache"] == "paged")
        records.append(rec)
        if out:
            write_report(report(), out)
        if stop_early and not rec["fits"]:
            break
    return report()


def models_summary(cfg: Config, unroll_layers: bool = False, layers: int | None = None
                   ) -> dict[str, Any]:
    """``scanned_layers``: the programs run the layers in a loop, whose body XLA's cost
    analysis counts once: ``flops`` and ``bytes_accessed`` then hold one layer's share.
    ``layers``: the model's layer count; ``num_layers_compiled``: the programs' (``--layers``;
    memory figures then are those of the smaller model)."""
    mc = model_config(cfg, unroll_layers, layers)
    return {"path": cfg.model.path, "source": cfg.model.source, "dtype": mc.dtype,
            "param_dtype": cfg.model.param_dtype,
            "layers": model_config(cfg).num_layers, "num_layers_compiled": mc.num_layers,
            "hidden": mc.hidden_size, "remat": mc.remat,
            "lora_rank": cfg.model.lora_rank, "scanned_layers": not unroll_layers}


def refusal(report: dict[str, Any]) -> str | None:
    """One line naming the first program that does not fit and its shortfall, or None."""
    hbm = report["hbm_per_chip"]
    for r in report["programs"]:
        if r["fits"]:
            continue
        if not r["compiled"]:
            why = r["error"]
        else:
            why = (f"{r['resident'] / GIB:.2f} GiB per chip ({r['peak'] / GIB:.2f} program + "
                   f"{r['live_outside'] / GIB:.2f} live state) of {hbm / GIB:.2f} GiB, "
                   f"{(r['resident'] - hbm) / GIB:.2f} GiB over")
        return (f"{report['config'] or 'config'} does not fit {report['topology']}: "
                f"{r['name']}: {why}")
    return None


def format_report(report: dict[str, Any]) -> str:
    """The per-program table and the verdict."""
    gib = lambda n: f"{n / GIB:8.2f}"  # noqa: E731
    lines = [f"{report['config']} on {report['topology']} ({report['topology_desc']}, "
             f"{report['chips']} chips, {report['hosts']} host(s), {report['hbm_gib']} GiB "
             f"HBM/chip), mesh {report['mesh']}; jax {report['jax']}, libtpu "
             f"{report['libtpu']}",
             "live across programs (GiB/chip): " + ", ".join(
                 f"{k} {v / GIB:.2f}" for k, v in report["live"].items()),
             f"{'program':28s} {'peak':>8s} {'+live':>8s} {'total':>8s} {'TFLOP':>8s} "
             f"{'GB acc':>8s} {'comp s':>7s}  fits"]
    for r in report["programs"]:
        if not r["compiled"]:
            lines.append(f"{r['name']:28s} refused by the compiler: {r['error']}")
            continue
        lines.append(f"{r['name']:28s} {gib(r['peak'])} {gib(r['live_outside'])} "
                     f"{gib(r['resident'])} {r['flops'] / 1e12:8.2f} "
                     f"{r['bytes_accessed'] / 1e9:8.2f} {r['compile_s']:7.1f}  "
                     f"{'yes' if r['fits'] else 'NO'}")
    why = refusal(report)
    if why:
        lines.append(f"DOES NOT FIT: {why}")
    elif not report["complete"]:
        lines.append("stopped early")
    else:
        lines.append(f"fits: every program within {report['hbm_gib']} GiB per chip")
    return "\n".join(lines)


def write_report(report: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")


__all__ = ["KINDS", "Program", "TopologyError", "build_programs",
           "compile_plan", "compile_program", "decode_programs", "format_report",
           "learner_parts", "live_state", "model_config", "per_chip_bytes", "refusal",
           "write_report"]
