"""TruncatedRolloutScheduler invariants (docs/algorithm.md section 7) with a real tiny policy."""

import itertools

import numpy as np
import pytest

from tppo_jax.config import RolloutConfig
from tppo_jax.data.synthetic import SyntheticMathTask
from tppo_jax.models.transformer import ModelConfig, create_model
from tppo_jax.rollout.decode import SamplingParams
from tppo_jax.rollout.engine import DecodeEngine
from tppo_jax.rollout.scheduler import TruncatedRolloutScheduler

EOS = 1


def _scheduler(window, L=24, slots=6, group=2, kv="keep", seed=0, cache="dense", pages=0,
               alloc="on_demand", chunk=256):
    task = SyntheticMathTask(seed=0)
    examples = itertools.cycle(task.sample(50))
    model = create_model(ModelConfig.tiny(vocab_size=48), seed=seed)
    encode = lambda e: [2 + (ord(c) % 40) for c in e.question][:12]  # noqa: E731
    rollout = RolloutConfig(prompts_per_step=slots // group, group_size=group, max_prompt_len=12,
                            max_response_len=L, window=window, kv_policy=kv, kv_cache=cache,
                            page_size=4, num_pages=pages, page_alloc=alloc, page_chunk=chunk,
                            page_reserve=0.0)
    return TruncatedRolloutScheduler(model, examples, encode, rollout, eos_ids=(EOS,),
                                     sampling=SamplingParams(), seed=seed)


@pytest.mark.parametrize("kv,cache", [("keep", "dense"), ("reprefill", "dense"),
                                      ("keep", "paged")])
@pytest.mark.slow  # ~6 s in one process on 2 shared cores
def test_successive_batching_invariants(kv, cache):
    s = _scheduler(window=8, kv=kv, cache=cache)
    prev = None
    seen_windows: dict[int, int] = {}
    for _ in range(8):
        rb = s.step()
        assert rb.tokens.shape[0] == s.B  # B constant every step
        assert np.all(rb.window_len <= 8)
        assert np.all(rb.window_index < s.K)  # no sequence exceeds K windows
        if prev is not None:
            # A continuation keeps its slot; its context grew by exactly its window tokens.
            cont = ~prev.finished
            assert np.all(rb.window_start[cont] == prev.total_len[cont])
            for r in np.flatnonzero(cont):
                a = prev.total_len[r]
                np.testing.assert_array_equal(rb.tokens[r, :a], prev.tokens[r, :a])
                assert rb.window_index[r] == prev.window_index[r] + 1
        for r in range(s.B):
            sid = int(s.state.seq_id[r])
            seen_windows[sid] = seen_windows.get(sid, 0) + 1
            assert seen_windows[sid] <= s.K
            n = rb.window_len[r]
            sl = slice(rb.window_start[r], rb.window_start[r] + n)
            assert np.all(rb.sample_logprobs[r, sl] <= 0)
            assert np.all(rb.policy_version[r, sl] == s.policy_version)
        # Finished = EOS or the K-th window full; unfinished rows filled their whole window.
        resp = rb.total_len - rb.prompt_len
        eos = np.array([rb.tokens[r, rb.total_len[r] - 1] == EOS for r in range(s.B)])
        np.testing.assert_array_equal(rb.finished, eos | (resp >= 24))
        assert np.all(rb.window_len[~rb.finished] == 8)
        prev = rb
        s.release_finished(rb.finished)


def test_ppo_mode_is_one_window_and_counts_idle():
    s = _scheduler(window=24)
    assert s.K == 1
    rb = s.step()
    assert np.all(rb.finished) and np.all(rb.window_index == 0)
    occupancy = s.stats["useful_tokens"] / s.stats["slot_steps"]
    assert 0 < occupancy <= 1


