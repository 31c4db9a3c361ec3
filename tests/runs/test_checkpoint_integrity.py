"""Checkpoint integrity: every save writes a content manifest; a restore checks it, reports
a damaged step by item and file, sets it aside and falls back to the previous good one;
a failed write (here: the OS refusing to grow a file) stops with one line and leaves the
previous checkpoint restorable."""

import logging
import resource
import signal
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from tppo_jax.runs.checkpoint import ITEMS, Checkpointer, CheckpointError
from tppo_jax.runs.manifest import MANIFEST, list_files, read_manifest

ALL_ITEMS = (*ITEMS, "meta")


def _trees(x: float, n: int = 64):
    return {k: {"w": jnp.full((n,), x), "b": jnp.arange(n, dtype=jnp.float32) * x}
            for k in ITEMS}


def _two_steps(tmp_path):
    ck = Checkpointer(tmp_path / "ckpt", every=1, keep=5)
    assert ck.save(1, _trees(1.0), {"step": 1, "note": "one"})
    assert ck.save(2, _trees(2.0), {"step": 2, "note": "two"})
    return ck


def _largest_file(step_dir, item):
    files = [step_dir / f for f in list_files(step_dir) if f.startswith(f"{item}/")]
    assert files, f"no files for item {item}"
    return max(files, key=lambda p: p.stat().st_size)


