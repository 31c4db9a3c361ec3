"""One owner per checkpoint folder (issue 49, H1): a run resumes from, writes into and
prunes only its own checkpoint folder. Another run pointed at it (``checkpoint.dir``, as
launches sharing a bucket do) is refused in one line, and nothing in the folder changes."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tppo_jax.runs.run_claim import OWNER, RUN_ID, checkpoint_owner, claim_run_dir
from tppo_jax.runs.run_dir import LOCK, RunDirError, resolve_run_dir


def _run_with_steps(run, steps=(10, 12), checkpoint_dir=""):
    """A run that claimed its folder and wrote ``steps`` (their folders: what a resume lists)."""
    rd = resolve_run_dir(run, checkpoint_dir)
    claim_run_dir(rd, resume=False)()
    for s in steps:
        (Path(rd.checkpoints) / str(s)).mkdir(parents=True)
    (run / "config.yaml").write_text("x: 1\n")
    return rd


def _snapshot(folder):
    return sorted((p.relative_to(folder).as_posix(), p.read_bytes() if p.is_file() else b"")
                  for p in folder.rglob("*") if p.name != LOCK)


def test_a_resume_refuses_another_runs_checkpoint_folder(tmp_path):
    a = _run_with_steps(tmp_path / "rL")
    owner = checkpoint_owner(a.checkpoints)
    assert owner == {"run_id": (tmp_path / "rL" / RUN_ID).read_text().split()[0],
                     "run_dir": str(tmp_path / "rL")}
    before = _snapshot(tmp_path / "rL")
    b = resolve_run_dir(tmp_path / "B", a.checkpoints)
    with pytest.raises(RunDirError) as e:
        claim_run_dir(b, resume=True)
    msg = str(e.value)
    assert "\n" not in msg and "belongs to another run" in msg and "latest step 12" in msg
    assert str(tmp_path / "rL") in msg and owner["run_id"] in msg
    assert _snapshot(tmp_path / "rL") == before  # nothing written or pruned there
    claim_run_dir(a, resume=True)()  # the owner still resumes


def test_an_external_folder_is_owned_and_locked_by_its_run(tmp_path):
    ckpt = tmp_path / "bucket" / "checkpoints"
    a = _run_with_steps(tmp_path / "A", checkpoint_dir=str(ckpt))
    assert json.loads((ckpt / OWNER).read_text())["run_dir"] == str(tmp_path / "A")
    release = claim_run_dir(a, resume=True)
    try:
        assert (ckpt / LOCK).exists()
        # A copy of the run (same id) on the same folder at the same time: one writer.
        shutil.copytree(tmp_path / "A", tmp_path / "A2", ignore=shutil.ignore_patterns(LOCK))
        code = ("from tppo_jax.runs.run_claim import claim_run_dir;"
                "from tppo_jax.runs.run_dir import resolve_run_dir;"
                f"claim_run_dir(resolve_run_dir({str(tmp_path / 'A2')!r}, {str(ckpt)!r}), True)")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode != 0 and "in use by another tppo train" in r.stderr
    finally:
        release()


def test_unowned_checkpoints_are_refused_to_a_new_run(tmp_path):
    # A folder written before folders had owners, pointed at by a run with no config.yaml.
    ckpt = tmp_path / "shared"
    (ckpt / "8").mkdir(parents=True)
    with pytest.raises(RunDirError) as e:
        claim_run_dir(resolve_run_dir(tmp_path / "B", str(ckpt)), resume=True)
    assert "name no owning run" in str(e.value) and "\n" not in str(e.value)
    assert not (ckpt / OWNER).exists()
    # The run that wrote them (it has its config.yaml) adopts them.
    (tmp_path / "A").mkdir()
    (tmp_path / "A" / "config.yaml").write_text("x: 1\n")
    claim_run_dir(resolve_run_dir(tmp_path / "A", str(ckpt)), resume=True)()
    assert json.loads((ckpt / OWNER).read_text())["run_dir"] == str(tmp_path / "A")


def test_a_copied_run_dir_keeps_its_id_and_resumes(tmp_path):
    _run_with_steps(tmp_path / "A")
    shutil.copytree(tmp_path / "A", tmp_path / "moved", ignore=shutil.ignore_patterns(LOCK))
    shutil.rmtree(tmp_path / "A")
    claim_run_dir(resolve_run_dir(tmp_path / "moved"), resume=True)()


def test_an_owned_folder_with_no_checkpoint_left_is_taken(tmp_path):
    ckpt = tmp_path / "c"
    claim_run_dir(resolve_run_dir(tmp_path / "A", str(ckpt)), resume=False)()
    claim_run_dir(resolve_run_dir(tmp_path / "B", str(ckpt)), resume=False)()
    assert json.loads((ckpt / OWNER).read_text())["run_dir"] == str(tmp_path / "B")


def test_a_copy_of_a_live_run_gets_its_own_id(tmp_path):
    """Issue 62 L-13: copies of a run shared its run id, so a copy resumed from, wrote into
    and pruned the original's checkpoint folder. A copy (the original still there) is a run
    of its own; its own checkpoints (copied with it) are its; the original's external
    folder is not."""
    from tppo_jax.runs.run_claim import run_id

    ckpt = tmp_path / "shared"
    a = _run_with_steps(tmp_path / "A", checkpoint_dir=str(ckpt))
    _run_with_steps(tmp_path / "L")  # its checkpoints in L/checkpoints
    for src, dst in (("A", "A2"), ("L", "L2")):
        shutil.copytree(tmp_path / src, tmp_path / dst, ignore=shutil.ignore_patterns(LOCK))
    before = _snapshot(ckpt)
    with pytest.raises(RunDirError, match="belongs to another run"):
        claim_run_dir(resolve_run_dir(tmp_path / "A2", str(ckpt)), resume=True)
    assert _snapshot(ckpt) == before
    assert run_id(resolve_run_dir(tmp_path / "A2")) != run_id(a)
    claim_run_dir(resolve_run_dir(tmp_path / "L2"), resume=True)()  # its own copied folder
    l1, l2 = (run_id(resolve_run_dir(tmp_path / n)) for n in ("L", "L2"))
    assert l1 != l2 and checkpoint_owner(str(tmp_path / "L2" / "checkpoints"))["run_id"] == l2
    claim_run_dir(a, resume=True)()  # the original resumes as before