@pytest.mark.slow  # ~12 s in one process on 2 shared cores
def test_reprefill_matches_full_forward_and_keep_does_not():
    """After a weight change, `reprefill` log-probs equal the new policy's full-sequence
    (teacher-forced) log-probs of the same tokens; `keep` reads a stale cache and does not."""
    import jax.numpy as jnp
    from oracles import policy_token_logprobs

    gaps = {}
    for kv in ("keep", "reprefill"):
        s = _scheduler(window=8, kv=kv, L=24)
        s.step()
        new = create_model(ModelConfig.tiny(vocab_size=48), seed=123)
        s.set_policy(new, 1)
        s.release_finished(np.zeros(s.B, bool))
        rb = s.step()
        attn = np.arange(rb.tokens.shape[1])[None] < rb.total_len[:, None]
        lp, _ = policy_token_logprobs(new, jnp.asarray(rb.tokens), jnp.asarray(attn), 1.0)
        win = np.zeros_like(attn)
        for r in range(s.B):
            win[r, rb.window_start[r]:rb.total_len[r]] = True
        gaps[kv] = float(np.abs(np.asarray(lp) - rb.sample_logprobs)[win].max())
    assert gaps["reprefill"] < 1e-4, gaps
    assert gaps["keep"] > 1e-2, gaps


def test_state_dict_roundtrip():
    s = _scheduler(window=8)
    rb = s.step()
    s.release_finished(rb.finished)
    d = s.state_dict()
    s2 = _scheduler(window=8)
    s2.load_state_dict(d)
    for k, v in s.state.to_dict().items():
        np.testing.assert_array_equal(v, getattr(s2.state, k))
    assert s2.pending == s.pending
    # a checkpoint written while the group baseline's ``so_far`` existed still loads
    s3 = _scheduler(window=8)
    s3.load_state_dict({**d, "outcomes": {"0": [1.0, 1]}})
    assert s3.pending == s.pending


@pytest.mark.slow  # ~17 s in one process on 2 shared cores
def test_paged_equals_dense_and_short_pool_admits_fewer():
    """With enough pages the paged cache decodes exactly what the dense one does; with a
    short pool, continuations keep going, fewer prompts are admitted, and what is decoded
    still matches the policy's full forward (no live page was overwritten)."""
    import jax.numpy as jnp
    from oracles import policy_token_logprobs

    dense, paged = _scheduler(window=8), _scheduler(window=8, cache="paged")
    for _ in range(4):
        a, b = dense.step(), paged.step()
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.sample_logprobs, b.sample_logprobs, atol=1e-5)
        dense.release_finished(a.finished)
        paged.release_finished(b.finished)
    # The G=2 samples of a prompt admitted together prefilled it once and share its pages.
    assert paged.stats["shared_prefills"] > 0

    # 6 slots x (12 + 24) tokens would need 54 pages of 4; give it 20 (whole windows).
    short = _scheduler(window=8, cache="paged", pages=20, alloc="window")
    idle_seen = deferred = 0
    for _ in range(5):
        rb = short.step()
        assert rb.tokens.shape[0] == short.B
        idle_seen += int((~short.state.live).sum())
        m = short.step_metrics()  # this step's counts, what metrics.jsonl logs as sched_*
        deferred += m["admissions_deferred"]
        assert m["pages_total"] == 20 and 0 < m["pages_in_use"] <= 20
        assert m["decode_slot_steps"] == short.B * int(rb.window_len.max())
        live = short.state.live
        attn = np.arange(rb.tokens.shape[1])[None] < rb.total_len[:, None]
        lp, _ = policy_token_logprobs(short.model, jnp.asarray(rb.tokens), jnp.asarray(attn), 1.0)
        for r in np.flatnonzero(live & (rb.window_len > 0)):
            sl = slice(rb.window_start[r], rb.total_len[r])
            np.testing.assert_allclose(np.asarray(lp)[r, sl], rb.sample_logprobs[r, sl],
                                       atol=1e-4)
        short.release_finished(rb.finished)
    assert idle_seen > 0 and deferred == short.stats["admissions_deferred"] > 0


