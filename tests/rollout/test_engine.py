"""DecodeEngine over the paged cache (the RL window fast path, prompt sharing, pool accounting)
and JetStream's API over it (``JetStreamEngine``: prefill / insert / generate)."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tppo_jax.compat.jetstream  # noqa: F401  (before any jetstream import)

# isort: split
from jetstream.engine import token_utils

from tppo_jax.models.transformer import ModelConfig, Transformer
from tppo_jax.rollout.decode import SamplingParams
from tppo_jax.rollout.engine import DecodeEngine, PoolExhaustedError
from tppo_jax.rollout.jetstream_engine import JetStreamEngine, TPPOResultTokens

V, MAXLEN = 64, 32
PROMPTS = [[7, 3, 9, 12, 5], [4, 4, 8, 30, 2, 19, 33, 6, 10, 11, 40]]
TOK = types.SimpleNamespace(eos_id=1, eos_ids=(1,), bos_id=2, pad_id=0, backend="stub")
fwd = nnx.jit(lambda m, t: m(t))


@pytest.fixture(scope="module")
def model():
    m = Transformer(ModelConfig.tiny(vocab_size=V, num_layers=2), rngs=nnx.Rngs(1))
    # Larger weights than the 0.02 init, so greedy decoding does not just repeat one token.
    nnx.update(m, jax.tree.map(lambda x: x * 5 if x.ndim > 1 else x, nnx.state(m, nnx.Param)))
    return m


@pytest.fixture(scope="module")
def reference(model):
    """Greedy continuation by full recompute: tokens [33 - plen] and their log-probs."""
    out = []
    for p in PROMPTS:
        toks, lps = list(p), []
        while len(toks) <= MAXLEN:  # the engine caches up to MAXLEN positions
            buf = np.zeros((1, MAXLEN), np.int32)
            buf[0, :len(toks)] = toks
            logits = np.asarray(fwd(model, jnp.asarray(buf)))[0, len(toks) - 1]
            nxt = int(np.argmax(logits))
            lps.append(float(jax.nn.log_softmax(jnp.asarray(logits))[nxt]))
            toks.append(nxt)
        out.append((toks[len(p):], lps))
    return out


@pytest.fixture(scope="module")
def eos(reference):
    """An EOS id that row 0 emits mid-way (so early stop and page freeing are exercised)."""
    toks = reference[0][0]
    return next(t for i, t in enumerate(toks) if i >= 3 and t not in toks[:i])


def _expected(reference, eos):
    exp = []
    for toks, lps in reference:
        n = toks.index(eos) + 1 if eos in toks else len(toks)
        exp.append((toks[:n], lps[:n]))
    return exp


def _prefix(eng, params, prompt):
    """A JetStream-style prefill: the prompt padded to its bucket (as the orchestrator does)."""
    padded, n = token_utils.pad_tokens(np.asarray(prompt), 2, 0, is_bos=False,
                                       max_prefill_length=16)
    return eng.prefill(params, padded, n)


@pytest.fixture(scope="module")
def engine(model, eos):
    return DecodeEngine(model, eos_ids=(eos,), kv_cache="paged", max_slots=4, page_size=4,
                        max_target_length=MAXLEN, sampling=SamplingParams(greedy=True))


@pytest.fixture(scope="module")
def served(engine):
    """JetStream's API over the same engine (what ``tppo serve`` drives)."""
    return JetStreamEngine(engine, TOK, max_prefill_length=16)


def test_abstract_api_is_implemented(engine, served):
    assert not JetStreamEngine.__abstractmethods__
    assert served.max_concurrent_decodes == 4 and served.samples_per_slot == 1
    assert served.colocated_cpus is None and engine.pages_total == 4 * 8
    assert served.build_tokenizer(served.get_tokenizer()).stop_tokens == set(engine.eos_ids)
    assert served.mesh is engine.mesh and served.max_prefill_length == 16


def test_generate_matches_full_forward(engine, served, reference, eos):
    params = served.load_params()
    version = engine.version
    ds = served.init_decode_state()
    for slot, p in zip([1, 3], PROMPTS, strict=True):  # arbitrary slots
        padded, n = token_utils.pad_tokens(np.asarray(p), 2, 0, is_bos=False,
                                           max_prefill_length=served.max_prefill_length)
        prefix = served.prefill(params=params, padded_tokens=padded, true_length=n)
        ds = served.insert(prefix, ds, slot)
    assert engine.pages_in_use(ds) == 1 + 3  # 4 and 10 cached tokens, 4 per page
    got = {1: ([], [], []), 3: ([], [], [])}
    for _ in range(MAXLEN):
        ds, res = served.generate(params, ds)
        res = res.convert_to_numpy()
        assert isinstance(res, TPPOResultTokens)
        lp, ver = res.logprobs(), res.versions()
        for slot, (t, lp_, v) in got.items():
            sd = res.get_result_at_slot(slot)
            if sd.valid[0, 0]:
                assert sd.lengths[0] == len(t) + 1
                t.append(int(sd.tokens[0, 0]))
                lp_.append(float(lp[slot, 0]))
                v.append(int(ver[slot, 0]))
        if not bool(np.asarray(ds.live).any()):
            break
    for (toks, lps), (t, lp_, v) in zip(_expected(reference, eos), got.values(), strict=True):
        assert t == toks
        np.testing.assert_allclose(lp_, lps, atol=1e-4)
        assert set(v) == {version}
    assert engine.pages_in_use(ds) == 0  # finished slots gave their pages back


