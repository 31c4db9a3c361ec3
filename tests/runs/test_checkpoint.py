"""Orbax checkpoints: a half-written save is never restored; NaN params are never saved."""

import jax.numpy as jnp
import numpy as np

from tppo_jax.runs.checkpoint import ITEMS, Checkpointer


def _trees(x: float):
    t = {"w": jnp.full((3,), x)}
    return {k: t for k in ITEMS}


def test_half_written_checkpoint_is_ignored(tmp_path):
    ck = Checkpointer(tmp_path / "ckpt", every=1, keep=5)
    assert ck.save(1, _trees(1.0), {"step": 1})
    ck.close()
    # What a process killed mid-save leaves behind: Orbax's temporary directory.
    partial = tmp_path / "ckpt" / "2.orbax-checkpoint-tmp-1700000000000000"
    (partial / "policy").mkdir(parents=True)
    (partial / "policy" / "garbage").write_bytes(b"\x00" * 10)
    ck = Checkpointer(tmp_path / "ckpt", every=1, keep=5)
    assert ck.latest_step() == 1
    trees, meta = ck.restore(1, _trees(0.0))
    np.testing.assert_array_equal(trees["policy"]["w"], [1.0, 1.0, 1.0])
    assert meta["step"] == 1
    ck.close()


def test_nan_params_are_not_checkpointed(tmp_path):
    ck = Checkpointer(tmp_path / "ckpt", every=1, keep=5)
    assert not ck.save(1, _trees(float("nan")), {"step": 1}, force=True)
    assert ck.latest_step() is None
    ck.close()


def test_checkpoint_path_keeps_bucket_urls(tmp_path, monkeypatch):
    from tppo_jax.runs.checkpoint import checkpoint_path

    # gs:// must reach Orbax untouched (pathlib would turn "gs://b" into "gs:/b").
    assert str(checkpoint_path("gs://bkt/runs/x/checkpoints")) == "gs://bkt/runs/x/checkpoints"
    monkeypatch.chdir(tmp_path)
    assert str(checkpoint_path("runs/ck")) == str(tmp_path / "runs" / "ck")


def test_items_are_named_by_the_trees_given(tmp_path):
    """The checkpointer saves and restores whatever items it is handed (no fixed list)."""
    ck = Checkpointer(tmp_path / "ckpt", every=1, keep=5)
    trees = {"alpha": {"w": jnp.arange(3.0)}, "beta": {"b": jnp.ones(2)}}
    assert ck.save(1, trees, {"step": 1})
    ck.close()
    assert {p.name for p in (tmp_path / "ckpt" / "1").iterdir()} >= {"alpha", "beta", "meta"}
    ck = Checkpointer(tmp_path / "ckpt", every=1, keep=5)
    out, meta = ck.restore(1, {"beta": {"b": jnp.zeros(2)}})  # a subset restores alone
    assert set(out) == {"beta"} and meta["step"] == 1
    np.testing.assert_array_equal(out["beta"]["b"], [1.0, 1.0])
    ck.close()


def test_a_checkpoint_of_per_layer_params_is_refused_in_one_line(tmp_path):
    """A step written before the decoder layers were stacked (its metadata names no
    param layout) is refused with the cause, and kept: it is not damaged."""
    import orbax.checkpoint as ocp
    import pytest

    from tppo_jax.runs.checkpoint import CheckpointError

    ck = Checkpointer(tmp_path / "ckpt", every=1, keep=5)
    old = {"policy": {"layers": {"0": {"w": jnp.ones(3)}}}}
    ck.mngr.save(1, args=ocp.args.Composite(policy=ocp.args.StandardSave(old["policy"]),
                                            meta=ocp.args.JsonSave({"step": 1})))
    ck.mngr.wait_until_finished()
    for restore in (lambda: ck.restore_latest({"policy": {"layers": {"w": jnp.zeros((2, 3))}}}),
                    lambda: ck.latest_good_item("policy", {"layers": {"w": jnp.zeros((2, 3))}})):
        with pytest.raises(CheckpointError, match="per-layer decoder params") as e:
            restore()
        assert "\n" not in str(e.value)
    assert ck.latest_step() == 1 and (tmp_path / "ckpt" / "1").exists()
    ck.close()
    # What this version writes restores.
    ck = Checkpointer(tmp_path / "new", every=1, keep=5)
    assert ck.save(1, _trees(1.0), {"step": 1})
    step, trees, meta = ck.restore_latest(_trees(0.0))
    assert step == 1 and meta["param_layout"] == "stacked-layers"
    ck.close()


def test_a_checkpoint_of_the_previous_layout_restores_and_the_step_counts_on(tmp_path):
    """What the version before ``TrainState.step`` became an array wrote (the step an int in
    the metadata; a run with the since-removed ``optim.policy_ema`` also a ``policy_ema``
    item) restores into today's state: the step an int32 array on the mesh, one on after a
    step, and the items this version does not keep are left unread."""
    import dataclasses

    from tppo_jax.learner import TrainState
    from tppo_jax.parallel.mesh import make_mesh

    ck = Checkpointer(tmp_path / "ckpt", every=1, keep=5)
    assert ck.save(7, {**_trees(2.0), "policy_ema": {"w": jnp.zeros(3)}}, {"step": 7})
    ck.close()
    ck = Checkpointer(tmp_path / "ckpt", every=1, keep=5)
    state0 = TrainState(*(_trees(0.0)[k] for k in ITEMS[:4]))
    templates = {**state0.items(), "slots": _trees(0.0)["slots"]}
    step, trees, meta = ck.restore_latest(templates)
    ck.close()
    mesh = make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
    state = TrainState.from_items(trees, meta["step"], mesh)
    assert step == 7 and "policy_ema" not in trees
    assert state.step.dtype == jnp.int32 and int(state.step) == 7
    assert state.step.sharding.mesh == mesh  # placed like the optimizer states
    np.testing.assert_array_equal(state.policy["w"], [2.0, 2.0, 2.0])
    nxt = dataclasses.replace(state, step=state.step + 1)
    assert int(nxt.step) == 8