@pytest.mark.parametrize("cache,pages", [("dense", 0), ("paged", 16)])
@pytest.mark.slow  # ~20 s in one process on 2 shared cores (~3x that at load 15)
def test_restored_scheduler_continues_exactly(cache, pages):
    """checkpoint_items() + host_state() into a fresh scheduler's restore() (what a
    checkpoint holds): the next windows, in-flight continuations included, are exactly the
    uninterrupted ones; with a short pool, rows preempted when it was saved included."""
    import copy

    make = lambda: _scheduler(window=8, cache=cache, pages=pages, chunk=4)  # noqa: E731
    a, b = make(), make()
    for _ in range(2):
        for s in (a, b):
            s.release_finished(s.step().finished)
    saved, trees = copy.deepcopy(b.host_state()), b.checkpoint_items()
    assert set(trees) == {"slots", "kv_cache"}
    c = make()
    c.prompts = b.prompts  # the data iterator is checkpointed by the trainer, not here
    c.restore(trees, saved)
    assert (c.state.live & (c.state.windows_done > 0)).any()  # continuations in flight
    np.testing.assert_array_equal(c.waiting, b.waiting)
    assert b.waiting.any() == bool(pages)  # a short pool saved preempted rows
    for _ in range(3):
        ra, rc = a.step(), c.step()
        np.testing.assert_array_equal(ra.tokens, rc.tokens)
        np.testing.assert_array_equal(ra.sample_logprobs, rc.sample_logprobs)
        a.release_finished(ra.finished)
        c.release_finished(rc.finished)


@pytest.mark.parametrize("kv", ["keep", "reprefill"])
@pytest.mark.slow  # ~6 s in one process on 2 shared cores
def test_prefill_runs_over_the_columns_it_needs(kv):
    """Structure: a prefill's token columns are the longest prefilled row's width bucket, not
    the whole prompt + L buffer (new prompts of a keep run: one 32-column bucket here)."""
    from tppo_jax.buckets import bucket_width

    s = _scheduler(window=8, L=96, kv=kv)
    widths, needed = [], []
    real = s.engine.prefill_slots

    def recording(params, ds, tokens, lengths, rows):
        widths.append(tokens.shape[1])
        needed.append(int(np.asarray(lengths)[np.asarray(rows)].max()))
        return real(params, ds, tokens, lengths, rows)

    s.engine.prefill_slots = recording
    for _ in range(6):
        rb = s.step()
        s.release_finished(rb.finished)
    assert s.state.tokens.shape[1] == 12 + 96 and widths
    assert widths == [bucket_width(n, 108) for n in needed]
    if kv == "keep":
        assert set(widths) == {32}
    else:  # continuations are re-prefilled over their grown context
        assert max(widths) > 32


# One owner per slot fact: the engine's decode state holds each slot's pending token, position,
# response length, liveness and `finished`; the scheduler sets them only when a sequence enters
# a slot and reads them back; sequence ids come from `DecodeEngine.new_seq_ids` alone.
@pytest.mark.parametrize("kv,cache", [("keep", "dense"), ("reprefill", "dense"),
                                      ("keep", "paged")])
@pytest.mark.slow  # ~8 s in one process on 2 shared cores
def test_engine_state_follows_the_record_without_being_pushed(kv, cache):
    s = _scheduler(window=8, L=24, kv=kv, cache=cache)
    for _ in range(7):
        rb = s.step()
        position, generated, live = (np.asarray(x) for x in
                                     (s.ds.position, s.ds.generated, s.ds.live))
        response = rb.total_len - rb.prompt_len
        decoding = s.state.live & ~rb.finished
        np.testing.assert_array_equal(live, decoding)
        np.testing.assert_array_equal(position[decoding], rb.total_len[decoding] - 1)
        np.testing.assert_array_equal(generated[decoding], response[decoding])
        last = rb.tokens[np.arange(s.B), np.maximum(rb.total_len - 1, 0)]
        # finished is the engine's: EOS, or L response tokens; nothing else ends a row
        ended = s.state.live & ((last == EOS) & (rb.window_len > 0) | (response >= s.L))
        np.testing.assert_array_equal(rb.finished, ended)
        s.release_finished(rb.finished)


@pytest.mark.slow  # ~7 s in one process on 2 shared cores
def test_sequence_ids_are_minted_once_and_survive_a_restore():
    s = _scheduler(window=8, L=24)
    seen: set[int] = set()
    for _ in range(4):
        rb = s.step()
        seen |= set(s.state.seq_id[s.state.live].tolist())
        s.release_finished(rb.finished)
    assert seen == set(range(s.engine.next_seq))  # every id minted was used, none twice
    saved = s.state_dict()
    t = _scheduler(window=8, L=24)
    t.load_state_dict(saved)
    assert t.engine.next_seq == s.engine.next_seq
    s.step()
    t.step()
    np.testing.assert_array_equal(t.state.seq_id, s.state.seq_id)


