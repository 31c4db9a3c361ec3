"""Compile a config's training step for a TPU topology from any machine (``tppo plan CONFIG
--topology T --compile``).

Every program a step of the config runs is built through the functions training runs (the
learner's ``make_updater`` / ``make_targets``, the rollout's ``DecodeEngine`` as the
scheduler and the held-out eval build it) with abstract params, optimizer states and KV cache
(``jax.ShapeDtypeStruct`` with the ``NamedSharding`` the trainer places them with, on a mesh
of the topology's abstract devices, ``tppo_jax.platform``), then compiled by the TPU
compiler. Nothing is allocated: a v5p-512 compiles from one CPU process.

Programs (names as ``benchmarks/cost_model.py``'s ``load_compiled`` reads them):
- ``policy_update[w=W]`` / ``value_update[w=W]``: one row group's gradient at every width
  bucket ``W`` (``buckets.width_buckets``) with its rows (``update_plan.group_rows``);
- ``policy_apply`` / ``value_apply``: the guarded AdamW step;
- ``targets[w=W]``: the critic's rollout-time pass over a row group; ``targets_finish``: the
  advantages and returns over the ``[B, S]`` buffer;
- ``rollout_prefill[w=W]``: the batched prefill into the slots at the widest prefill bucket;
  ``rollout_window[l=l]``: one decode window of ``l`` tokens over every slot;
- ``eval_prefill`` / ``eval_window``: the held-out eval's decode (its own dense engine).

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

import inspect
import json
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from tppo_jax.buckets import bucket_width, width_buckets
from tppo_jax.config import Config, ConfigError, validate
from tppo_jax.kernels.choice import kernel_calls, kernels_for
from tppo_jax.launch import GIB
from tppo_jax.platform import Topology, TopologyError, abstract_devices, libtpu_version

# Groups of programs (``--programs``); each program's kind is one of them.
KINDS = ("policy_update", "policy_apply", "value_update", "value_apply", "targets", "rollout",
         "eval")


@dataclass
class Program:
    """One jitted function of the step and the abstract arguments it is lowered with."""

    name: str
    kind: str
    lower: Callable[[], Any]  # -> jax ``Lowered``
    meta: dict[str, Any] = field(default_factory=dict)
    holds: tuple[str, ...] = ()  # the live state it takes as arguments (not counted twice)


def _sds(x: Any, sharding: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def per_chip_bytes(tree: Any) -> int:
    """Bytes of one device's shard of every abstract array in ``tree`` (the largest shard)."""
    n = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) else x.shape
        n += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return n


def _copied(copy: Any, of: Any) -> list[Any]:
    """The leaves of ``copy`` a run holds besides ``of`` (same tree): those in another
    dtype or layout; the rest (a LoRA run's frozen base) are the same arrays."""
    return [a for a, b in zip(jax.tree.leaves(copy), jax.tree.leaves(of), strict=True)
            if a.dtype != b.dtype or a.sharding != b.sharding]


def abstract_decode_state(engine: Any, mesh: Any) -> Any:
    """The engine's empty ``DecodeState`` as abstract arrays laid out as the engine makes it:
    a dense cache sharded over ``mesh`` (``DenseKVCache.init_on_mesh``), a paged pool split
    into per-shard blocks (``kv_slots.new_cache``: ``eval_shape`` drops the layout of a jit
    nested in the traced function), the rest replicated."""
    from tppo_jax.models.cache import DenseKVCache
    from tppo_jax.rollout import pages as pg
    from tppo_jax.rollout.paged_cache import PagedKVCache

    ds = jax.eval_shape(engine.init_decode_state)
    c = ds.cache
    if isinstance(c, DenseKVCache) and engine.cache_mesh is not None:
        ds = ds.replace(cache=jax.tree.map(
            _sds, c, DenseKVCache.layout(engine.cache_mesh, c.k.shape)))
    elif isinstance(c, PagedKVCache) and c.split is not None and c.split.groups > 1:
        rows, pool = c.split.shardings()
        layout = PagedKVCache(pg.PageState(rows, rows, rows, c.pages.page_size), pool, pool,
                              rows, c.impl, c.split)
        ds = ds.replace(cache=jax.tree.map(_sds, c, layout))
    return _on_mesh(ds, mesh)


def _on_mesh(tree: Any, mesh: Any) -> Any:
    """Leaves without a sharding (what the trainer creates uncommitted: a paged KV pool,
    step counts) as replicated on ``mesh``, as a jitted step receives them."""
    rep = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: x if isinstance(getattr(x, "sharding", None), NamedSharding)
                        else _sds(x, rep), tree)


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


