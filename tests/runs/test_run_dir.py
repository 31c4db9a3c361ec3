"""Bucket run dirs: logs written locally and mirrored, checkpoints in the bucket.

No bucket is reachable here, so the mirror is exercised between two local folders (the
same epath calls a gs:// URL goes through) and URL handling is checked as strings.
"""

from dataclasses import replace

from tppo_jax.runs.run_dir import copy_tree, is_url, mirror, pull, resolve_run_dir


def test_local_run_dir_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rd = resolve_run_dir("runs/a")
    assert rd.local == tmp_path / "runs" / "a" and rd.remote is None
    assert rd.checkpoints == str(tmp_path / "runs" / "a" / "checkpoints")
    assert resolve_run_dir("runs/a", "/ck").checkpoints == "/ck"


def test_bucket_run_dir_keeps_the_url(tmp_path, monkeypatch):
    monkeypatch.setenv("TPPO_LOCAL_RUNS", str(tmp_path / "staging"))
    rd = resolve_run_dir("gs://bkt/runs/exp1/")
    assert is_url("gs://bkt/runs/exp1") and not is_url(tmp_path)
    assert rd.remote == "gs://bkt/runs/exp1"  # pathlib would have made it gs:/bkt/...
    assert rd.checkpoints == "gs://bkt/runs/exp1/checkpoints"
    assert rd.local == tmp_path / "staging" / "exp1"


def test_mirror_and_pull_skip_checkpoints(tmp_path):
    local, remote = tmp_path / "local", tmp_path / "remote"
    (local / "tensorboard").mkdir(parents=True)
    (local / "checkpoints" / "2").mkdir(parents=True)
    (local / "metrics.jsonl").write_text('{"step": 1}\n')
    (local / "tensorboard" / "events.x").write_bytes(b"\x00\x01")
    (local / "checkpoints" / "2" / "big").write_bytes(b"0" * 100)
    rd = replace(resolve_run_dir(local), remote=str(remote))
    mirror(rd)
    assert (remote / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (remote / "tensorboard" / "events.x").read_bytes() == b"\x00\x01"
    assert not (remote / "checkpoints").exists()  # Orbax wrote those to the bucket itself
    # A resume on a fresh machine pulls the logs back.
    fresh = replace(rd, local=tmp_path / "fresh")
    pull(fresh)
    assert (tmp_path / "fresh" / "metrics.jsonl").exists()
    assert copy_tree(tmp_path / "missing", tmp_path / "x") == 0


def test_mirror_failure_is_not_fatal(tmp_path, caplog):
    (tmp_path / "l").mkdir()
    (tmp_path / "l" / "f").write_text("x")
    (tmp_path / "blocked").write_text("a file where a folder should be")
    mirror(replace(resolve_run_dir(tmp_path / "l"), remote=str(tmp_path / "blocked")))
    assert "could not mirror" in caplog.text