def test_generate_window_matches_and_stops_early(engine, model, reference, eos):
    params = engine.load_params(model)
    assert int(params.version) == engine.version >= 1
    ds = engine.init_decode_state()
    for slot, p in enumerate(PROMPTS):
        ds = engine.insert(_prefix(engine, params, p), ds, slot)
    toks = [[], []]
    lps = [[], []]
    for _ in range(MAXLEN):
        ds, out = engine.generate_window(ds, params, 8)
        count = np.asarray(out.count)
        assert int(out.version) == engine.version and not np.asarray(out.stalled).any()
        for r in range(2):
            toks[r] += np.asarray(out.tokens)[r, :count[r]].tolist()
            lps[r] += np.asarray(out.logprobs)[r, :count[r]].tolist()
        if not np.asarray(ds.live).any():
            assert int(out.steps) < 8 or count.max() == 8
            break
    for r, (et, el) in enumerate(_expected(reference, eos)):
        assert toks[r] == et
        np.testing.assert_allclose(lps[r], el, atol=1e-4)
    assert engine.pages_in_use(ds) == 0


def test_shared_prompt_pages(engine, reference, eos):
    params = engine.load_params()
    ds = engine.init_decode_state()
    prefix = _prefix(engine, params, PROMPTS[1])  # 10 cached tokens: 2 full pages + tail
    ds = engine.insert(prefix, ds, 0)  # G = 3 samples: slot 0's prompt shared by 2 and 3
    dst, ids = np.isin(np.arange(engine.max_slots), [2, 3]), np.zeros(engine.max_slots, np.uint32)
    ids[dst] = engine.new_seq_ids(2)
    ds, ok = engine.share_prompts(ds, jnp.arange(engine.max_slots) == 0, jnp.asarray(dst),
                                  jnp.asarray(ids))
    assert np.asarray(ok).all()
    assert engine.pages_in_use(ds) == 2 + 3  # shared full pages once, a tail page each
    ds, out = engine.generate_window(ds, params, 6)
    want = _expected(reference, eos)[1][0][:6]
    for r in (0, 2, 3):
        assert np.asarray(out.tokens)[r, :len(want)].tolist() == want
    assert int(np.asarray(out.count)[1]) == 0


def test_pool_exhaustion_refuses_insert(model, reference):
    eng = DecodeEngine(model, eos_ids=(V + 5,), kv_cache="paged", max_slots=2,  # never emitted
                       page_size=4, max_target_length=MAXLEN, num_pages=4,
                       sampling=SamplingParams(greedy=True))
    params = eng.load_params()
    ds = eng.init_decode_state()
    prefix = _prefix(eng, params, PROMPTS[1])
    ds = eng.insert(prefix, ds, 0)  # 3 of 4 pages
    table_before = np.asarray(ds.cache.pages.page_table).copy()
    with pytest.raises(PoolExhaustedError, match="pool exhausted") as err:
        eng.insert(prefix, ds, 1)
    ds = err.value.decode_state  # the donated state's successor: slot 1 empty, slot 0 intact
    np.testing.assert_array_equal(np.asarray(ds.cache.pages.page_table), table_before)
    ds, ok = eng.try_insert(prefix, ds, 1)
    assert not ok and not bool(ds.live[1])
    np.testing.assert_array_equal(np.asarray(ds.cache.pages.page_table), table_before)
    # JetStream's insert: strict by default; the server's lenient one drops the request.
    served = JetStreamEngine(eng, TOK, max_prefill_length=16)
    with pytest.raises(PoolExhaustedError, match="pool exhausted") as err:
        served.insert(prefix, ds, 1)
    served.strict_insert = False
    ds = served.insert(prefix, err.value.decode_state, 1)
    assert not bool(ds.live[1])
    np.testing.assert_array_equal(np.asarray(ds.cache.pages.page_table), table_before)
    # The live slot keeps decoding correctly; when it needs a 5th page it ends instead of
    # overwriting anything, and its pages return to the pool.
    toks = []
    for _ in range(8):
        ds, res = served.generate(params, ds)
        sd = res.convert_to_numpy().get_result_at_slot(0)
        if not sd.valid[0, 0]:
            break
        toks.append(int(sd.tokens[0, 0]))
    assert toks == reference[1][0][:len(toks)] and len(toks) == 16 - 10
    assert eng.pages_in_use(ds) == 0


