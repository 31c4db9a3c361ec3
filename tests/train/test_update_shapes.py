"""Static shapes for the update: bucketed widths and row groups bound the compiles;
CompileWatch counts them; a minibatch's row groups give the step of the whole minibatch
(structure and exactness only; speed is measured in results/README.md, not asserted)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tppo_jax.buckets import bucket_width, width_buckets
from tppo_jax.config import AlgoConfig, OptimConfig
from tppo_jax.models.transformer import ModelConfig, create_model
from tppo_jax.models.value import ValueModel
from tppo_jax.train.shapes import CompileWatch
from tppo_jax.train.step import StepConfig, make_optimizer
from tppo_jax.train.update import make_updater, plan_cells, policy_update, value_update
from tppo_jax.train.update_plan import group_rows, plan_update


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
    return {"tokens": jnp.asarray(np.where(attn, rng.integers(2, 30, (b, width)), 0),
                                  jnp.int32), "attn": jnp.asarray(attn),
            "sample_logprobs": f(-rng.random((b, width)) * 3),
            "advantages": f(rng.normal(size=(b, width))),
            "policy_mask": f(rng.random((b, width)) < 0.8).at[:, 0].set(0.0),
            "positive_mask": f(rng.random((b, width)) < 0.3),
            "values_old": f(rng.normal(size=(b, width))), "returns": f(rng.random((b, width))),
            "value_mask": f(rng.random((b, width)) < 0.7)}


@pytest.mark.parametrize("aggregation", ["token", "sample"])
@pytest.mark.slow  # ~26 s in one process on 2 shared cores
def test_row_groups_give_the_minibatchs_step(aggregation):
    """Rows of 5..90 columns in 3 width buckets, updated as row groups, move params exactly
    as one pass over the whole batch at the full width (every row in one group)."""
    policy = create_model(ModelConfig.tiny(vocab_size=32))
    models = {policy_update: nnx.split(policy), value_update: nnx.split(
        ValueModel.from_policy(policy))}
    lengths = np.array([90, 5, 40, 12, 70, 33, 8, 20])
    batch = _rows_of_lengths(lengths, 96)
    optim = OptimConfig(warmup_steps=1, minibatches=2)
    cfg = StepConfig(algo=AlgoConfig(loss_aggregation=aggregation), optim=optim, window=8,
                     temperature=1.0)
    tx = optax.sgd(1e-2)  # params move by exactly the gradient (small: the 2nd minibatch's
    for update, (gd, st) in models.items():
        base, outs = nnx.to_pure_dict(st), []
        for lens in (lengths, np.full(8, 96)):  # row groups; one full-width group
            params = jax.tree.map(jnp.array, base)
            new, _, stats = update(gd, params, tx.init(params), batch, tx=tx, cfg=cfg,
                                   lengths=lens)
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
    optim = OptimConfig(warmup_steps=1, minibatches=2)
    tx = make_optimizer(1e-3, optim)
    cfg = StepConfig(algo=AlgoConfig(), optim=optim, window=8, temperature=1.0)
    opt = tx.init(params)
    upd = make_updater("policy", gd, tx=tx, cfg=cfg)
    lengths = [5, 17, 30, 40, 33, 60, 47, 90, 12, 71, 88, 52]
    rng = np.random.default_rng(0)
    with CompileWatch({"policy_update": upd.grads}) as watch:
        for n in lengths:
            w = bucket_width(n, 96)
            batch = {"tokens": jnp.asarray(rng.integers(2, 30, (4, w)), jnp.int32),
                     "attn": jnp.asarray(np.arange(w)[None] < n).repeat(4, 0),
                     "sample_logprobs": jnp.full((4, w), -3.0),
                     "advantages": jnp.ones((4, w)), "policy_mask": jnp.ones((4, w)),
                     "positive_mask": jnp.zeros((4, w))}
            params, opt, _ = upd(params, opt, batch)
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
    from tppo_jax.parallel.mesh import make_mesh
    from tppo_jax.train.state import commit_to_mesh

    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
    gd, st = nnx.split(create_model(ModelConfig.tiny(vocab_size=32), mesh=mesh))
    params = nnx.to_pure_dict(st)
    optim = OptimConfig(warmup_steps=1, minibatches=2)
    tx = make_optimizer(1e-3, optim)
    opt = commit_to_mesh(tx.init(params), mesh)
    cfg = StepConfig(algo=AlgoConfig(), optim=optim, window=8, temperature=1.0)
    fn = make_updater("policy", gd, tx=tx, cfg=cfg, mesh=mesh, params=params, opt_state=opt)
    b, s = 4, 32
    batch = {"tokens": jnp.ones((b, s), jnp.int32), "attn": jnp.ones((b, s), bool),
             "sample_logprobs": jnp.full((b, s), -3.0), "advantages": jnp.ones((b, s)),
             "policy_mask": jnp.ones((b, s)), "positive_mask": jnp.zeros((b, s))}
    for _ in range(3):
        params, opt, _ = fn(params, opt, batch)
    assert fn.grads._cache_size() == 1 and fn.apply._cache_size() == 1


def test_detach_prefix_plans_forward_only_columns_before_every_window():
    """Each group's forward-only prefix is a multiple of 64 columns, below its width and
    before the column that predicts any of its rows' first window token."""
    lengths = np.array([300, 290, 200, 140, 90, 40, 260, 75])
    starts = np.array([256, 230, 150, 130, 40, 20, 200, 64])
    plan = plan_update(lengths, minibatches=1, epochs=1, grad_accum=1, unit=1, cap=320,
                       first_needed=starts - 1)
    groups = plan[0].groups
    for g in groups:
        assert g.grad_from % 64 == 0 and g.grad_from < g.width
        assert g.grad_from <= (starts[g.rows[g.valid]] - 1).min()
    assert max(g.grad_from for g in groups) >= 128
    assert all(g.grad_from == 0 for g in plan_update(
        lengths, minibatches=1, epochs=1, grad_accum=1, unit=1, cap=320)[0].groups)