def abstract_models(cfg: Config, mesh: Any, mc: Any = None) -> dict[str, Any]:
    """The policy and the critic as a run builds them (``setup.load_models``: LoRA adapters,
    a shared base), each as ``(graphdef, params)`` with params a pure dict of
    ``ShapeDtypeStruct``s laid out on ``mesh`` by their logical axes (``nnx.eval_shape``: no
    weights are made)."""
    from tppo_jax.learner.estimators import needs_critic
    from tppo_jax.models.lora import add_lora, lora_spec
    from tppo_jax.models.transformer import Transformer, param_shardings
    from tppo_jax.models.value import ValueModel
    from tppo_jax.weights.params import share_base, shares_base

    mc = mc or model_config(cfg)
    spec = lora_spec(cfg.model)

    def build(cls: type, seed: int, lora: bool) -> tuple[Any, Any, Any]:
        def make():
            model = cls(mc, rngs=nnx.Rngs(seed))
            return add_lora(model, spec, seed=seed) if lora else model
        abstract = nnx.eval_shape(make)
        graphdef, state = nnx.split(abstract)
        sh = param_shardings(state, mesh)
        placed = jax.tree.map(lambda v, s: v.replace(_sds(v.get_value(), s)), state, sh,
                              is_leaf=lambda x: isinstance(x, nnx.Variable))
        return graphdef, nnx.to_pure_dict(placed), state

    pdef, pparams, pstate = build(Transformer, cfg.train.seed, spec is not None)
    if not needs_critic(cfg.algo):  # a critic-free estimator: no value model
        return {"policy": (pdef, pparams), "value": (None, None), "policy_state": pstate,
                "config": mc}
    vdef, vparams, _ = build(ValueModel, cfg.train.seed + 1,
                             spec is not None and cfg.model.value_lora)
    if shares_base(cfg):
        vparams = share_base(pparams, vparams)
    return {"policy": (pdef, pparams), "value": (vdef, vparams), "policy_state": pstate,
            "config": mc}


def abstract_opt_state(tx: Any, params: Any, mesh: Any) -> Any:
    """``tx.init(params)`` as abstract arrays: every param-shaped state (AdamW's m and v) in
    its param's sharding, the rest (step counts) replicated (``state.commit_to_mesh``)."""
    import optax

    shapes = jax.eval_shape(tx.init, params)
    rep = NamedSharding(mesh, PartitionSpec())
    return optax.tree_map_params(tx, lambda s, p: _sds(s, p.sharding), shapes, params,
                                 transform_non_params=lambda s: _sds(s, rep))


def _rows_batch(record: type, rows: int, width: int, sharding: Any) -> Any:
    """A row group's ``[R, W]`` record (``PolicyRows``, ``ValueRows``, ``TokenRows``) as
    its ``take`` hands it to the gradient or the values pass."""
    dtypes = {"tokens": jnp.int32, "attn": jnp.bool_}
    return record(**{k: jax.ShapeDtypeStruct((rows, width), dtypes.get(k, jnp.float32),
                                             sharding=sharding) for k in record._fields})