def _flip(path, n=64):
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(max(0, mid - n // 2), min(len(data), mid + n // 2)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_every_save_has_a_manifest_of_every_item(tmp_path):
    ck = _two_steps(tmp_path)
    ck.close()
    man = read_manifest(tmp_path / "ckpt" / "2")
    items = {name.split("/", 1)[0] for name in man["files"]}
    assert set(ALL_ITEMS) <= items
    assert all(len(d["sha256"]) == 64 and d["size"] >= 0 for d in man["files"].values())
    ck = Checkpointer(tmp_path / "ckpt", every=1, keep=5)
    assert ck.verify(2) == []
    step, trees, meta = ck.restore_latest(_trees(0.0))
    assert step == 2 and meta["note"] == "two"
    np.testing.assert_array_equal(trees["value"]["w"], np.full(64, 2.0))
    ck.close()


@pytest.mark.parametrize("item", ALL_ITEMS)
def test_flipped_bytes_in_any_item_fall_back_to_previous_step(tmp_path, item, caplog):
    _two_steps(tmp_path).close()
    bad = _largest_file(tmp_path / "ckpt" / "2", item)
    _flip(bad)
    ck = Checkpointer(tmp_path / "ckpt", every=1, keep=5)
    with caplog.at_level(logging.ERROR):
        step, trees, meta = ck.restore_latest(_trees(0.0))
    assert step == 1 and meta["note"] == "one"
    np.testing.assert_array_equal(trees["policy"]["w"], np.full(64, 1.0))
    rel = bad.relative_to(tmp_path / "ckpt" / "2").as_posix()
    assert f"CHECKPOINT DAMAGED: step 2: {item}: {rel}: content differs" in caplog.text
    # Set aside (kept for inspection), so the resumed run can write step 2 again.
    assert (tmp_path / "ckpt" / "2.damaged" / rel).exists()
    assert ck.latest_step() == 1
    assert ck.save(2, _trees(3.0), {"step": 2})
    ck.close()


def test_truncated_file_is_named_with_its_sizes(tmp_path, caplog):
    _two_steps(tmp_path).close()
    bad = _largest_file(tmp_path / "ckpt" / "2", "value_opt")
    size = bad.stat().st_size
    bad.write_bytes(bad.read_bytes()[: size // 2])
    ck = Checkpointer(tmp_path / "ckpt", every=1, keep=5)
    problems = ck.verify(2)
    assert len(problems) == 1 and problems[0].startswith("value_opt: ")
    assert f"{size // 2} bytes, written with {size}" in problems[0]
    assert ck.restore_latest(_trees(0.0))[0] == 1
    ck.close()


def test_no_good_checkpoint_stops_with_one_line(tmp_path):
    _two_steps(tmp_path).close()
    for step in ("1", "2"):
        (_largest_file(tmp_path / "ckpt" / step, "policy")).write_bytes(b"")
    ck = Checkpointer(tmp_path / "ckpt", every=1, keep=5)
    with pytest.raises(CheckpointError) as e:
        ck.restore_latest(_trees(0.0))
    msg = str(e.value)
    assert "\n" not in msg and "no checkpoint in" in msg and "step 2: policy: " in msg
    assert "step 1: policy: " in msg
    ck.close()


def test_read_only_restore_of_one_item_skips_a_damaged_step(tmp_path):
    _two_steps(tmp_path).close()
    _flip(_largest_file(tmp_path / "ckpt" / "2", "policy"))
    ck = Checkpointer(tmp_path / "ckpt", every=1, keep=5)
    step, tree = ck.latest_good_item("policy", _trees(0.0)["policy"])
    assert step == 1 and float(tree["w"][0]) == 1.0
    assert (tmp_path / "ckpt" / "2").exists()  # eval/export never move anything
    # Damage elsewhere does not stop an export of the policy.
    assert ck.latest_good_item("value", _trees(0.0)["value"])[0] == 2
    with pytest.raises(CheckpointError, match="no usable policy checkpoint"):
        ck.latest_good_item("policy", _trees(0.0)["policy"], step=2)
    ck.close()


def test_checkpoint_without_manifest_restores_with_a_warning(tmp_path, caplog):
    _two_steps(tmp_path).close()
    (tmp_path / "ckpt" / "2" / MANIFEST).unlink()
    ck = Checkpointer(tmp_path / "ckpt", every=1, keep=5)
    assert ck.verify(2) is None
    with caplog.at_level(logging.WARNING):
        assert ck.restore_latest(_trees(0.0))[0] == 2
    assert "has no manifest" in caplog.text
    ck.close()


def test_failed_write_stops_with_one_line_and_keeps_the_previous_step(tmp_path, caplog):
    ck = Checkpointer(tmp_path / "ckpt", every=1, keep=5)
    assert ck.save(1, _trees(1.0), {"step": 1})
    big = {k: {"w": jnp.asarray(np.random.default_rng(0).random(100_000, np.float32))}
           for k in ITEMS}  # random: incompressible
    # The OS refuses to grow any file past 64 KiB (what a full disk does to the next write):
    # a real write failure inside Orbax/TensorStore, not a mock.
    before = set(threading.enumerate())
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))
    try:
        with pytest.raises(CheckpointError) as e:
            ck.save(2, big, {"step": 2})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    msg = str(e.value)
    assert "\n" not in msg and "step 2" in msg and "step 1 is intact" in msg
    assert "(File too large, errno 27)" in msg  # the OS's reason, from TensorStore's error
    # Writes still in flight report the same cause again later, e.g. asyncio's "Task
    # exception was never retrieved" when the task is collected at exit: dropped, so the
    # stop line stays the last line; anything else still gets through.
    repeat = ValueError("OUT_OF_RANGE: Error writing ... [os_error_code='27']")
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        logging.getLogger("asyncio").error("Task exception was never retrieved",
                                           exc_info=(ValueError, repeat, None))
        logging.getLogger("asyncio").error("another problem")
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == ["another problem"]
    ck.close()
    # Orbax's writer threads ended first: every thread started during the save is gone
    # (a few seconds' grace for one that is finishing; threads of earlier tests are not ours)
    deadline = time.monotonic() + 10
    while (left := [t for t in threading.enumerate() if t not in before and t.is_alive()]) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, [t.name for t in left]
    leftovers = [p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("2")]
    assert leftovers == []
    ck = Checkpointer(tmp_path / "ckpt", every=1, keep=5)
    step, trees, _ = ck.restore_latest(_trees(0.0))
    assert step == 1 and float(trees["kv_cache"]["w"][0]) == 1.0
    ck.close()


def _save_unchecked(ck, step, trees, meta, *, manifest):
    """Writes a step as a damaged (or pre-manifest) save would have left it: bypassing the
    save's finite check, with or without its manifest."""
    import orbax.checkpoint as ocp

    from tppo_jax.runs.checkpoint import PARAM_LAYOUT
    from tppo_jax.runs.manifest import write_manifest

    args = {k: ocp.args.StandardSave(t) for k, t in trees.items()}
    meta = {**meta, "param_layout": PARAM_LAYOUT}
    ck.mngr.save(step, args=ocp.args.Composite(**args, meta=ocp.args.JsonSave(meta)),
                 force=True)
    ck.mngr.wait_until_finished()
    if manifest:
        write_manifest(ck.directory / str(step))


@pytest.mark.parametrize("item", ["policy", "policy_opt", "slots"])
def test_a_step_without_manifest_holding_nan_is_set_aside(tmp_path, caplog, item):
    # Issue 49 M2: a step with no manifest was restored unverified, NaN and all.
    ck = _two_steps(tmp_path)
    trees = _trees(3.0)
    trees[item]["w"] = trees[item]["w"].at[5].set(jnp.nan)
    _save_unchecked(ck, 3, trees, {"step": 3}, manifest=False)
    ck.close()
    ck = Checkpointer(tmp_path / "ckpt", every=1, keep=5)
    with caplog.at_level(logging.WARNING):
        step, got, _ = ck.restore_latest(_trees(0.0))
    assert step == 2 and bool(jnp.isfinite(got[item]["w"]).all())
    assert f"step 3: non-finite values in {item} (no manifest" in caplog.text
    assert (tmp_path / "ckpt" / "3.damaged").is_dir()
    ck.close()


def test_restored_params_are_checked_finite_even_when_verified(tmp_path, caplog):
    ck = _two_steps(tmp_path)
    trees = _trees(3.0)
    trees["policy"]["b"] = trees["policy"]["b"].at[0].set(jnp.inf)
    _save_unchecked(ck, 3, trees, {"step": 3}, manifest=True)
    assert ck.verify(3) == []
    with caplog.at_level(logging.ERROR):
        got = ck.latest_good_item("policy", _trees(0.0)["policy"])  # eval / export / serve
        assert got is not None and got[0] == 2
        assert ck.restore_latest(_trees(0.0))[0] == 2  # a resume
    assert "non-finite values in policy" in caplog.text
    ck.close()


@pytest.mark.parametrize("text", ["[]", '{"files": []}', '{"files": {"a": 3}}', "null"])
def test_a_manifest_of_the_wrong_shape_is_damage(tmp_path, text):
    # Issue 49 L3: a manifest that is `[]` raised AttributeError instead of "damaged".
    ck = _two_steps(tmp_path)
    (tmp_path / "ckpt" / "2" / MANIFEST).write_text(text)
    problems = ck.verify(2)
    if text == "null":  # JSON null reads as no manifest: restored only when finite
        assert problems is None
    else:
        assert problems == [f"(step) {MANIFEST}: not a manifest of files (damaged)"]
        assert ck.restore_latest(_trees(0.0))[0] == 1
    ck.close()