@pytest.mark.slow  # ~6 s in one process on 2 shared cores
def test_sampling_is_reproducible_across_paths(model):
    eng = DecodeEngine(model, eos_ids=(V + 5,), kv_cache="paged", max_slots=2, page_size=8,
                       max_target_length=MAXLEN,
                       sampling=SamplingParams(temperature=1.0, top_p=0.9, top_k=20))
    params = eng.load_params()
    outs = []
    for windowed in (False, True):
        ds = eng.init_decode_state()
        for slot, p in enumerate(PROMPTS):
            ds = eng.insert(_prefix(eng, params, p), ds, slot, seq_id=100 + slot)
        if windowed:
            ds, out = eng.generate_window(ds, params, 6)
            outs.append(np.asarray(out.tokens))
        else:
            cols = []
            for _ in range(6):
                ds, data = eng.generate_step(params, ds)
                cols.append(np.asarray(data)[:, 0])
            outs.append(np.stack(cols, 1))
    np.testing.assert_array_equal(outs[0], outs[1])
    assert len(set(outs[0][0].tolist())) > 1  # actually sampled, not a constant


def _prompt_rows(prompts, width=16):
    tokens = np.zeros((len(prompts), width), np.int32)
    for r, p in enumerate(prompts):
        tokens[r, :len(p)] = p
    return tokens, np.array([len(p) for p in prompts], np.int32)


def test_decode_prompts_equals_the_slot_path(engine, model, reference, eos):
    """A batch of prompts in one call (the held-out eval's path): the same tokens and
    log-probs as prefill + insert + windows, each row stopping at EOS."""
    params = engine.load_params(model)
    order = [1, 0, 0, 1]
    res = engine.decode_prompts(params, *_prompt_rows([PROMPTS[i] for i in order]), 8)
    count = np.asarray(res.count)
    exp = _expected(reference, eos)
    for r, i in enumerate(order):
        want_toks, want_lps = exp[i][0][:8], exp[i][1][:8]
        assert np.asarray(res.tokens)[r, :count[r]].tolist() == want_toks
        np.testing.assert_allclose(np.asarray(res.logprobs)[r, :count[r]], want_lps, atol=1e-4)
    assert int(res.version) == engine.version


def test_prefill_prompts_on_a_short_pool(model, reference):
    """A row that gets no pages is not live: it generates nothing, the others decode."""
    eng = DecodeEngine(model, eos_ids=(V + 5,), kv_cache="paged", max_slots=2, page_size=4,
                       max_target_length=MAXLEN, num_pages=3,
                       sampling=SamplingParams(greedy=True))
    params = eng.load_params()
    ds, ok = eng.prefill_prompts(params, *_prompt_rows(PROMPTS))  # 1 page, then 3 of 2 left
    assert np.asarray(ok).tolist() == [True, False]
    assert np.asarray(ds.live).tolist() == [True, False]
    ds, out = eng.generate_window(ds, params, 3)
    assert np.asarray(out.count).tolist() == [3, 0]
    assert np.asarray(out.tokens)[0].tolist() == reference[0][0][:3]


@pytest.mark.parametrize("kind", ["dense", "paged"])
def test_prefill_temporaries_do_not_grow_with_the_cache_length(model, kind):
    """A prefill starts at position 0, so it attends over its own tokens and only writes
    the cache: its temporaries are those of a 16-token forward whatever the cache's length
    (through the cache's attention they held ``[B, heads, T, max_len]`` scores)."""
    temps = {}
    for max_len in (64, 1024):
        eng = DecodeEngine(model, eos_ids=(V + 5,), kv_cache=kind, max_slots=4, page_size=8,
                           max_target_length=max_len, sampling=SamplingParams(greedy=True))
        ds = jax.eval_shape(eng.init_decode_state)
        slot = jax.ShapeDtypeStruct((4,), jnp.int32)
        lowered = eng.lowered("prefill_slots", eng.load_params(), ds,
                              jax.ShapeDtypeStruct((4, 16), jnp.int32), slot,
                              jax.ShapeDtypeStruct((4,), jnp.bool_))
        temps[max_len] = lowered.compile().memory_analysis().temp_size_in_bytes
    assert temps[1024] < 1.5 * temps[64], temps
