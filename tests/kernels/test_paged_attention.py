"""Paged attention == dense attention over the same keys/values (reference and Pallas kernels)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tppo_jax.kernels import paged_attention as pa
from tppo_jax.rollout import pages

PS = 4


def dense_attention(q, k, v, lengths, scale):
    """numpy fp64 GQA decode attention. q [B,Hq,D], k/v [B,L,Hkv,D] -> [B,Hq,D]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, hq, d = q.shape
    g = hq // k.shape[2]
    out = np.zeros_like(q)
    for i in range(b):
        n = int(lengths[i])
        if n == 0:
            continue
        for h in range(hq):
            kk, vv = k[i, :n, h // g], v[i, :n, h // g]
            logit = kk @ q[i, h] * scale
            p = np.exp(logit - logit.max())
            out[i, h] = (p / p.sum()) @ vv
    return out


def make_case(seed, lengths, hq, hkv, d, max_pages, num_pages):
    """Random dense K/V scattered into a randomly permuted page pool."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    L = max_pages * PS
    q = rng.standard_normal((b, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, L, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, L, hkv, d)).astype(np.float32)
    perm = rng.permutation(num_pages)[: b * max_pages].reshape(b, max_pages)
    table = np.full((b, max_pages), -1, np.int32)
    k_pages = rng.standard_normal((hkv, num_pages, PS, d)).astype(np.float32)  # junk elsewhere
    v_pages = rng.standard_normal((hkv, num_pages, PS, d)).astype(np.float32)
    for i, n in enumerate(lengths):
        used = -(-n // PS)
        table[i, :used] = perm[i, :used]
        for t in range(n):
            k_pages[:, table[i, t // PS], t % PS] = k[i, t]
            v_pages[:, table[i, t // PS], t % PS] = v[i, t]
    return q, k, v, k_pages, v_pages, np.asarray(lengths, np.int32), table


LENGTHS = [1, 4, 7, 16, 0, 13]  # length 1, exactly full pages, ragged, max, empty


@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2), (8, 1)])
def test_reference_matches_dense_under_jit(hq, hkv):
    q, k, v, kp, vp, lens, table = make_case(0, LENGTHS, hq, hkv, 8, 4, 32)
    fn = jax.jit(lambda *a: pa.paged_attention(*a, impl="reference"))
    out = fn(q, kp, vp, lens, table)
    np.testing.assert_allclose(out, dense_attention(q, k, v, lens, 8**-0.5), atol=2e-5)
    assert np.all(np.asarray(out)[4] == 0)


def test_custom_scale_and_auto_on_cpu():
    q, k, v, kp, vp, lens, table = make_case(1, [3, 9], 4, 2, 8, 3, 8)
    assert pa.resolve_impl("auto") == "reference"
    out = pa.paged_attention(q, kp, vp, lens, table, scale=0.3)
    np.testing.assert_allclose(out, dense_attention(q, k, v, lens, 0.3), atol=2e-5)
    with pytest.raises(ValueError):
        pa.resolve_impl("pallas")


def test_prefill_matches_dense_causal_and_decode():
    b, hq, hkv, d, mp = 3, 4, 2, 8, 4
    lengths = [5, 16, 2]
    q1, k, v, kp, vp, lens, table = make_case(2, lengths, hq, hkv, d, mp, 16)
    T = 3
    rng = np.random.default_rng(3)
    q = rng.standard_normal((b, T, hq, d)).astype(np.float32)
    # The last T tokens of each sequence are "new" (left-padded where the sequence is shorter).
    qpos = np.array([[n - T + t for t in range(T)] for n in lengths], np.int32)
    out = np.asarray(jax.jit(pa.paged_attention_prefill)(q, kp, vp, lens, table, qpos))
    for i in range(b):
        for t in range(T):
            if qpos[i, t] < 0:
                assert np.all(out[i, t] == 0)
                continue
            want = dense_attention(
                q[i : i + 1, t], k[i : i + 1], v[i : i + 1], [qpos[i, t] + 1], d**-0.5
            )
            np.testing.assert_allclose(out[i, t], want[0], atol=2e-5)
    # The last query of a prefill chunk equals the decode kernel's answer.
    dec = pa.paged_attention(q[:, -1], kp, vp, lens, table, impl="reference")
    np.testing.assert_allclose(out[:, -1], dec, atol=1e-6)


def test_end_to_end_with_page_state():
    """allocate + write_kv + attention_inputs feed the kernel the right cache."""
    hq, hkv, d, S = 4, 2, 8, 3
    state = pages.init(num_pages=12, num_slots=S, max_pages_per_slot=4, page_size=PS)
    lengths = np.array([6, 1, 13])
    state, ok = pages.allocate(state, jnp.ones(S, bool), jnp.asarray(lengths))
    assert ok.all()
    rng = np.random.default_rng(4)
    k = rng.standard_normal((S, 16, hkv, d)).astype(np.float32)
    v = rng.standard_normal((S, 16, hkv, d)).astype(np.float32)
    pos = np.arange(16)[None].repeat(S, 0)
    valid = pos < lengths[:, None]
    kp = jnp.zeros((hkv, 12, PS, d))
    kp, vp = pages.write_kv(kp, kp, state, jnp.arange(S), pos, k, v, valid)
    table, lens = pages.attention_inputs(state, jnp.arange(S))
    q = rng.standard_normal((S, hq, d)).astype(np.float32)
    out = pa.paged_attention(q, kp, vp, lens, table, impl="reference")
    np.testing.assert_allclose(out, dense_attention(q, k, v, lengths, d**-0.5), atol=2e-5)


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_pallas_kernels_in_interpret_mode(impl):
    """The shipped Pallas kernels, run by the Pallas interpreter on CPU, match dense attention."""
    lengths = [1, 4, 7, 16]
    q, k, v, kp, vp, lens, table = make_case(5, lengths, 4, 2, 16, 4, 20)
    # The TPU kernel loads K/V as bf16; use bf16-representable inputs so only its arithmetic
    # (not input rounding) is compared.
    k, v, kp, vp = (np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32) for x in (k, v, kp, vp))
    tol = 2e-2 if impl == "pallas_tpu" else 1e-4
    try:
        out = pa.paged_attention(q, kp, vp, lens, table, impl=impl, interpret=True)
    except (NotImplementedError, ImportError) as e:  # pragma: no cover - depends on jax build
        pytest.skip(f"{impl} cannot run in interpret mode on CPU: {e}")
    np.testing.assert_allclose(out, dense_attention(q, k, v, lens, 16**-0.5), atol=tol)


def _bf16(*xs):
    """bf16-representable float32 copies: the TPU kernel's input rounding is then exact."""
    return (np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32) for x in xs)


