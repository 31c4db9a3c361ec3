"""The learner's program table (learner/programs.py) and its abstract state (learner/init.py):
what the compile path compiles is what a step runs, argument for argument."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, struct
from oracles import finished_rows, row_plan_of

from tppo_jax.buckets import width_buckets
from tppo_jax.config import AlgoConfig, Config, ModelSettings, OptimConfig
from tppo_jax.learner import Learner, LearnerConfig, TrainBatch
from tppo_jax.learner.init import abstract_state, init_state
from tppo_jax.learner.programs import step_programs
from tppo_jax.models.transformer import ModelConfig, create_model
from tppo_jax.models.value import ValueModel
from tppo_jax.parallel.mesh import make_mesh

MODEL = dict(vocab_size=32, num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2,
             num_kv_heads=1, head_dim=16)


def _cfg(**algo):
    return Config(model=ModelSettings(dtype="bfloat16", param_dtype="float32"),
                  algo=AlgoConfig(**algo), optim=OptimConfig(minibatches=2))


def _params(mesh=None, value: bool = True):
    mc = ModelConfig.tiny(dtype="bfloat16", **MODEL)
    models = [create_model(mc, seed=0, mesh=mesh)]
    if value:
        models.append(create_model(mc, seed=1, mesh=mesh, cls=ValueModel))
    out = [(nnx.graphdef(m), nnx.to_pure_dict(nnx.state(m))) for m in models]
    return out if value else out + [(None, None)]


def _batch(b=8, p=3, n=61, seed=0):
    """Rows of every length: the first half up to the whole buffer, the rest short (each
    minibatch, rows in order, has its own width bucket)."""
    rng = np.random.default_rng(seed)
    lens = np.concatenate([rng.integers(3, n + 1, size=b // 2), rng.integers(3, 20, b - b // 2)])
    return finished_rows(rng, lens, p, n, reward=jnp.asarray(np.arange(b) % 2, jnp.float32),
                         correct=jnp.arange(b) % 2 == 1, group=jnp.arange(b, dtype=jnp.int32) // 2)


def _layout(tree):
    return jax.tree.map(lambda x: (x.shape, jnp.dtype(x.dtype)), tree)


def test_the_abstract_batch_is_the_dataclass_field_for_field():
    real = _batch()
    spec = TrainBatch.abstract(*real.shape)
    assert [f.name for f in dataclasses.fields(spec)] == [f.name for f in dataclasses.fields(real)]
    assert _layout(spec) == _layout(real)

    @struct.dataclass
    class Wider(TrainBatch):
        extra: jax.Array | None = None  # a field without a declared layout

    with pytest.raises(TypeError, match=r"TrainBatch.extra declares no layout"):
        Wider.abstract(4, 8)


def test_the_abstract_state_is_the_real_init_laid_out(devices8):
    """``abstract_state`` (eval_shape of ``init_state``, laid out) against the state a run
    makes on 8 devices: float32 masters of a bf16 model, AdamW moments in their params'
    shardings, step counts replicated; leaf for leaf, shape, dtype and sharding."""
    mesh = make_mesh({"data": 2, "fsdp": 4, "tensor": 1}, devices8)
    (pdef, pp), (vdef, vp) = _params(mesh, value=False)  # the critic's is the same code
    lc = LearnerConfig.from_config(_cfg(advantage_baseline="rloo"))
    real = init_state(pp, vp, lc, mesh=mesh)
    sds = lambda t: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), t)
    abstract = abstract_state(sds(pp), sds(vp), lc, mesh=mesh)
    assert jax.tree.structure(abstract) == jax.tree.structure(real)
    for a, r in zip(jax.tree.leaves(abstract), jax.tree.leaves(real), strict=True):
        assert (a.shape, a.dtype) == (r.shape, r.dtype)
        assert a.sharding.is_equivalent_to(r.sharding, len(a.shape)), (a, r.sharding)
    assert {x.dtype for x in jax.tree.leaves(abstract.policy)} == {jnp.dtype(jnp.float32)}
    assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(abstract.policy_opt))


@pytest.mark.slow  # ~5 s: traces each program's gradient
def test_the_table_lists_the_programs_a_step_runs():
    """Every width bucket's update and values pass, the applies and the targets (the
    policy's own log-probs pass with the sampler correction, and its result in the policy's
    row groups); ``kinds`` and ``widths`` pick."""
    (pdef, pp), (vdef, vp) = _params()
    b, s = 8, 64
    widths = width_buckets(s)
    lc = LearnerConfig.from_config(_cfg(sampler_correction="recompute"))
    learner = Learner(pdef, vdef, lc)
    progs = step_programs(learner, init_state(pp, vp, lc), TrainBatch.abstract(b, s))
    assert [p.name for p in progs] == [
        *(f"policy_update[w={w}]" for w in widths), "policy_apply",
        *(f"value_update[w={w}]" for w in widths), "value_apply",
        *(f"{n}[w={w}]" for n in ("targets", "old_logprobs") for w in widths),
        "targets_finish"]
    for p in progs:
        if p.kind == "policy_update":
            old = p.args[1].old_logprobs
            assert (old.shape, old.dtype) == ((p.meta["rows"], p.meta["width"]), jnp.float32)
    names = [p.name for p in step_programs(learner, init_state(pp, vp, lc),
                                           TrainBatch.abstract(b, s), widths=widths[-1:],
                                           kinds=["policy_update"])]
    assert names == [f"policy_update[w={widths[-1]}]"]


@pytest.mark.slow  # ~5 s: a step's targets and takes compile
def test_a_row_groups_arguments_are_those_its_take_cuts_in_a_step():
    """The table's row group at each width is what ``take`` cuts from a real batch and its
    targets (critic-free here: no values pass to run), at the row count the update's plan
    gives that width."""
    (pdef, pp), _ = _params(value=False)
    lc = LearnerConfig.from_config(_cfg(advantage_baseline="rloo"))
    learner = Learner(pdef, None, lc)
    state = init_state(pp, None, lc)
    batch = _batch()
    progs = {p.name: p for p in step_programs(learner, state, TrainBatch.abstract(*batch.shape))}
    assert not any(n.startswith(("value", "targets[")) for n in progs)
    rows = row_plan_of(batch)
    targets = learner.targets(state.value, batch, rows.lengths)
    groups = [g for mb in learner.plan("policy", rows, batch.shape[1]) for g in mb.groups]
    assert len({g.width for g in groups}) > 1
    for g in groups:
        prog = progs[f"policy_update[w={g.width}]"]
        assert prog.meta["rows"] == len(g.rows)
        real = learner.policy.take(batch, targets, g.rows, g.valid, width=g.width)
        assert _layout(prog.args[1]) == _layout(real) and real.old_logprobs is None