def build_programs(cfg: Config, mesh: Any, only: Sequence[str] | None = None, *,
                   hosts: int = 1, widest: bool = False, unroll_layers: bool = False,
                   layers: int | None = None
                   ) -> tuple[list[Program], dict[str, int], dict[str, Any]]:
    """``(programs, live state bytes per chip by name, facts)`` of one step of ``cfg`` on
    ``mesh`` (abstract devices of a slice of ``hosts`` hosts). ``only``: the kinds to build
    (default all), in this order; ``widest``: the row-group programs at the widest width
    bucket only (their peak: every group holds about the same token cells, and attention
    grows with the width); ``unroll_layers``, ``layers``: see ``model_config``."""
    from tppo_jax.eval.heldout import EvalEngines, decode_and_grade
    from tppo_jax.eval.protocol import run_protocol
    from tppo_jax.learner import (
        Learner,
        LearnerConfig,
        TokenRows,
        TrainBatch,
        TrainState,
        policy_optimizer,
        value_optimizer,
    )
    from tppo_jax.learner.learner import ROWS, batch_spec
    from tppo_jax.learner.plan import group_rows, max_group_rows
    from tppo_jax.parallel.mesh import data_parallel_size, decode_mesh, layout_rules
    from tppo_jax.rollout.decode import SamplingParams
    from tppo_jax.rollout.engine import EngineParams
    from tppo_jax.rollout.scheduler import make_engine
    from tppo_jax.weights.params import (
        master_params,
        shares_base,
        split_trainable,
        trainable_keys,
        trained_part,
    )

    want = set(only or KINDS)
    r, o = cfg.rollout, cfg.optim
    models = abstract_models(cfg, mesh, model_config(cfg, unroll_layers, layers))
    pdef, pparams = models["policy"]
    vdef, vparams = models["value"]
    keep_p, keep_v = trainable_keys(cfg)
    learner_cfg = LearnerConfig.from_config(cfg)
    tx_p, tx_v = policy_optimizer(o), value_optimizer(o)
    critic = vdef is not None  # else a critic-free estimator: no value programs
    # What the TrainState holds, as a run builds it: float32 masters of a bfloat16 model
    # (model.param_dtype); rollouts, evals and the KL reference read a model-dtype copy.
    compute = pparams
    pparams = master_params(pparams, keep_p, cfg)
    vparams = master_params(vparams, keep_v, cfg) if critic else None
    popt = abstract_opt_state(tx_p, trained_part(pparams, keep_p), mesh)
    vopt = abstract_opt_state(tx_v, trained_part(vparams, keep_v), mesh) if critic else None
    learner = Learner(pdef, vdef, learner_cfg, mesh=mesh,
                      state=TrainState(pparams, vparams, popt, vopt), trainable=(keep_p, keep_v))
    rows_sh, rep = batch_spec(mesh), NamedSharding(mesh, PartitionSpec())
    b, s = r.slots, r.max_prompt_len + r.max_response_len
    unit = data_parallel_size(mesh)
    max_rows = max_group_rows(b, o.minibatches, o.grad_accum)
    widths = width_buckets(s)[-1:] if widest else width_buckets(s)

    # A critic sharing the policy's frozen base (LoRA) holds only its own leaves
    shared = per_chip_bytes(split_trainable(pparams["backbone"])[1]) if shares_base(cfg) else 0
    live = {"policy_params": per_chip_bytes(pparams), "policy_opt": per_chip_bytes(popt)}
    if critic:
        live.update(value_params=per_chip_bytes(vparams) - shared,
                    value_opt=per_chip_bytes(vopt))
    ref = None
    if cfg.algo.kl_coef > 0 and keep_p is None:  # trainer: reference_copy(compute_copy(...))
        ref = compute
        live["reference_policy"] = per_chip_bytes(compute)
    programs: list[Program] = []
    facts: dict[str, Any] = {"slots": b, "seq_len": s, "widths": widths,
                             "max_group_rows": max_rows, "batch_ways": unit}

    for kind, params, opt, keep in (("policy", pparams, popt, keep_p),
                                    ("value", vparams, vopt, keep_v)):
        if (f"{kind}_update" not in want and f"{kind}_apply" not in want
                or kind == "value" and not critic):
            continue
        upd = learner.policy if kind == "policy" else learner.value
        from tppo_jax.models.lora import split_trainable
        train, frozen = (params, None) if keep is None else split_trainable(params, keep)
        extra = (frozen,) if keep is not None else ((ref,) if upd.uses_ref else ())
        held = (f"{kind}_params",) + (("reference_policy",) if upd.uses_ref else ())
        denoms = {k: jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)
                  for k in (("tokens", "rows", "positive") if kind == "policy"
                            else ("tokens", "rows"))}
        grad_fn = upd.grads
        for w in widths:
            rows = group_rows(w, max_rows, unit)
            mb = _rows_batch(ROWS[kind], rows, w, rows_sh)
            if f"{kind}_update" in want:
                programs.append(Program(
                    f"{kind}_update[w={w}]", f"{kind}_update",
                    partial(grad_fn.lower, train, mb, denoms, *extra),
                    {"rows": rows, "width": w, "tokens": rows * w}, held))
        if f"{kind}_apply" in want:
            w0 = widths[0]
            out = grad_fn.eval_shape(train, _rows_batch(ROWS[kind], group_rows(
                w0, max_rows, unit), w0, rows_sh), denoms, *extra)
            stats = _on_mesh(out[0], mesh)
            grads = jax.tree.map(lambda g, p: _sds(g, p.sharding), out[1], train)
            programs.append(Program(
                f"{kind}_apply", f"{kind}_apply",
                partial(upd.apply.lower, train, opt, grads, stats, denoms),
                {}, (f"{kind}_params", f"{kind}_opt")))

    if "targets" in want:
        for w in widths if critic else ():
            rows = group_rows(w, max_rows, unit)
            grp = _rows_batch(TokenRows, rows, w, rows_sh)
            programs.append(Program(f"targets[w={w}]", "targets",
                                    partial(learner.group_values.lower, vparams, grp),
                                    {"rows": rows, "width": w}, ("value_params",)))
        full = {"tokens": ((b, s), jnp.int32), "attn": ((b, s), jnp.bool_),
                "sample_logprobs": ((b, s), jnp.float32),
                "prompt_len": ((b,), jnp.int32), "window_start": ((b,), jnp.int32),
                "window_len": ((b,), jnp.int32), "finished": ((b,), jnp.bool_),
                "reward": ((b,), jnp.float32), "correct": ((b,), jnp.bool_),
                "group": ((b,), jnp.int32)}
        batch = TrainBatch(**{k: jax.ShapeDtypeStruct(sh, dt, sharding=rows_sh)
                              for k, (sh, dt) in full.items()})
        values = jax.ShapeDtypeStruct((b, s), jnp.float32, sharding=rows_sh)
        programs.append(Program("targets_finish", "targets",
                                partial(learner.finish.lower, values, batch),
                                {"rows": b, "width": s}, ()))

    # Rollout: the scheduler's engine, on the decode mesh (mesh.decode_tensor: tensor-
    # parallel replicas) or the training mesh; a paged pool is one replicated pool on one
    # host, split into one block per batch shard across hosts (each host's own pages).
    dmesh = decode_mesh(mesh, cfg.mesh.decode_tensor) if cfg.mesh.decode_tensor else mesh
    rows_sh, rep = batch_spec(dmesh), NamedSharding(dmesh, PartitionSpec())
    rollout_params = compute
    if cfg.mesh.decode_layout == "decode":
        from tppo_jax.models.transformer import param_shardings
        dec = nnx.to_pure_dict(param_shardings(models["policy_state"], dmesh,
                                               rules=layout_rules("decode")))
        rollout_params = jax.tree.map(_sds, compute, dec)
    copied = _copied(rollout_params, pparams)  # another layout, or the masters' dtype cast
    if copied:
        live["decode_copy"] = per_chip_bytes(copied)
    policy = nnx.merge(pdef, rollout_params)
    sampling = SamplingParams(r.temperature, r.top_p, r.top_k)
    # ``auto`` as it resolves on the slice, not on this machine: paged on TPU
    kv = r.kv_cache if r.kv_cache != "auto" else "paged"
    engine = make_engine(policy, replace(r, kv_cache=kv), eos_ids=(0,), sampling=sampling,
                         seed=cfg.train.seed, mesh=dmesh, split_pages=hosts > 1)
    ds = abstract_decode_state(engine, dmesh)
    live["kv_cache"] = per_chip_bytes(ds.cache)
    facts["kv_cache"] = engine.kv_cache
    ep = EngineParams(state=nnx.state(policy), version=jax.ShapeDtypeStruct((), jnp.int32,
                                                                            sharding=rep))
    slot = lambda dt: jax.ShapeDtypeStruct((b,), dt, sharding=rows_sh)  # noqa: E731
    held_roll = ("decode_copy",) if "decode_copy" in live else ("policy_params",)
    window = min(r.window, r.max_response_len)
    if "rollout" in want:
        # new prompts are prefilled at their bucket; continuations (reprefill) at the widest
        pw = s if r.kv_policy == "reprefill" else bucket_width(r.max_prompt_len, s)
        toks = jax.ShapeDtypeStruct((b, pw), jnp.int32, sharding=rows_sh)
        programs.append(Program(
            f"rollout_prefill[w={pw}]", "rollout",
            partial(engine.lowered, "prefill_slots", ep, ds, toks, slot(jnp.int32),
                    slot(jnp.bool_)),
            {"slots": b, "width": pw}, (*held_roll, "kv_cache")))
        programs.append(Program(
            f"rollout_window[l={window}]", "rollout",
            partial(engine.lowered, "generate_window", ds, ep, window, slot(jnp.int32),
                    slot(jnp.bool_)),
            {"slots": b, "window": window, "decode_steps": 1,
             "kv_bytes": per_chip_bytes(ds.cache)}, (*held_roll, "kv_cache")))

    if "eval" in want:
        p = run_protocol(cfg)
        eb = inspect.signature(decode_and_grade).parameters["batch_size"].default
        es = r.max_prompt_len + p.max_tokens
        ee = EvalEngines().get(policy, (0,), eb, es, p.sampling or sampling, dmesh)
        eds = abstract_decode_state(ee, dmesh)
        ew = bucket_width(r.max_prompt_len, es)
        eslot = lambda dt: jax.ShapeDtypeStruct((eb,), dt, sharding=rows_sh)  # noqa: E731
        etoks = jax.ShapeDtypeStruct((eb, ew), jnp.int32, sharding=rows_sh)
        # The eval runs between steps: the rollout's KV cache is live, its own is not.
        programs.append(Program(
            "eval_prefill", "eval",
            partial(ee.lowered, "prefill_slots", ep, eds, etoks, eslot(jnp.int32),
                    eslot(jnp.bool_)),
            {"slots": eb, "width": ew}, held_roll))
        programs.append(Program(
            f"eval_window[l={p.max_tokens}]", "eval",
            partial(ee.lowered, "generate_window", eds, ep, p.max_tokens, eslot(jnp.int32),
                    eslot(jnp.bool_)),
            {"slots": eb, "window": p.max_tokens}, held_roll))
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


__all__ = ["KINDS", "Program", "TopologyError", "abstract_models", "build_programs",
           "compile_plan", "format_report", "per_chip_bytes", "refusal", "write_report"]