# The shipped models' decode geometries: Qwen2.5-0.5B (groups of 7, d64), 1.5B (6, d128),
# 32B (5, d128); the kernel's query block needs groups padded to a multiple of 8.
GEOMETRIES = [(14, 2, 64), (12, 2, 128), (40, 8, 128)]


@pytest.mark.slow  # ~6 s a geometry: the Pallas interpreter traces each call
@pytest.mark.parametrize("hq,hkv,d", GEOMETRIES)
def test_tpu_kernel_path_equals_the_reference_at_shipped_geometries(hq, hkv, d, monkeypatch):
    """The TPU path as a TPU runs it (groups padded to 8, the slots cut into chunks whose
    page table fits SMEM, forced to two chunks at the first geometry), in the Pallas TPU
    interpreter: equal to the reference over ragged lengths, an empty slot and -1 pages."""
    lengths = [0, 5, 12, 3]
    q, k, v, kp, vp, lens, table = make_case(7, lengths, hq, hkv, d, 3, 16)
    k, v, kp, vp = _bf16(k, v, kp, vp)
    assert (table == -1).any()
    if (hq, hkv, d) == GEOMETRIES[0]:  # (each interpreted call costs seconds)
        monkeypatch.setattr(pa, "SMEM_TABLE_BYTES", 4 * table.shape[1] * 2)  # 2 slots a call
        assert pa.slot_chunks(len(lengths), table.shape[1]) == [(0, 2), (2, 4)]
    got = pa.paged_attention(q, kp, vp, lens, table, impl="pallas", interpret=True)
    ref = pa.paged_attention(q, kp, vp, lens, table, impl="reference")
    np.testing.assert_allclose(got, ref, atol=2e-2)  # the kernel multiplies in bf16
    np.testing.assert_allclose(got, dense_attention(q, k, v, lens, d**-0.5), atol=2e-2)
    assert np.all(np.asarray(got)[0] == 0)


@pytest.mark.slow  # ~6 s: one interpreted kernel per shard
def test_tpu_kernel_runs_per_shard_on_a_mesh(devices8):
    """On a multi-device program mesh (one host's pool, not split) the Mosaic kernel runs
    per shard in ``shard_map`` (rows over data x fsdp, KV heads over tensor) and equals the
    reference."""
    from tppo_jax.parallel.mesh import make_mesh

    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    q, k, v, kp, vp, lens, table = make_case(8, [9, 0, 4, 12], 14, 2, 64, 3, 16)
    kp, vp = _bf16(kp, vp)

    def fn(*a):
        return pa.paged_attention(*a, impl="pallas_tpu", interpret=True, mesh=mesh)

    assert "shard_map" in str(jax.make_jaxpr(fn)(q, kp, vp, lens, table))
    got = jax.jit(fn)(q, kp, vp, lens, table)
    ref = pa.paged_attention(q, kp, vp, lens, table, impl="reference")
    np.testing.assert_allclose(got, ref, atol=2e-2)


def test_slot_chunks_fit_smem_at_paper_scale():
    """256 slots x 1664 pages of page table (1.7 MB) would overflow the 1 MiB SMEM in one
    call: the chunks cover every slot once, each table within ``SMEM_TABLE_BYTES``."""
    chunks = pa.slot_chunks(256, 1664)
    assert chunks[0][0] == 0 and chunks[-1][1] == 256 and len(chunks) > 1
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:], strict=False))
    assert all((hi - lo) * 1664 * 4 <= pa.SMEM_TABLE_BYTES for lo, hi in chunks)
    assert pa.slot_chunks(8, 16) == [(0, 8)]


def test_the_paged_kernel_is_chosen_for_the_platform_not_this_machine():
    """"auto" is the program's platform's kernel: the TPU kernel for a TPU program traced
    on this CPU machine, the reference for a CPU one."""
    from tppo_jax.kernels.choice import choose_paged

    assert choose_paged("auto", "tpu") == "pallas_tpu"
    assert choose_paged("auto", "gpu") == "pallas_gpu"
    assert choose_paged("auto", "cpu") == "reference"
    assert choose_paged("pallas", "cpu", interpret=True) == "pallas_tpu"
    assert pa.resolve_impl("auto", platform="tpu") == "pallas_tpu"
    with pytest.raises(ValueError, match="paged attention impl"):
        choose_paged("flash", "tpu")
