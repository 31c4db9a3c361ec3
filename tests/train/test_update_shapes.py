"""Static shapes for the update: bucketed widths and rows bound the compiles; CompileWatch
counts them (structure only; speed is measured in README, not asserted)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tppo_jax.buckets import bucket_width, width_buckets
from tppo_jax.config import AlgoConfig, OptimConfig
from tppo_jax.models.transformer import ModelConfig, create_model
from tppo_jax.train.shapes import CompileWatch, bucket_rows
from tppo_jax.train.step import StepConfig, make_optimizer, policy_update


def test_width_and_row_buckets():
    assert width_buckets(224) == [32, 64, 128, 224]
    assert width_buckets(576) == [32, 64, 128, 256, 512, 576]
    assert [bucket_width(n, 224) for n in (1, 32, 33, 65, 129, 224, 300)] == \
        [32, 32, 64, 128, 224, 224, 224]
    for n in range(1, 577):  # a batch never pays more than twice its width (past 32)
        w = bucket_width(n, 576)
        assert n <= w and (w <= 32 or w < 2 * n)
    assert [bucket_rows(k, 32, 2) for k in (1, 3, 5, 9, 17, 32)] == [8, 8, 8, 16, 32, 32]
    assert bucket_rows(1, 32, 2, levels=5) == 2 and bucket_rows(3, 24, 2) == 6
    assert bucket_rows(1, 32, 16) == 16
    assert bucket_rows(1, 12, 4) == 12  # 6 rows would not split into 4 parts


def test_varying_widths_compile_policy_update_a_bounded_number_of_times():
    """12 'steps' whose longest rows vary over 12 distinct lengths compile policy_update once
    per width bucket (3 here), not once per length; the watch counts the compiles."""
    gd, st = nnx.split(create_model(ModelConfig.tiny(vocab_size=32)))
    params = nnx.to_pure_dict(st)
    optim = OptimConfig(warmup_steps=1, minibatches=2)
    tx = make_optimizer(1e-3, optim)
    cfg = StepConfig(algo=AlgoConfig(), optim=optim, window=8, temperature=1.0)
    opt = tx.init(params)
    fn = jax.jit(policy_update.__wrapped__, static_argnames=("graphdef", "tx", "cfg"))
    lengths = [5, 17, 30, 40, 33, 60, 47, 90, 12, 71, 88, 52]
    rng = np.random.default_rng(0)
    with CompileWatch({"policy_update": fn}) as watch:
        for n in lengths:
            w = bucket_width(n, 96)
            batch = {"tokens": jnp.asarray(rng.integers(2, 30, (4, w)), jnp.int32),
                     "attn": jnp.asarray(np.arange(w)[None] < n).repeat(4, 0),
                     "sample_logprobs": jnp.full((4, w), -3.0),
                     "advantages": jnp.ones((4, w)), "policy_mask": jnp.ones((4, w)),
                     "positive_mask": jnp.zeros((4, w))}
            params, opt, _ = fn(gd, params, opt, batch, tx=tx, cfg=cfg)
        count, seconds = watch.take()
        new = watch.new_shapes()
    buckets = {bucket_width(n, 96) for n in lengths}
    assert buckets == {32, 64, 96}
    assert watch.sizes()["policy_update"] == len(buckets) == new["policy_update"][1]
    assert count >= len(buckets) and seconds > 0
    assert watch.take() == (0, 0.0)  # nothing compiled since


def test_first_update_compiles_once_per_shape():
    """The trainer's initial optimizer state looks exactly like an update's output (committed,
    on the mesh), so the second step reuses the first step's executable."""
    from tppo_jax.parallel.mesh import make_mesh
    from tppo_jax.train.state import commit_to_mesh
    from tppo_jax.train.step import on_mesh

    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
    gd, st = nnx.split(create_model(ModelConfig.tiny(vocab_size=32), mesh=mesh))
    params = nnx.to_pure_dict(st)
    optim = OptimConfig(warmup_steps=1, minibatches=2)
    tx = make_optimizer(1e-3, optim)
    opt = commit_to_mesh(tx.init(params), mesh)
    cfg = StepConfig(algo=AlgoConfig(), optim=optim, window=8, temperature=1.0)
    fn = on_mesh(policy_update, mesh, gd, params, opt, tx=tx, cfg=cfg)
    b, s = 4, 32
    batch = {"tokens": jnp.ones((b, s), jnp.int32), "attn": jnp.ones((b, s), bool),
             "sample_logprobs": jnp.full((b, s), -3.0), "advantages": jnp.ones((b, s)),
             "policy_mask": jnp.ones((b, s)), "positive_mask": jnp.zeros((b, s))}
    for _ in range(3):
        params, opt, _ = fn(params, opt, batch)
    assert fn._cache_size() == 1