@pytest.mark.slow  # ~25 s in one process on 2 shared cores
def test_detach_prefix_update_keeps_the_loss_and_moves_the_params_nearly_alike():
    """On rows whose trained tokens are a late window, the detached update reports the same
    loss (the forward's values are the full one's) and takes a step close to, but not equal
    to, the full-gradient step."""
    policy = create_model(ModelConfig.tiny(vocab_size=32))
    gd, st = nnx.split(policy)
    lengths = np.array([150, 140, 130, 100, 90, 70])
    starts = lengths - 24
    batch = _rows_of_lengths(lengths, 160)
    window = (np.arange(160)[None] >= starts[:, None]) & (np.arange(160)[None] < lengths[:, None])
    batch["policy_mask"] = jnp.asarray(window, jnp.float32)
    batch["positive_mask"] = jnp.zeros_like(batch["policy_mask"])
    optim = OptimConfig(warmup_steps=1, minibatches=1)
    tx = optax.sgd(1e-2)
    out = {}
    for detach in (False, True):
        cfg = StepConfig(algo=AlgoConfig(detach_prefix=detach), optim=optim, window=32,
                         temperature=1.0)
        upd = make_updater("policy", gd, tx=tx, cfg=cfg)
        plan = upd.plan(lengths, 160, train_start=starts)
        assert any(g.grad_from for mb in plan for g in mb.groups) == detach
        params = jax.tree.map(jnp.array, nnx.to_pure_dict(st))
        new, _, stats = upd(params, tx.init(params), batch, plan=plan)
        out[detach] = (jax.device_get(new), jax.device_get(stats))
    np.testing.assert_allclose(out[True][1]["policy_loss"], out[False][1]["policy_loss"],
                               rtol=1e-5)
    base = jax.tree.leaves(nnx.to_pure_dict(st))
    d_full = np.concatenate([np.ravel(a - p) for a, p in zip(
        jax.tree.leaves(out[False][0]), base, strict=True)])
    d_det = np.concatenate([np.ravel(a - p) for a, p in zip(
        jax.tree.leaves(out[True][0]), base, strict=True)])
    cos = d_full @ d_det / (np.linalg.norm(d_full) * np.linalg.norm(d_det))
    assert 0.5 < cos < 1 - 1e-6


def test_detach_prefix_groups_rows_by_prefix_and_cuts_the_width_after_it():
    """A row whose whole response trains (start 30) never shares a group with rows whose
    windows start late, and a detached group is its prefix plus a bucket, not a power of
    two of the whole row."""
    lengths = np.array([300, 290, 280, 310])
    starts = np.array([250, 240, 230, 30])  # the last: a positive example, trained whole
    plan = plan_update(lengths, minibatches=1, epochs=1, grad_accum=1, unit=1, cap=576,
                       first_needed=starts - 1)
    by_row = {int(r): g for g in plan[0].groups for r in g.rows[g.valid]}
    assert by_row[3].grad_from == 0 and by_row[3].width == 512
    assert {by_row[r].grad_from for r in (0, 1, 2)} == {192}
    assert by_row[0].width == 192 + 128  # 300 - 192 = 108 -> the 128 bucket
