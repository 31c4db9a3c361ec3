"""Static shapes for the update: bucketed widths and row groups bound the compiles;
CompileWatch counts them; a minibatch's row groups give the step of the whole minibatch
(structure and exactness only; speed is measured in results/README.md, not asserted)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from oracles import batch_and_targets, learner_with, update

from tppo_jax.buckets import CompileWatch, bucket_width, width_buckets
from tppo_jax.config import AlgoConfig, OptimConfig
from tppo_jax.learner import Learner, LearnerConfig, RowPlan, TrainState
from tppo_jax.learner.plan import group_rows, plan_cells, plan_update
from tppo_jax.models.transformer import ModelConfig, create_model
from tppo_jax.models.value import ValueModel


def test_width_and_row_buckets():
    assert width_buckets(224) == [32, 64, 128, 224]
    assert width_buckets(576) == [32, 64, 128, 256, 512, 576]
    assert [bucket_width(n, 224) for n in (1, 32, 33, 65, 129, 224, 300)] == \
        [32, 32, 64, 128, 224, 224, 224]
    for n in range(1, 577):  # a batch never pays more than twice its width (past 32)
        w = bucket_width(n, 576)
        assert n <= w and (w <= 32 or w < 2 * n)
    # At most 16 x 64 token cells (or one row); multiples of the mesh's batch ways.
    assert [group_rows(w, 16, 1) for w in (32, 64, 128, 256, 512, 576)] == [16, 16, 8, 4, 2, 1]
    assert [group_rows(w, 16, 8) for w in (32, 128, 576)] == [16, 8, 8]


def test_plan_groups_rows_by_width_bucket():
    """Each minibatch's rows longest first, each group at the width bucket of its longest row
    with that width's one row count (padding repeats a row, marked invalid); every row
    exactly once per epoch."""
    lengths = np.array([500, 20, 30, 130, 40, 25, 600, 60])
    plan = plan_update(lengths, minibatches=2, epochs=2, grad_accum=1, unit=1, cap=576,
                       shuffle=np.random.default_rng(0).random((8, 2)))
    assert len(plan) == 4
    for e in range(2):
        seen = []
        for mb in plan[2 * e:2 * e + 2]:
            assert mb.weight.sum() == 4
            for g in mb.groups:
                rows = g.rows[g.valid]
                assert bucket_width(int(lengths[rows].max()), 576) == g.width
                assert len(g.rows) == group_rows(g.width, 4, 1)
                assert set(g.rows[~g.valid]) <= set(rows)
                assert all(mb.weight[r] == 1.0 for r in rows)
                seen += list(rows)
            firsts = [lengths[g.rows[0]] for g in mb.groups]
            assert firsts == sorted(firsts, reverse=True)  # longest rows first
        assert sorted(seen) == list(range(8))
    # The whole batch at 576 columns would be 8 x 576 cells per epoch; the groups pay less.
    assert plan_cells(plan) < 0.6 * 2 * 8 * 576
    # grad_accum caps a group's rows; a subset of rows (the critic's) plans only those.
    acc = plan_update(np.full(8, 5), minibatches=1, epochs=1, grad_accum=4, unit=1, cap=32)
    assert [len(g.rows) for g in acc[0].groups] == [2, 2, 2, 2]
    sub = plan_update(lengths, minibatches=2, epochs=1, grad_accum=1, unit=1, cap=576,
                      rows=np.array([1, 6]))
    assert [sorted(g.rows[g.valid]) for mb in sub for g in mb.groups] == [[1], [6]]
    # ... in groups sized by the whole batch's minibatch (4 rows), whatever the subset's size.
    assert [len(g.rows) for mb in sub for g in mb.groups] == [4, 1]
    empty = plan_update(lengths, minibatches=2, epochs=1, grad_accum=1, unit=1, cap=576,
                        rows=np.array([3]))
    assert len(empty) == 2 and empty[1].groups == ()


def _rows_of_lengths(lengths, width, seed=0):
    rng = np.random.default_rng(seed)
    b = len(lengths)
    attn = np.arange(width)[None] < np.asarray(lengths)[:, None]
    f = lambda x: jnp.asarray(np.where(attn, x, 0), jnp.float32)  # noqa: E731
    return batch_and_targets({
        "tokens": jnp.asarray(np.where(attn, rng.integers(2, 30, (b, width)), 0), jnp.int32),
        "attn": jnp.asarray(attn), "sample_logprobs": f(-rng.random((b, width)) * 3),
        "advantages": f(rng.normal(size=(b, width))),
        "policy_mask": f(rng.random((b, width)) < 0.8).at[:, 0].set(0.0),
        "positive_mask": f(rng.random((b, width)) < 0.3),
        "values_old": f(rng.normal(size=(b, width))), "returns": f(rng.random((b, width))),
        "value_mask": f(rng.random((b, width)) < 0.7)})


@pytest.mark.parametrize("aggregation", ["token", "sample"])
@pytest.mark.slow  # ~26 s in one process on 2 shared cores
def test_row_groups_give_the_minibatchs_step(aggregation):
    """Rows of 5..90 columns in 3 width buckets, updated as row groups, move params exactly
    as one pass over the whole batch at the full width (every row in one group)."""
    policy = create_model(ModelConfig.tiny(vocab_size=32))
    models = {"policy": nnx.split(policy), "value": nnx.split(ValueModel.from_policy(policy))}
    lengths = np.array([90, 5, 40, 12, 70, 33, 8, 20])
    batch, targets = _rows_of_lengths(lengths, 96)
    optim = OptimConfig(warmup_steps=1, minibatches=2)
    cfg = LearnerConfig(algo=AlgoConfig(loss_aggregation=aggregation), optim=optim, window=8,
                        temperature=1.0)
    tx = optax.sgd(1e-2)  # params move by exactly the gradient (small: the 2nd minibatch's
    learner = learner_with(models["policy"][0], models["value"][0], cfg, tx_policy=tx,
                           tx_value=tx)
    for kind, (_, st) in models.items():
        base, outs = nnx.to_pure_dict(st), []
        for lens in (lengths, np.full(8, 96)):  # row groups; one full-width group
            params = jax.tree.map(jnp.array, base)
            new, _, stats = update(learner, kind, params, tx.init(params), batch, targets,
                                   rows=RowPlan(lens, None, np.arange(8)))
            outs.append((jax.device_get(new), jax.device_get(stats)))
        # gradient depends on the 1st step's params, which a big step would amplify)
        moved = zip(jax.tree.leaves(outs[0][0]), jax.tree.leaves(outs[1][0]),
                    jax.tree.leaves(base), strict=True)
        for a, b, p0 in moved:
            np.testing.assert_allclose(a - p0, b - p0, rtol=1e-3, atol=1e-7)
        for k, v in outs[1][1].items():
            np.testing.assert_allclose(outs[0][1][k], v, rtol=2e-4, atol=1e-6, err_msg=k)


@pytest.mark.slow  # ~18 s in one process on 2 shared cores
def test_varying_widths_compile_policy_update_a_bounded_number_of_times():
    """12 'steps' whose rows vary over 12 distinct lengths compile the group gradient once per
    width bucket (3 here; every group 2 rows), not once per length; the watch counts the
    compiles."""
    gd, st = nnx.split(create_model(ModelConfig.tiny(vocab_size=32)))
    params = nnx.to_pure_dict(st)
    optim = OptimConfig(warmup_steps=1, minibatches=2, policy_lr=1e-3)
    learner = Learner(gd, None, LearnerConfig(algo=AlgoConfig(), optim=optim, window=8,
                                              temperature=1.0))
    opt = learner.tx_policy.init(params)
    lengths = [5, 17, 30, 40, 33, 60, 47, 90, 12, 71, 88, 52]
    rng = np.random.default_rng(0)
    with CompileWatch({"policy_update": learner.policy.grads}) as watch:
        for n in lengths:
            w = bucket_width(n, 96)
            batch, targets = batch_and_targets({
                "tokens": jnp.asarray(rng.integers(2, 30, (4, w)), jnp.int32),
                "attn": jnp.asarray(np.arange(w)[None] < n).repeat(4, 0),
                "sample_logprobs": jnp.full((4, w), -3.0),
                "advantages": jnp.ones((4, w)), "policy_mask": jnp.ones((4, w)),
                "positive_mask": jnp.zeros((4, w))})
            params, opt, _ = update(learner, "policy", params, opt, batch, targets)
        count, seconds = watch.take()
        new = watch.new_shapes()
    buckets = {bucket_width(n, 96) for n in lengths}
    assert buckets == {32, 64, 96}
    assert watch.sizes()["policy_update"] == len(buckets) == new["policy_update"][1]
    assert count >= len(buckets) and seconds > 0
    assert watch.take() == (0, 0.0)  # nothing compiled since


@pytest.mark.slow  # ~14 s in one process on 2 shared cores
def test_first_update_compiles_once_per_shape():
    """The trainer's initial optimizer state looks exactly like an update's output (committed,
    on the mesh), so the second step reuses the first step's executable."""
    from tppo_jax.learner import commit_to_mesh
    from tppo_jax.learner.state import policy_optimizer, value_optimizer
    from tppo_jax.parallel.mesh import make_mesh

    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
    policy = create_model(ModelConfig.tiny(vocab_size=32), mesh=mesh)
    gd, st = nnx.split(policy)
    vd, vst = nnx.split(ValueModel.from_policy(policy))
    params, vp = nnx.to_pure_dict(st), nnx.to_pure_dict(vst)
    optim = OptimConfig(warmup_steps=1, minibatches=2, policy_lr=1e-3)
    opt = commit_to_mesh(policy_optimizer(optim).init(params), mesh)
    state = TrainState(params, vp, opt, commit_to_mesh(value_optimizer(optim).init(vp), mesh))
    cfg = LearnerConfig(algo=AlgoConfig(), optim=optim, window=8, temperature=1.0)
    learner = Learner(gd, vd, cfg, mesh=mesh, state=state)
    b, s = 4, 32
    batch, targets = batch_and_targets({
        "tokens": jnp.ones((b, s), jnp.int32), "attn": jnp.ones((b, s), bool),
        "sample_logprobs": jnp.full((b, s), -3.0), "advantages": jnp.ones((b, s)),
        "policy_mask": jnp.ones((b, s)), "positive_mask": jnp.zeros((b, s))})
    for _ in range(3):
        params, opt, _ = update(learner, "policy", params, opt, batch, targets)
    assert learner.policy.grads._cache_size() == 1 and learner.policy.apply._cache_size() == 1
