"""bf16 models train on float32 master weights (models/precision.py), and every step measures
the sampler / learner log-prob gap (algo.sampler_gap) and can correct for it."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from oracles import finished_rows, policy_token_logprobs, row_plan_of

from tppo_jax import algo
from tppo_jax.config import AlgoConfig, Config, ModelSettings, OptimConfig
from tppo_jax.learner import Learner, LearnerConfig, TrainBatch
from tppo_jax.learner.init import init_state, master_params
from tppo_jax.models.precision import cast_params
from tppo_jax.models.transformer import ModelConfig, create_model
from tppo_jax.models.value import ValueModel
from tppo_jax.weights.params import compute_copy

GAP = ("sampler_gap_abs_mean", "sampler_gap_abs_max", "sampler_kl", "sampler_clip_frac")


def _models(dtype, **kw):
    mc = ModelConfig.tiny(vocab_size=32, num_layers=1, hidden_size=32, intermediate_size=64,
                          num_heads=2, num_kv_heads=1, head_dim=16, dtype=dtype, **kw)
    policy = create_model(mc, seed=0)
    critic = ValueModel.from_policy(policy)
    (pdef, pst), (vdef, vst) = nnx.split(policy), nnx.split(critic)
    return pdef, nnx.to_pure_dict(pst), vdef, nnx.to_pure_dict(vst)


def _batch(b=8, p=3, n=9, seed=0):
    rng = np.random.default_rng(seed)
    lens = rng.integers(3, n + 1, size=b)
    return finished_rows(rng, lens, p, n, reward=jnp.asarray(np.arange(b) % 2, jnp.float32),
                         correct=jnp.arange(b) % 2 == 1)


def _run_cfg(dtype, param_dtype="float32", lr=1e-6, **algo_kw):
    return Config(model=ModelSettings(dtype=dtype, param_dtype=param_dtype),
                  algo=AlgoConfig(**algo_kw),
                  optim=OptimConfig(policy_lr=lr, value_lr=lr, warmup_steps=0, minibatches=1))


def _step(cfg, pdef, pp, vdef, vp, batch, ref=None):
    """One ``Learner.step`` as the trainer runs it: master params, then the step."""
    lc = LearnerConfig.from_config(cfg, window=batch.shape[1])
    learner = Learner(pdef, vdef, lc)
    pp, vp = jax.tree.map(jnp.copy, (pp, vp))  # the step donates them
    state = init_state(pp, vp, lc)
    before = jax.device_get(state.policy)
    new, stats = learner.step(state, batch, row_plan_of(batch), ref=ref)
    return before, jax.device_get(new.policy), {k: float(v) for k, v in stats.policy.items()}


def _moved(before, after):
    a = np.concatenate([np.ravel(x) for x in jax.tree.leaves(before)]).astype(np.float32)
    b = np.concatenate([np.ravel(x) for x in jax.tree.leaves(after)]).astype(np.float32)
    return float(np.mean(a != b))


def _on_policy(pdef, pp, batch, dtype=None):
    """``batch`` whose sample_logprobs are the policy's own full forward (``dtype``: its
    params cast so first, as a sampler in that precision would)."""
    model = nnx.merge(pdef, cast_params(pp, dtype))
    lp, _ = policy_token_logprobs(model, batch.tokens, batch.attn, 1.0)
    return batch.replace(sample_logprobs=lp.astype(jnp.float32))


@pytest.mark.slow  # ~9 s in one process on 2 shared cores
def test_bf16_master_weights_move_at_lr_1e6_and_pure_bf16_does_not():
    pdef, pp, vdef, vp = _models("bfloat16")
    batch = _on_policy(pdef, pp, _batch(), "float32")  # a sampler in fp32
    before, after, stats = _step(_run_cfg("bfloat16"), pdef, pp, vdef, vp, batch)
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(after))  # float32 masters
    assert _moved(before, after) > 0.9, _moved(before, after)
    # model.param_dtype: bfloat16 (the behaviour before masters): the update rounds away
    before, after, _ = _step(_run_cfg("bfloat16", "bfloat16"), pdef, pp, vdef, vp, batch)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(after))
    assert _moved(before, after) < 0.05, _moved(before, after)
    # the gap (learner bf16 vs an fp32 forward of the same weights): measured, finite
    assert stats["sampler_gap_abs_mean"] > 0 and stats["sampler_gap_abs_max"] > 0
    assert all(np.isfinite(stats[k]) for k in (*GAP, "sampler_prob_ratio_err"))
    assert stats["sampler_prob_ratio_err"] == pytest.approx(
        np.exp(stats["sampler_gap_abs_mean"]), rel=1e-6)


@pytest.mark.slow  # three small learners compile
def test_gap_is_exactly_zero_in_fp32_and_the_correction_off_changes_nothing():
    pdef, pp, vdef, vp = _models("float32")
    cfg = _run_cfg("float32", lr=1e-3)
    batch = _batch(seed=2)
    # The sampler: the learner's own no-gradient forward (the same row groups and widths);
    # an fp32 forward over the whole buffer at once differs in the last bits (~1e-8)
    learner = Learner(pdef, vdef, LearnerConfig.from_config(cfg, window=batch.shape[1]))
    rows = row_plan_of(batch)
    batch = batch.replace(sample_logprobs=learner.row_pass(learner.group_logprobs, pp, batch,
                                                           rows.lengths))
    assert LearnerConfig.from_config(cfg).compute_dtype is None
    assert LearnerConfig.from_config(cfg).param_dtype is None
    assert master_params(pp, None, None) is pp and compute_copy(pp, cfg) is pp
    _, after, stats = _step(cfg, pdef, pp, vdef, vp, batch)
    for k in GAP:
        assert stats[k] == 0.0, (k, stats[k])
    assert stats["sampler_prob_ratio_err"] == 1.0
    # recompute: the ratio's old policy is the learner's own forward, which here is the
    # sampler's: the same update to the bit
    for fix in ("recompute", "tis"):  # tis: every weight min(exp(0), C) = 1
        _, again, st = _step(_run_cfg("float32", lr=1e-3, sampler_correction=fix),
                             pdef, pp, vdef, vp, batch)
        for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(again), strict=True):
            np.testing.assert_array_equal(a, b)
    assert st["tis_weight_mean"] == pytest.approx(1.0, abs=1e-6)


def test_sampler_gap_and_tis_weights_by_hand():
    logp = jnp.log(jnp.array([[0.5, 0.2, 0.9, 0.3]]))
    samp = jnp.log(jnp.array([[0.5, 0.1, 0.6, 0.3]]))
    mask = jnp.array([[1.0, 1.0, 1.0, 0.0]])
    g = algo.sampler_gap(logp, samp, mask, eps_low=0.2, eps_high=0.28)
    d = np.log([1.0, 2.0, 1.5])
    np.testing.assert_allclose(float(g["sampler_gap_abs_mean"]), np.abs(d).mean(), rtol=1e-6)
    np.testing.assert_allclose(float(g["sampler_gap_abs_max"]), np.log(2.0), rtol=1e-6)
    np.testing.assert_allclose(float(g["sampler_kl"]), np.mean(np.exp(d) - 1 - d), rtol=1e-5)
    np.testing.assert_allclose(float(g["sampler_clip_frac"]), 2 / 3, rtol=1e-6)
    w = algo.tis_weights(logp, samp, cap=1.8)
    np.testing.assert_allclose(np.asarray(w)[0, :3], [1.0, 1.8, 1.5], rtol=1e-6)
    # TIS scales each token's surrogate by its weight
    adv = jnp.ones((1, 4))
    plain, _ = algo.policy_loss(logp, logp, adv, mask, dual_clip_c=None)
    weighted, _ = algo.policy_loss(logp, logp, adv, mask, dual_clip_c=None, weights=w)
    np.testing.assert_allclose(float(weighted), float(plain) * (1.0 + 1.8 + 1.5) / 3, rtol=1e-6)


@pytest.mark.slow  # ~12 s in one process on 2 shared cores
def test_decode_and_learner_in_bf16_on_the_05b_head_geometry_report_the_gap():
    """The decode loop samples in bf16 on Qwen2.5-0.5B's attention geometry (14 q heads,
    2 kv heads, head_dim 64; random weights, 2 small layers); the learner, on float32
    masters cast to bf16, measures its gap to the sampled log-probs. In fp32 the two
    programs agree to rounding, in bf16 they do not."""
    from tppo_jax.config import RolloutConfig
    from tppo_jax.data.synthetic import SyntheticMathTask
    from tppo_jax.rollout.decode import SamplingParams
    from tppo_jax.rollout.scheduler import TruncatedRolloutScheduler

    gaps = {}
    for dtype in ("float32", "bfloat16"):
        mc = ModelConfig.tiny(vocab_size=48, num_layers=2, hidden_size=128,
                              intermediate_size=256, num_heads=14, num_kv_heads=2,
                              head_dim=64, dtype=dtype)
        policy = create_model(mc, seed=1)
        pdef, pst = nnx.split(policy)
        vdef, _ = nnx.split(ValueModel.from_policy(policy))
        examples = itertools.cycle(SyntheticMathTask(seed=0).sample(20))
        encode = lambda e: [2 + (ord(c) % 40) for c in e.question][:12]  # noqa: E731
        r = RolloutConfig(prompts_per_step=2, group_size=2, max_prompt_len=12,
                          max_response_len=16, window=16, kv_cache="dense")
        sched = TruncatedRolloutScheduler(policy, examples, encode, r, eos_ids=(1,),
                                          sampling=SamplingParams(), seed=0)
        rb = sched.step()
        width = int(rb.total_len.max())
        batch = TrainBatch(
            tokens=jnp.asarray(rb.tokens[:, :width]),
            attn=jnp.asarray(np.arange(width)[None] < rb.total_len[:, None]),
            sample_logprobs=jnp.asarray(rb.sample_logprobs[:, :width]),
            prompt_len=jnp.asarray(rb.prompt_len), window_start=jnp.asarray(rb.window_start),
            window_len=jnp.asarray(rb.window_len), finished=jnp.asarray(rb.finished),
            reward=jnp.zeros(4, jnp.float32), correct=jnp.zeros(4, bool))
        # The learner's no-gradient forward (the programs its loss runs, without the update),
        # on float32 masters cast to the compute dtype, against the decode loop's log-probs
        cfg = _run_cfg(dtype)
        learner = Learner(pdef, vdef, LearnerConfig.from_config(cfg, window=width))
        rows = row_plan_of(batch)
        masters = master_params(nnx.to_pure_dict(pst), None,
                                LearnerConfig.from_config(cfg).param_dtype)
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(masters))
        lp = learner.row_pass(learner.group_logprobs, masters, batch, rows.lengths)
        win = np.zeros(batch.shape, bool)  # the sampled (response) tokens
        for r in range(4):
            win[r, rb.window_start[r]:rb.total_len[r]] = True
        stats = {k: float(v) for k, v in algo.sampler_gap(
            lp, batch.sample_logprobs, jnp.asarray(win), eps_low=0.2, eps_high=0.28).items()}
        gaps[dtype] = stats
        assert all(np.isfinite(stats[k]) for k in GAP)
    assert gaps["float32"]["sampler_gap_abs_max"] < 1e-4, gaps["float32"]
    assert gaps["bfloat16"]["sampler_gap_abs_mean"] > 10 * gaps["float32"][
        "sampler_gap_abs_mean"], gaps
    print(gaps)


def test_a_bf16_checkpoint_from_before_masters_restores_into_them(tmp_path):
    """A pure-bf16 run's checkpoint (params and AdamW state in bf16, as every bf16 run wrote
    before float32 masters) restores into the float32 template, upcast exactly; and a reader
    with a bf16 template (tppo export / eval of a bf16 run) gets the masters cast to bf16."""
    import optax

    from tppo_jax.runs.checkpoint import Checkpointer

    p = {"w": jnp.asarray([0.0135, -1.5, 3e-3], jnp.bfloat16)}
    opt = optax.adamw(1e-6).init(p)
    ck = Checkpointer(tmp_path / "ck", every=1, keep=2)
    assert ck.save(1, {"policy": p, "policy_opt": opt}, {"step": 1})
    master = jax.tree.map(lambda x: x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x,
                          {"policy": p, "policy_opt": opt})
    step, trees, _ = ck.restore_latest(master)
    assert step == 1 and trees["policy"]["w"].dtype == jnp.float32
    np.testing.assert_array_equal(trees["policy"]["w"], p["w"].astype(jnp.float32))
    assert all(x.dtype == y.dtype for x, y in zip(jax.tree.leaves(trees["policy_opt"]),
                                                  jax.tree.leaves(master["policy_opt"]),
                                                  strict=True))
    ck.save(2, {"policy": {"w": jnp.asarray([0.1, 0.2, 0.3], jnp.float32)}}, {"step": 2})
    got = ck.restore_item(2, "policy", p)["w"]
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(got, jnp.asarray([0.1, 0.2, 0.3], jnp.bfloat16))
    ck.close()
