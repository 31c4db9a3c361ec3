"""`tppo launch`: TPU type parsing, the dry-run gcloud script, and the run loop with fakes."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from tppo_jax import cli
from tppo_jax.cli import launch as launch_cli
from tppo_jax.launch import (
    LaunchError,
    LaunchSpec,
    build_steps,
    parse_tpu_type,
    render,
    run_steps,
)

ROOT = Path(__file__).resolve().parents[2]


def tppo(argv: list[str]) -> int:
    launch_cli.register(cli.register)  # what cli.main does for every group
    return cli.main(argv)


@pytest.mark.parametrize("text,chips,hosts,runtime", [
    ("v4-8", 4, 1, "tpu-ubuntu2204-base"),
    ("v4-32", 16, 4, "tpu-ubuntu2204-base"),
    ("v5p-64", 32, 8, "v2-alpha-tpuv5"),
    ("v5p-512", 256, 64, "v2-alpha-tpuv5"),
    ("v5litepod-8", 8, 1, "v2-alpha-tpuv5-lite"),
    ("v5litepod-16", 16, 4, "v2-alpha-tpuv5-lite"),
    ("v6e-8", 8, 1, "v2-alpha-tpuv6e"),
    ("v6e-256", 256, 64, "v2-alpha-tpuv6e"),
])
def test_parse_tpu_type(text, chips, hosts, runtime):
    t = parse_tpu_type(text)
    assert (t.chips, t.hosts, t.runtime) == (chips, hosts, runtime)


@pytest.mark.parametrize("bad", ["v3-8", "v4-6", "v4", "v5p-12", "v5litepod-3", "v6e-0",
                                 "v6e-512", "tpu-8", "v5e-8", ""])
def test_bad_tpu_type(bad):
    with pytest.raises(LaunchError, match="invalid TPU type"):
        parse_tpu_type(bad)


def test_bad_tpu_type_cli_one_line(capsys):
    rc = tppo(["launch", "--config", "configs/default.yaml", "--tpu-type", "v5p-7",
               "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and "invalid TPU type 'v5p-7'" in err


def commands(out: str) -> list[list[str]]:
    """The script's command lines as argv lists (checks that every line is shell-parsable)."""
    return [shlex.split(line) for line in out.splitlines() if not line.startswith("#")]


def find(cmds: list[list[str]], *prefix: str) -> list[list[str]]:
    return [c for c in cmds if c[:len(prefix)] == list(prefix)]


def test_dry_run_v5p_64(capsys):
    rc = tppo(["launch", "--config", "configs/default.yaml", "--tpu-type", "v5p-64",
               "--zone", "europe-west4-b", "--project", "my-proj", "--bucket", "gs://bkt",
               "--name", "t1", "--dry-run", "--plan", "arithmetic", "train.steps=10"])
    out = capsys.readouterr().out
    assert rc == 0
    cmds = commands(out)
    [create] = find(cmds, "gcloud", "compute", "tpus", "tpu-vm", "create")
    assert create[5] == "t1"
    for flag, value in [("--accelerator-type", "v5p-64"), ("--version", "v2-alpha-tpuv5"),
                        ("--zone", "europe-west4-b"), ("--project", "my-proj")]:
        assert create[create.index(flag) + 1] == value
    assert "--spot" not in create
    assert "tpu-vm describe t1" in out and '= READY ]' in out  # the wait loop
    ssh = find(cmds, "gcloud", "compute", "tpus", "tpu-vm", "ssh", "t1")
    install, train, stream = (c[c.index("--command") + 1] for c in ssh)
    assert all("--worker=all" in c for c in ssh[:2]) and "--worker=0" in ssh[2]
    assert all(c[c.index("--zone") + 1] == "europe-west4-b" for c in ssh)
    assert "./install.sh" in install
    assert ("nohup launch/run_on_pod.sh .venv/bin/tppo train --config configs/default.yaml "
            "--run-dir gs://bkt/runs/t1") in train
    assert "train.steps=10" in train and "> ~/tppo-train.log" in train
    assert "--distributed auto" in train  # 8 hosts: jax.distributed discovers the slice
    assert "tail" in stream and "~/tppo-train.log" in stream
    [scp] = find(cmds, "gcloud", "compute", "tpus", "tpu-vm", "scp")
    assert "--worker=all" in scp
    assert find(cmds, "gcloud", "storage", "cp", "-r", "gs://bkt/runs/t1")
    [delete] = find(cmds, "gcloud", "compute", "tpus", "tpu-vm", "delete", "t1")
    assert "--quiet" in delete
    assert cmds[-1] == delete  # deleted last


