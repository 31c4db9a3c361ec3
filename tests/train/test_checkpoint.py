"""Orbax checkpoints: a half-written save is never restored; NaN params are never saved."""

import jax.numpy as jnp
import numpy as np

from tppo_jax.train.checkpoint import ITEMS, Checkpointer


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
    from tppo_jax.train.checkpoint import checkpoint_path

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