def test_engine_finishes_a_sequence_at_max_new_tokens():
    model = create_model(ModelConfig.tiny(vocab_size=48), seed=0)
    eng = DecodeEngine(model, eos_ids=(), max_slots=2, max_target_length=40, max_new_tokens=5,
                       kv_cache="dense", sampling=SamplingParams())
    params = eng.load_params()
    tokens = np.array([[3, 4, 5, 6], [7, 8, 9, 0]], np.int32)
    ds, _ = eng.prefill_prompts(params, tokens, np.array([4, 3]))
    ds, out = eng.generate_window(ds, params, 3)
    assert np.asarray(out.count).tolist() == [3, 3] and not np.asarray(out.finished).any()
    ds, out = eng.generate_window(ds, params, 3)
    assert np.asarray(out.count).tolist() == [2, 2]  # the window stops at the 5th token
    assert np.asarray(out.finished).all() and not np.asarray(ds.live).any()
    assert np.asarray(ds.generated).tolist() == [5, 5]
    ids = eng.new_seq_ids(3)
    assert ids.dtype == np.uint32 and ids.tolist() == [0, 1, 2] and eng.next_seq == 3


@pytest.mark.parametrize("alloc,need", [("window", 5), ("on_demand", 3)])
def test_a_pool_that_admits_nothing_stops_the_run_in_one_line(alloc, need):
    """Issue 49 M4: a paged pool with no room for one prompt and its window deferred every
    admission forever: steps of 0 tokens, no error. (A 12-token prompt and a window of 8
    need 5 pages of 4; on demand, the prompt and its first token 3.)"""
    from tppo_jax.config import ConfigError
    from tppo_jax.rollout.scheduler import MAX_IDLE_STEPS

    s = _scheduler(window=8, cache="paged", pages=2, alloc=alloc)
    with pytest.raises(ConfigError) as e:
        for _ in range(MAX_IDLE_STEPS):
            s.step()
    msg = str(e.value)
    assert "\n" not in msg and f"admitted no prompt for {MAX_IDLE_STEPS} steps" in msg
    assert "raise rollout.num_pages" in msg and f"({need} pages)" in msg


def _finished_samples(s, steps):
    """``{seq_id: (response tokens, their log-probs, window index)}`` of the rows that
    finished in ``steps`` steps."""
    out = {}
    for _ in range(steps):
        rb = s.step()
        for r in np.flatnonzero(rb.finished):
            sl = slice(rb.prompt_len[r], rb.total_len[r])
            out[int(s.state.seq_id[r])] = (rb.tokens[r, sl], rb.sample_logprobs[r, sl],
                                           int(rb.window_index[r]))
        s.release_finished(rb.finished)
    return out


@pytest.mark.slow  # 32 s in one process at load 15 on 2 cores (~10 s unloaded)
def test_preempted_rows_sample_what_a_large_pool_samples():
    """Pages on demand (chunks of 4 tokens): a pool of 20 pages for 6 slots that grow to 9
    pages each preempts rows and re-prefills them in the same window; every sample, its
    log-probs and its windows are those of a pool with room for every slot. (The tokens the
    re-prefilled cache then samples are keyed by sequence and position, not loop step.)"""
    big = _scheduler(window=8, kv="reprefill", cache="paged", chunk=4)
    small = _scheduler(window=8, kv="reprefill", cache="paged", pages=20, chunk=4)
    a, b = _finished_samples(big, 5), _finished_samples(small, 5)
    assert small.stats["preempted"] > 0 and small.stats["reprefill_tokens"] > 0
    assert small.stats.get("stalled", 0) == 0
    assert len(b) >= 6 and set(b) <= set(a)
    for k, (toks, lps, window) in b.items():
        np.testing.assert_array_equal(toks, a[k][0])
        np.testing.assert_allclose(lps, a[k][1], atol=1e-5)
        assert window == a[k][2]
