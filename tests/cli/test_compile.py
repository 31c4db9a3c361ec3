"""`tppo plan --compile`: the smoke config's programs compiled by the TPU compiler for a
v5e:2x2 slice (from this CPU machine) fit; an oversized config is refused in one line, by
`tppo plan` and by `tppo launch`. Skipped where libtpu (the `tpu` extra) is not installed."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from tppo_jax import cli
from tppo_jax.platform import TopologyError, libtpu_version, parse_topology, require_tpu_compiler

needs_libtpu = pytest.mark.skipif(libtpu_version() is None,
                                  reason='libtpu not installed (pip install -e ".[tpu]")')

# Short rows keep the width buckets (and the compiles) few: 32 and 64.
SMALL = ["rollout.max_prompt_len=32", "rollout.max_response_len=32"]
# A KV pool no v5e chip holds (the paged pool is replicated on every chip): 2.4e8 tokens of
# 512 B, ~114 GiB, next to a program that itself compiles in seconds.
OVERSIZED = [*SMALL, "rollout.num_pages=15000000"]


@pytest.mark.parametrize("name, grid, chips, hosts", [
    ("v5litepod-8", (2, 4), 8, 1), ("v5e:2x2", (2, 2), 4, 1), ("v5p-8", (2, 2, 1), 4, 1),
    ("v5p-512", (4, 8, 8), 256, 64), ("v5p:2x2x1", (2, 2, 1), 4, 1)])
def test_parse_topology(name, grid, chips, hosts):
    t = parse_topology(name)
    assert (t.grid, t.chips, t.hosts) == (grid, chips, hosts)
    assert t.hbm_bytes == (95 if t.generation == "v5p" else 16) * 1024**3


# v5e:0x0 and v5p:2x0x1: issue 62 L-13 ("division by zero")
@pytest.mark.parametrize("bad", ["v5e:2x2x2", "v5p:2x2", "v7-8", "v5litepod-3", "v5e:0x0",
                                 "v5p:2x0x1"])
def test_bad_topology_one_line(bad):
    with pytest.raises(TopologyError) as e:
        parse_topology(bad)
    assert "\n" not in str(e.value)


def test_missing_libtpu_names_the_extra(monkeypatch):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    with pytest.raises(TopologyError, match=r'pip install -e "\.\[tpu\]"'):
        require_tpu_compiler()


@needs_libtpu
def test_smoke_programs_compile_and_fit(tmp_path, capsys):
    out = tmp_path / "compiled.json"
    rc = cli.main(["plan", "smoke", *SMALL, "--topology", "v5e:2x2", "--compile",
                   "--programs", "policy_update,rollout", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    rep = json.loads(out.read_text())
    assert rep["fits"] and rep["complete"] and rep["chips"] == 4
    assert rep["libtpu"] == libtpu_version() and rep["jax"]
    names = [p["name"] for p in rep["programs"]]
    assert names == ["policy_update[w=32]", "policy_update[w=64]", "rollout_prefill[w=32]",
                     "rollout_window[l=16]"]
    for p in rep["programs"]:
        assert p["compiled"] and p["fits"]
        assert 0 < p["peak"] == (p["arguments"] + p["outputs"] + p["temporaries"]
                                 - p["aliased"])
        assert p["resident"] == p["peak"] + p["live_outside"] <= rep["hbm_per_chip"]
        assert p["flops"] > 0 and p["bytes_accessed"] > 0
    # what runs on a TPU: splash in training and prefill, the paged kernel in the window,
    # their FLOPs (invisible to XLA's cost analysis) counted analytically
    assert rep["kernels"] == {"attention": "splash", "paged_attention": "pallas_tpu"}
    for p in rep["programs"]:
        want = "tppo_paged_attention" if p["name"].startswith("rollout_window") else "splash"
        assert any(want in k for k in p["kernels"]), (p["name"], p["kernels"])
        assert p["flops_incl_kernels"] == p["flops"] + p["kernel_flops_analytic"]
        assert p["kernel_flops_analytic"] > 0
    # a wider group does more work; the update takes the policy's params as an argument
    assert rep["programs"][0]["flops"] < rep["programs"][1]["flops"]
    assert rep["programs"][0]["live_outside"] == sum(
        v for k, v in rep["live"].items() if k != "policy_params")
    assert "fits: every program" in text


@needs_libtpu
def test_oversized_config_is_refused_in_one_line(capsys):
    rc = cli.main(["plan", "smoke", *OVERSIZED, "--topology", "v5e:2x2", "--compile",
                   "--programs", "policy_update", "--stop-early"])
    err = capsys.readouterr().err
    assert rc == 1
    [line] = [x for x in err.splitlines() if x.startswith("tppo plan:")]
    assert "does not fit v5e:2x2: policy_update[w=32]" in line and "GiB over" in line


@needs_libtpu
def test_launch_refuses_what_does_not_fit(capsys):
    argv = ["launch", "--config", "smoke", "--tpu-type", "v5litepod-4", "--dry-run",
            "--compile", *OVERSIZED]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any(x.startswith("tppo launch: fit check: compiling ") for x in err)  # progress
    assert err[-1].startswith("tppo launch: smoke does not fit v5litepod-4")
    assert "--force" in err[-1]
    assert cli.main([*argv, "--force"]) == 0
    assert "tpu-vm create" in capsys.readouterr().out


def test_plan_layout_agrees_with_the_compile_paths_state(devices8):
    """The arithmetic plan's params and AdamW rows equal the per-chip bytes of the abstract
    state the compile path lays out (an fp32 model: AdamW m + v are 8 B/param either way;
    the optimizers' step counts are a few replicated bytes)."""
    from tppo_jax.compile import learner_parts, model_config, per_chip_bytes
    from tppo_jax.config import load_config
    from tppo_jax.parallel.mesh import make_mesh
    from tppo_jax.plan import plan_memory
    from tppo_jax.weights.abstract import abstract_models

    cfg = load_config("smoke", ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"])
    mesh = make_mesh({"data": 1, "fsdp": 4, "tensor": 2}, devices8)
    _, state, _ = learner_parts(cfg, mesh, abstract_models(cfg, mesh, model_config(cfg)))
    rows = plan_memory(cfg, "v5litepod-8")["rows"]
    for kind in ("policy", "value"):
        assert rows[f"{kind} params"] == per_chip_bytes(getattr(state, kind))
        opt = per_chip_bytes(getattr(state, f"{kind}_opt"))
        assert 0 <= opt - rows[f"{kind} optimizer"] <= 64


@pytest.mark.parametrize("decode_tensor", [0, 2])
def test_a_dense_kv_cache_counts_one_shard_per_chip(devices8, decode_tensor):
    """A dense cache is made sharded on the (decode) mesh (``DenseKVCache.init_on_mesh``):
    the live state counts one chip's shard, as the trainer lays it out, not the whole cache
    on every chip (the paper config's 53 TB pool read as 53 TB per chip)."""
    from tppo_jax.compile import build_programs, model_config
    from tppo_jax.config import load_config
    from tppo_jax.parallel.mesh import make_mesh

    layout = ["mesh.decode_layout=decode"] if decode_tensor else []
    cfg = load_config("smoke", [*SMALL, "rollout.kv_cache=dense", "mesh.data=1",
                                "mesh.fsdp=8", f"mesh.decode_tensor={decode_tensor}", *layout])
    mesh = make_mesh({"data": 1, "fsdp": 8, "tensor": 1}, devices8)
    _, live, facts = build_programs(cfg, mesh, ["rollout"])
    mc, r = model_config(cfg), cfg.rollout
    slots = r.prompts_per_step * r.group_size
    whole = 2 * mc.num_layers * slots * (r.max_prompt_len + r.max_response_len) \
        * mc.num_kv_heads * mc.head_dim * 4  # k and v, float32
    # slots over the 8 chips, or over 4 replicas with the KV heads over their 2 chips
    ways = 8 if not decode_tensor else 4 * (2 if mc.num_kv_heads % 2 == 0 else 1)
    assert facts["kv_cache"] == "dense"
    assert whole // ways <= live["kv_cache"] <= whole // ways + 4 * slots  # + the lengths


def test_a_paged_pool_split_over_hosts_counts_one_block_per_chip(devices8):
    """On a slice of several hosts the paged pool is split into one block of slots and
    pages per batch shard (``kv_slots.new_cache``): a chip holds its block, 1/8 of the pool
    on 8 batch shards, not the whole pool."""
    from tppo_jax.compile import build_programs, model_config
    from tppo_jax.config import load_config
    from tppo_jax.parallel.mesh import make_mesh

    cfg = load_config("smoke", [*SMALL, "rollout.kv_cache=paged", "rollout.num_pages=64",
                                "mesh.data=1", "mesh.fsdp=8"])
    mesh = make_mesh({"data": 1, "fsdp": 8, "tensor": 1}, devices8)
    mc, r = model_config(cfg), cfg.rollout
    pool = 2 * mc.num_layers * mc.num_kv_heads * 64 * r.page_size * mc.head_dim * 4  # k, v
    for hosts, ways in ((1, 1), (2, 8)):
        _, live, facts = build_programs(cfg, mesh, ["rollout"], hosts=hosts)
        assert facts["kv_cache"] == "paged"
        assert pool // ways <= live["kv_cache"] <= pool // ways + 4096, (hosts, live)


@needs_libtpu
def test_unrolled_layers_count_every_layers_flops(tmp_path):
    """Scanned layers: XLA's cost analysis counts the layer loop's body once; unrolled, the
    policy update's FLOPs grow by about the other layers' share (the smoke model has 2)."""
    flops = {}
    for extra in ([], ["--unroll-layers"]):
        out = tmp_path / f"c{len(extra)}.json"
        assert cli.main(["plan", "smoke", *SMALL, "--topology", "v5e:2x2", "--compile",
                         "--programs", "policy_update", "--widest", "--out", str(out),
                         *extra]) == 0
        rep = json.loads(out.read_text())
        assert rep["model"]["scanned_layers"] == (not extra)
        flops[bool(extra)] = rep["programs"][0]["flops"]
    assert flops[True] > 1.3 * flops[False], flops


@needs_libtpu
@pytest.mark.slow  # ~9 s on 2 shared cores
def test_layers_compiles_fewer_layers_and_records_both_counts(tmp_path):
    """``--layers N``: the model with N decoder layers (unit costs per layer,
    ``benchmarks/compiled_units.py``); the report names the real count beside it."""
    out = tmp_path / "l1.json"
    assert cli.main(["plan", "smoke", *SMALL, "--topology", "v5e:2x2", "--compile",
                     "--programs", "policy_update", "--widest", "--unroll-layers",
                     "--layers", "1", "--out", str(out)]) == 0
    m = json.loads(out.read_text())["model"]
    assert m["num_layers_compiled"] == 1 and m["layers"] > 1 and not m["scanned_layers"]


def test_a_critic_sharing_the_lora_base_counts_only_its_own_leaves(devices8):
    from tppo_jax.compile import build_programs
    from tppo_jax.config import load_config
    from tppo_jax.parallel.mesh import make_mesh

    mesh = make_mesh({"data": 1, "fsdp": 8, "tensor": 1}, devices8)
    live = {}
    for rank in (0, 4):
        cfg = load_config("smoke", [*SMALL, f"model.lora_rank={rank}", "model.value_init=policy"])
        live[rank] = build_programs(cfg, mesh, ["policy_apply"])[1]
    # without LoRA the critic is a backbone of its own and a value head; with it, the critic
    # holds its adapters (as many as the policy's) and the head, the base once (the policy's)
    head = live[0]["value_params"] - live[0]["policy_params"]
    adapters = live[4]["policy_params"] - live[0]["policy_params"]
    assert 0 < head < 100 and live[4]["value_params"] == adapters + head


# The Qwen2.5-0.5B attention geometry (14 query heads over 2 KV heads, head_dim 64: groups of
# 7) on the tiny model: one bf16 layer, a paged pool.
QWEN05_HEADS = [*SMALL, "model.hidden_size=896", "model.num_heads=14", "model.num_kv_heads=2",
                "model.num_layers=1", "model.intermediate_size=256", "model.dtype=bfloat16",
                "rollout.kv_cache=paged"]


def _kernel_names(lowered) -> set[str]:
    from tppo_jax.kernels.choice import kernel_calls

    return {c["name"] for c in kernel_calls(lowered.as_text())}


@needs_libtpu
@pytest.mark.slow  # ~15 s on 2 shared cores
def test_tpu_decode_window_compiles_with_the_paged_kernel_at_05b_heads(tmp_path):
    out = tmp_path / "window.json"
    assert cli.main(["plan", "smoke", *QWEN05_HEADS, "--topology", "v5e:2x2", "--compile",
                     "--programs", "rollout", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    prefill, window = rep["programs"]
    assert window["name"].startswith("rollout_window") and window["compiled"]
    assert "tppo_paged_attention" in window["kernels"] and window["fits"]
    assert any("splash" in k for k in prefill["kernels"])


@needs_libtpu
@pytest.mark.slow  # ~10 s on 2 shared cores
def test_compile_and_a_run_on_tpu_devices_choose_the_same_kernels():
    """The programs ``tppo plan --compile`` lowers for a TPU topology and those the rollout
    engine a run builds on TPU devices (``scheduler.make_engine`` on the run's mesh) name the
    same kernels: both resolve them for their mesh's platform (``kernels.choice``), never for
    the machine tracing them (this CPU)."""
    from flax import nnx

    from tppo_jax.compile import build_programs, model_config
    from tppo_jax.config import load_config
    from tppo_jax.kernels.choice import kernels_for
    from tppo_jax.learner import batch_spec
    from tppo_jax.parallel.mesh import make_mesh
    from tppo_jax.plan import resolve_mesh
    from tppo_jax.platform import abstract_devices
    from tppo_jax.rollout.decode import SamplingParams
    from tppo_jax.rollout.engine import EngineParams
    from tppo_jax.rollout.programs import abstract_decode_state
    from tppo_jax.rollout.scheduler import make_engine
    from tppo_jax.weights.abstract import abstract_models

    cfg = load_config("smoke", QWEN05_HEADS)
    devices = abstract_devices(parse_topology("v5e:2x2"))
    mesh = make_mesh(resolve_mesh(cfg, len(devices)), devices)
    programs, _, facts = build_programs(cfg, mesh, ["rollout"])
    compiled = {p.name.split("[")[0]: _kernel_names(p.lower()) for p in programs}

    policy = nnx.merge(*abstract_models(cfg, mesh, model_config(cfg))["policy"])
    engine = make_engine(policy, cfg.rollout, eos_ids=(0,), sampling=SamplingParams(),
                         mesh=mesh)
    assert engine.platform == "tpu"
    assert engine.kernels == kernels_for("tpu", mesh) == {"attention": "splash",
                                                           "paged_attention": "pallas_tpu"}
    ds = abstract_decode_state(engine, mesh)
    ep = EngineParams(nnx.state(policy), jax.ShapeDtypeStruct((), jnp.int32))
    b = cfg.rollout.slots
    rows = batch_spec(mesh)
    slot = lambda dt: jax.ShapeDtypeStruct((b,), dt, sharding=rows)  # noqa: E731
    toks = jax.ShapeDtypeStruct((b, facts["widths"][0]), jnp.int32, sharding=rows)
    run = {"rollout_prefill": _kernel_names(engine.lowered(
               "prefill_slots", ep, ds, toks, slot(jnp.int32), slot(jnp.bool_))),
           "rollout_window": _kernel_names(engine.lowered(
               "generate_window", ds, ep, 16, slot(jnp.int32), slot(jnp.bool_)))}
    assert run == compiled
    assert "tppo_paged_attention" in run["rollout_window"]
    assert any("splash" in k for k in run["rollout_prefill"])


def test_a_paged_decode_window_without_the_tpu_kernel_is_an_error():
    """A decode window that lowers without the TPU paged-attention kernel (the jnp reference
    a CPU would run) is not what a TPU runs: an error naming it, not a fit."""
    from tppo_jax.compile import Program, compile_program
    from tppo_jax.config import ConfigError

    p = Program("rollout_window[l=1]", "rollout", jax.jit(lambda x: x + 1), (1.0,))
    with pytest.raises(ConfigError, match="no TPU paged-attention kernel"):
        compile_program(p, {}, 1 << 30, needs_paged=True)
    assert compile_program(p, {}, 1 << 30)["kernels"] == {}


def test_a_critic_free_run_builds_no_value_programs_or_state(devices8):
    """``algo.advantage_baseline: rloo`` needs no critic: no value model is laid out, no
    ``value_*`` or ``targets[w=...]`` program is built, the live state holds no critic."""
    from tppo_jax.compile import build_programs
    from tppo_jax.config import load_config
    from tppo_jax.parallel.mesh import make_mesh

    mesh = make_mesh({"data": 1, "fsdp": 8, "tensor": 1}, devices8)
    names = {}
    for est in ("critic", "rloo"):
        cfg = load_config("smoke", [*SMALL, f"algo.advantage_baseline={est}"])
        programs, live, _ = build_programs(cfg, mesh)
        names[est] = {p.name for p in programs}
        assert ("value_params" in live) == (est == "critic")
    assert any(n.startswith("value_update") for n in names["critic"])
    assert not any(n.startswith(("value", "targets[")) for n in names["rloo"])
    assert "targets_finish" in names["rloo"] and "policy_apply" in names["rloo"]
    assert names["rloo"] < names["critic"]