def test_dry_run_v4_8_default_name_and_zone(capsys):
    assert tppo(["launch", "--config", "configs/ppo.yaml", "--tpu-type", "v4-8", "--spot",
                 "--dry-run", "--plan", "arithmetic"]) == 0
    out = capsys.readouterr().out
    cmds = commands(out)
    [create] = find(cmds, "gcloud", "compute", "tpus", "tpu-vm", "create")
    assert create[5] == "tppo-ppo-v4-8"
    assert create[create.index("--version") + 1] == "tpu-ubuntu2204-base"
    assert create[create.index("--zone") + 1] == "us-central2-b"
    assert create[create.index("--accelerator-type") + 1] == "v4-8"
    assert "--spot" in create and "--project" not in create
    assert "--config configs/ppo.yaml --run-dir runs/tppo-ppo-v4-8" in out
    assert "--distributed" not in out  # one host
    # no bucket: results come back from worker 0 over scp
    [back] = [c for c in find(cmds, "gcloud", "compute", "tpus", "tpu-vm", "scp")
              if "--recurse" in c]
    assert "tppo-ppo-v4-8:~/tppo-jax/runs/tppo-ppo-v4-8" in back and "--worker=0" in back


def test_queued_resource(capsys):
    assert tppo(["launch", "--config", "default", "--tpu-type", "v6e-8", "--queued", "--spot",
                 "--name", "q1", "--repo", "https://example.com/tppo-jax.git",
                 "--dry-run", "--plan", "arithmetic"]) == 0
    cmds = commands(capsys.readouterr().out)
    [create] = find(cmds, "gcloud", "compute", "tpus", "queued-resources", "create", "q1")
    assert create[create.index("--node-id") + 1] == "q1"
    assert create[create.index("--runtime-version") + 1] == "v2-alpha-tpuv6e"
    assert "--spot" in create
    assert not find(cmds, "tar")  # --repo: cloned on the workers instead
    install = find(cmds, "gcloud", "compute", "tpus", "tpu-vm", "ssh")[0]
    assert "git clone https://example.com/tppo-jax.git" in install[install.index("--command") + 1]
    [delete] = find(cmds, "gcloud", "compute", "tpus", "queued-resources", "delete", "q1")
    assert "--force" in delete


def test_best_effort_uses_alpha(capsys):
    assert tppo(["launch", "--config", "default", "--tpu-type", "v5litepod-16",
                 "--best-effort", "--keep", "--bucket", "gs://b", "--dry-run",
                 "--plan", "arithmetic"]) == 0
    cmds = commands(capsys.readouterr().out)
    [create] = find(cmds, "gcloud", "alpha", "compute", "tpus", "queued-resources", "create")
    assert "--best-effort" in create
    assert not [c for c in cmds if "delete" in c]  # --keep


