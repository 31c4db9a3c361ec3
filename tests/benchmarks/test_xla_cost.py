"""XLA cost / HLO structure proxies (benchmarks/xla_cost.py): what the compiled decode and
train steps write and compute, asserted as structure (never a time)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tppo_jax.benchmarks import xla_cost
from tppo_jax.benchmarks.accelerator import decoding_engine, window_programs
from tppo_jax.models.transformer import ModelConfig, create_model
from tppo_jax.rollout.sampling import sample

B, S, V = 4, 40, 128


def _scatter_and_dus(donate: bool):
    x = jax.ShapeDtypeStruct((64, 1024, 8), jnp.float32)
    u = jax.ShapeDtypeStruct((64, 1, 8), jnp.float32)
    pos = jax.ShapeDtypeStruct((64,), jnp.int32)
    donate_argnums = (0,) if donate else ()
    sc = jax.jit(lambda x, u, p: x.at[jnp.arange(64)[:, None], p[:, None]].set(u, mode="drop"),
                 donate_argnums=donate_argnums)
    dus = jax.jit(lambda x, u: jax.lax.dynamic_update_slice(x, u, (0, 5, 0)),
                  donate_argnums=donate_argnums)
    return xla_cost.compile_fn(sc, (x, u, pos)), xla_cost.compile_fn(dus, (x, u))


def test_inplace_updates_and_copies_are_told_apart():
    buf = 64 * 1024 * 8 * 4
    for donate in (False, True):
        sc, dus = _scatter_and_dus(donate)
        for compiled in (sc, dus):
            comps, entry = xla_cost.parse_hlo(compiled.as_text())
            writes = xla_cost.big_writes(comps, entry, (64, 1024, 8))
            assert writes["in_loop"] == []
            # Without donation the operand must be copied first (one whole-buffer write).
            assert [w["op"] for w in writes["outside_loop"]] == ([] if donate else ["copy"])
        # XLA charges an in-place scatter its whole operand and result; a DUS its update.
        comps, entry = xla_cost.parse_hlo(sc.as_text())
        assert xla_cost.inplace_scatter_bytes(comps, entry) == 2 * buf - 2 * 64 * 8 * 4
        if donate:
            assert xla_cost.cost(dus)["bytes_accessed"] < buf / 100
            assert xla_cost.cost(dus)["alias_bytes"] == buf


def _decode_reports(unroll: bool):
    cfg = ModelConfig.tiny(vocab_size=V, unroll_layers=unroll)
    model = create_model(cfg, seed=0)
    engine = decoding_engine(model, B, S)  # the training window, as the scheduler runs it
    params, ds = engine.load_params(model), engine.init_decode_state()
    weights = sum(x.nbytes for x in jax.tree.leaves(params.state))
    out = {}
    for name, compiled in window_programs(engine, params, ds, 8).items():
        out[name == "donated"] = xla_cost.decode_report(
            compiled, layer_dims=(B, S, cfg.num_kv_heads, cfg.head_dim),
            weight_bytes=weights, kv_bytes=2 * ds.cache.k.nbytes)
    return cfg, out


@pytest.fixture(scope="module")
def decode_reports():
    """The scanned layers, as every run decodes: the layer scan carries the cache."""
    return _decode_reports(unroll=False)


def test_decode_step_never_rewrites_the_kv_cache(decode_reports):
    cfg, reports = decode_reports
    stacked = [cfg.num_layers, B, S, cfg.num_kv_heads, cfg.head_dim]
    for rep in reports.values():
        per_step = rep["cache_writes_per_step"]
        # No copy / transpose / layer-sized update of the cache inside the decode loop: at
        # most the one read view of the layer's K and V that XLA:CPU materialises for its
        # reduce kernels, in the layer scan's body (before: 6 layer-sized writes per layer,
        # 3x the cache per step).
        assert all(w["op"] in ("slice", "dynamic-slice") and w["shape"][0] == 1
                   and w["shape"] != stacked for w in per_step), per_step
        assert len(per_step) <= 2


@pytest.mark.xfail(strict=True, reason="unrolled stacked layers: XLA:CPU materialises each "
                   "layer's slice of the stacked weights (3.1-3.3x weights + KV); a scanned "
                   "program's cost analysis counts one layer, so it has no per-step figure")
def test_decode_step_bytes_near_weights_plus_kv():
    _, reports = _decode_reports(unroll=True)
    for rep in reports.values():
        assert rep["bytes_vs_weights_plus_kv"] < 1.75  # as with per-layer params


def test_donating_the_cache_removes_the_per_call_copy(decode_reports):
    _, reports = decode_reports
    assert [w["op"] for w in reports[False]["cache_writes_per_call"]] == ["copy", "copy"]
    assert reports[True]["cache_writes_per_call"] == []
    assert reports[True]["alias_bytes"] >= reports[False]["kv_bytes"]
    assert reports[True]["bytes_per_step"] < reports[False]["bytes_per_step"]


def test_static_greedy_and_top_k_skip_the_vocabulary_work():
    logits = jax.ShapeDtypeStruct((8, 5000), jnp.float32)
    key = jax.random.key(0)

    def compiled(**kw):
        return xla_cost.compile_fn(jax.jit(lambda lg, k: sample(lg, k, **kw)), (logits, key))

    greedy, full = compiled(greedy=True), compiled()
    # No [B, V] random draw when greedy is static.
    assert xla_cost.cost(greedy)["flops"] < 0.3 * xla_cost.cost(full)["flops"]
    for kw, want_sort in ((dict(top_k=20, top_p=0.9), False), (dict(top_p=0.9), True)):
        comps, _ = xla_cost.parse_hlo(compiled(**kw).as_text())
        sorts = [i for c in comps.values() for i in c.instrs
                 if i.opcode == "sort" and any(5000 in d for _, d in i.arrays)]
        assert bool(sorts) == want_sort, kw


@pytest.mark.slow  # ~50 s on 2 shared cores: compiles two train steps
def test_train_step_flops_near_six_n():
    from flax import nnx

    from tppo_jax.benchmarks.accelerator import compile_train_step
    from tppo_jax.models.value import ValueModel

    got = {}
    for policy in ("full", "dots"):
        # Unrolled: XLA's cost analysis counts a loop body (one scanned layer) once.
        model = create_model(ModelConfig.tiny(vocab_size=V, remat=True, remat_policy=policy,
                                              unroll_layers=True))
        value = ValueModel(model.config, rngs=nnx.Rngs(1))
        compiled, n, group = compile_train_step(model, value, "policy", 2, 32)
        assert group == {"rows": 2, "width": 32, "tokens": 64}  # the whole batch: one group
        got[policy] = xla_cost.train_report(compiled, n_params=n, tokens=64)["flops_vs_6n"]
    # 6N (+ attention, + the chunked log-prob's recomputed head, + remat's recompute).
    assert 1.0 < got["dots"] < got["full"] < 2.0, got
    assert np.isfinite(list(got.values())).all()


def test_paged_decode_step_writes_pages_in_place():
    """The paged cache's per-layer page writes land in the stacked pool in place: no layer
    pool is sliced out, updated and written back per step (before: 4 per layer)."""
    from tppo_jax.rollout import pages as pg
    from tppo_jax.rollout.paged_cache import PagedKVCache, init_pools

    cfg = ModelConfig.tiny(vocab_size=V)
    model = create_model(cfg, seed=0)
    graphdef, state = nnx.split(model)
    n, ps = 24, 8
    pages, _ = pg.reserve(pg.init(n, B, 6, ps), jnp.ones(B, bool), 20)
    k, v = init_pools(cfg.num_layers, cfg.num_kv_heads, n, ps, cfg.head_dim)

    def decode(state, k, v, pages, tok):
        m = nnx.merge(graphdef, state)

        def body(_, c):
            cache = PagedKVCache(c[2], c[0], c[1], jnp.arange(B, dtype=jnp.int32),
                                 impl="reference")
            logits, cache = m.forward_with_cache(c[3][:, None], cache.pages.slot_len[:, None],
                                                 cache, valid=jnp.ones((B, 1), bool))
            return cache.k, cache.v, cache.pages, jnp.argmax(logits[:, 0], -1).astype(jnp.int32)

        return jax.lax.fori_loop(0, 4, body, (k, v, pages, tok))

    compiled = xla_cost.compile_fn(jax.jit(decode, donate_argnums=(1, 2)),
                                   (state, k, v, pages, jnp.zeros(B, jnp.int32)))
    rep = xla_cost.decode_report(compiled, layer_dims=(cfg.num_kv_heads, n, ps, cfg.head_dim),
                                 weight_bytes=sum(x.nbytes for x in jax.tree.leaves(state)),
                                 kv_bytes=2 * k.nbytes)
    assert rep["cache_writes_per_step"] == [] and rep["cache_writes_per_call"] == []
    assert rep["bytes_vs_weights_plus_kv"] < 1.75  # was 1.99 donated
