"""The side-by-side runner of the comparing benchmarks: every job runs (its output in its
log), and a failed one stops the rest with a one-line error that names its log."""

import pytest

from tppo_jax.benchmarks.side_by_side import Job, run_jobs, train_command


def test_jobs_run_and_a_failure_names_its_log(tmp_path):
    ok = [Job(f"ok{i}", ["config", "--help"], tmp_path / f"ok{i}.log") for i in range(3)]
    run_jobs(ok, 2, label="t")
    assert all("usage" in (tmp_path / f"ok{i}.log").read_text() for i in range(3))
    bad = Job("bad", ["no-such-command"], tmp_path / "bad.log")
    with pytest.raises(SystemExit, match=r"\[t\] bad failed \(exit 2\); see .*bad\.log"):
        run_jobs([bad], 1, label="t")
    assert train_command("longtail", tmp_path / "r", ["train.seed=1"]) == [
        "train", "--config", "longtail", "--run-dir", str(tmp_path / "r"), "--no-progress",
        "train.seed=1"]