def test_paper_config_mesh_must_match_slice(capsys):
    # fsdp=256 is laid out for v5p-512 (256 chips): a v5p-64 (32 chips) is refused up front.
    rc = tppo(["launch", "--config", "configs/paper_qwen25_32b.yaml", "--tpu-type", "v5p-64",
               "--dry-run"])
    assert rc == 2 and "mesh" in capsys.readouterr().err
    # On its own slice it fits (its paged KV pool); reserving every slot's KV at full length
    # (num_pages=0) does not: refused in one line, unless forced
    argv = ["launch", "--config", "configs/paper_qwen25_32b.yaml", "--tpu-type", "v5p-512",
            "--bucket", "gs://b", "--dry-run", "--plan", "arithmetic"]
    assert tppo(argv) == 0
    capsys.readouterr()
    argv.append("rollout.num_pages=0")
    assert tppo(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "does not fit v5p-512" in err and "--force" in err
    assert tppo([*argv, "--force"]) == 0
    out = capsys.readouterr().out
    assert "--accelerator-type v5p-512" in out and "(256 chips, 64 hosts" in out


def test_multi_host_needs_a_bucket_run_dir(capsys):
    # Each host writes its own checkpoint shards: local run dirs would scatter them.
    rc = tppo(["launch", "--config", "default", "--tpu-type", "v5p-64", "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2 and "8 hosts" in err and "--bucket gs://BUCKET" in err
    assert len(err.strip().splitlines()) == 1


def _spec(**kw) -> LaunchSpec:
    return LaunchSpec(config="configs/default.yaml", tpu=parse_tpu_type("v4-8"), name="t",
                      zone="us-central2-b", **kw)


def test_run_stops_at_first_failure(capsys):
    spec = _spec()
    steps = build_steps(spec)
    ran: list[list[str]] = []

    def runner(argv):
        ran.append(list(argv))
        return 7 if "ssh" in argv else 0  # the install step fails

    rc = run_steps(spec, steps, runner=runner, capture=lambda argv: (0, "READY\n"))
    err = capsys.readouterr().err
    assert rc == 1
    assert "ssh" in ran[-1] and not any("delete" in a for a in ran)
    last = err.strip().splitlines()[-1]
    assert "failed: exit code 7" in last and "still up" in last
    assert "gcloud compute tpus tpu-vm delete t --quiet --zone us-central2-b" in last


def test_run_wait_failure_state(capsys):
    spec = _spec(queued=True)
    rc = run_steps(spec, build_steps(spec), runner=lambda argv: 0,
                   capture=lambda argv: (0, "FAILED\n"))
    assert rc == 1
    assert "state is FAILED" in capsys.readouterr().err


def test_run_all_steps(capsys):
    spec = _spec()
    ran: list[list[str]] = []
    rc = run_steps(spec, build_steps(spec), runner=lambda a: ran.append(list(a)) or 0,
                   capture=lambda argv: (0, "READY"))
    assert rc == 0 and ran[-1][:5] == ["gcloud", "compute", "tpus", "tpu-vm", "delete"]


def test_gcloud_missing(monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/nonexistent")
    rc = tppo(["launch", "--config", "configs/default.yaml", "--tpu-type", "v4-8"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "gcloud not found" in err


def test_render_round_trips_quoting():
    spec = _spec(overrides=("data.source=my data.jsonl",))
    out = render(spec, build_steps(spec))
    [train] = [c for c in commands(out) if "--command" in c and "nohup" in
               c[c.index("--command") + 1]]
    inner = shlex.split(train[train.index("--command") + 1].split("nohup ", 1)[1])
    assert "data.source=my data.jsonl" in inner


def test_run_on_pod_script():
    script = ROOT / "launch" / "run_on_pod.sh"
    text = script.read_text()
    assert "./install.sh" in text and ".venv/bin/tppo train" in text
    # gs:// run dirs: checkpoints go to the bucket directly (every host's shards in one place)
    assert '--run-dir "$run_dir"' in text and "gcsfs" in text
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert usage.returncode == 2 and "run_on_pod.sh" in usage.stderr
    assert not (ROOT / "launch" / "__init__.py").exists()


@pytest.mark.parametrize(("run_dir", "where"), [("/abs/path", "t:/abs/path"),
                                                ("runs/x", "t:~/tppo-jax/runs/x")])
def test_copy_back_path_and_the_delete_does_not_depend_on_the_copy(capsys, run_dir, where):
    """Issue 49 L6: an absolute --run-dir gave `~/tppo-jax//abs/path`, the copy failed and
    the TPU was left up."""
    spec = _spec(run_dir=run_dir)
    ran: list[list[str]] = []

    def runner(argv):
        ran.append(list(argv))
        return 3 if "scp" in argv and "--recurse" in argv else 0  # the copy back fails

    rc = run_steps(spec, build_steps(spec), runner=runner, capture=lambda argv: (0, "READY"))
    copy = next(a for a in ran if "--recurse" in a)
    assert where in copy
    assert rc == 1 and ran[-1][:5] == ["gcloud", "compute", "tpus", "tpu-vm", "delete"]
    assert "copy results from worker 0) failed: exit code 3" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [
    ("--zone", "us-central2-b\ntouch /tmp/pwned"), ("--run-dir", "runs/x\r\nrm -rf ~"),
    ("--bucket", "gs://b\x1b[2J"), ("--name", "t1\n"), ("", "train.steps=1\nid")])
def test_control_characters_in_launch_arguments_are_refused(capsys, flag, value):
    """Issue 62 L-5: a newline in ``--zone`` escaped a ``#`` comment of the dry-run script
    into a live line."""
    argv = ["launch", "--config", "smoke", "--tpu-type", "v5litepod-8", "--dry-run",
            "--plan", "arithmetic", *([flag, value] if flag else [value])]
    rc = tppo(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert "holds a control character" in err
    assert (flag or "a key=value override") in err


def test_dry_run_checks_the_fit_with_the_arithmetic_plan_at_once(capsys, monkeypatch):
    """Without --compile the fit check is the arithmetic plan, libtpu installed or not (the
    compiled one takes minutes): the script prints at once, the estimate is said on stderr."""
    import tppo_jax.compile

    def no_compile(*a, **k):
        raise AssertionError("the dry run compiled")

    monkeypatch.setattr(tppo_jax.compile, "compile_plan", no_compile)
    assert tppo(["launch", "--config", "qwen25_05b_gsm8k", "--tpu-type", "v5litepod-8",
                 "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "tpu-vm create" in out
    # Nothing a run writes locally travels with the code (W&B's offline folder included)
    [tar] = find(commands(out), "tar")
    assert {"--exclude=./runs", "--exclude=./wandb", "--exclude=./.venv"} <= set(tar)
    assert "wandb/" in (ROOT / ".gitignore").read_text().split()
    assert "fit check: arithmetic plan" in err and "--compile" in err


@pytest.mark.parametrize("state, timeout, message", [
    ("FAILED", 3600, "state FAILED"), ("CREATING", 0, "still CREATING after 0 s")])
def test_the_printed_wait_loop_stops_on_failure_and_timeout(state, timeout, message):
    """The dry-run script's wait loop, run by bash: a failure state or the timeout exits 1
    with one line (a describe that prints the state stands in for gcloud)."""
    from tppo_jax.launch import Step, wait_shell

    spec = _spec()
    [wait] = [s for s in build_steps(spec) if s.wait_for]
    assert "FAILED" in wait.fail_states
    step = Step("wait", ("echo", state), wait_for="READY", fail_states=wait.fail_states)
    out = subprocess.run(["bash", "-c", wait_shell(step, interval_s=0, timeout_s=timeout)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and out.stderr.strip() == message
    ok = Step("wait", ("echo", "READY"), wait_for="READY", fail_states=wait.fail_states)
    assert subprocess.run(["bash", "-c", wait_shell(ok, timeout_s=0)], timeout=30).returncode == 0
