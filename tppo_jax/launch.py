"""Cloud TPU launcher: the exact ``gcloud`` command lines that run ``tppo train`` on a pod.

``build_steps`` turns a ``LaunchSpec`` into an ordered list of ``Step``s (create the TPU VM or
queued resource, wait until it is up, copy the repo, install on every worker, start training on
every worker, stream worker 0's log, copy results back, delete the TPU). ``render`` prints them
as a shell script (``tppo launch --dry-run``); ``run_steps`` executes them with ``subprocess``,
stopping at the first failure. Nothing here imports jax.

Multi-host: every worker of a slice runs the same ``tppo train --distributed auto`` command.
On Cloud TPU, JAX discovers the slice by itself (the TPU runtime knows the hosts, and
``jax.distributed.initialize()`` needs no arguments there), so no coordinator address or
process id is passed. Every host writes its own checkpoint shards, so a multi-host run needs
a ``gs://`` run dir (``--bucket``): the checkpoints go there directly.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

GIB = 1024**3

REPO_ROOT = Path(__file__).resolve().parent.parent
REMOTE_DIR = "~/tppo-jax"  # repo checkout on every worker
REMOTE_TARBALL = "~/tppo-jax.tar.gz"
TRAIN_LOG = "~/tppo-train.log"
TRAIN_PID = "~/tppo-train.pid"  # written by launch/run_on_pod.sh
TRAIN_RC = "~/tppo-train.rc"  # exit status of tppo train, written by launch/run_on_pod.sh


class LaunchError(ValueError):
    """A launch argument is invalid, or a launch step failed; the message is one line."""


@dataclass(frozen=True)
class Generation:
    """What differs between TPU generations for launching and memory planning."""

    runtime: str  # TPU VM software version
    hbm_gib: float  # HBM per chip (one JAX device per chip: v4/v5p run megacore)
    cores_per_chip: int  # the number in the accelerator type counts cores (v4/v5p) or chips
    sizes: Callable[[int], bool]  # valid numbers in the accelerator type
    zone: str  # a default zone that offers this generation
    single_host_max_chips: int  # slices up to this many chips are one host


def _v4_sizes(n: int) -> bool:
    return n >= 8 and n % 8 == 0 and n <= 8192


def _lite_sizes(n: int) -> bool:
    return n in (1, 4, 8, 16, 32, 64, 128, 256)


GENERATIONS: dict[str, Generation] = {
    "v4": Generation("tpu-ubuntu2204-base", 32, 2, _v4_sizes, "us-central2-b", 4),
    "v5p": Generation("v2-alpha-tpuv5", 95, 2, lambda n: _v4_sizes(n) and n <= 12288,
                      "us-east5-a", 4),
    # v5e and v6e hosts hold up to 8 chips: v5litepod-8 / v6e-8 are a single VM.
    "v5litepod": Generation("v2-alpha-tpuv5-lite", 16, 1, _lite_sizes, "us-west4-a", 8),
    "v6e": Generation("v2-alpha-tpuv6e", 32, 1, _lite_sizes, "us-east5-b", 8),
}
_TYPE_RE = re.compile(r"^(v4|v5p|v5litepod|v6e)-(\d+)$")


@dataclass(frozen=True)
class TpuType:
    """A parsed accelerator type such as ``v5p-64``."""

    name: str
    generation: str
    chips: int
    hosts: int
    runtime: str
    hbm_bytes: int
    default_zone: str


def parse_tpu_type(text: str) -> TpuType:
    """``"v5p-64"`` -> 32 chips on 8 hosts, runtime ``v2-alpha-tpuv5``; raises ``LaunchError``.

    v4/v5p types count TensorCores (2 per chip), v5e (``v5litepod-N``)/v6e types count chips.
    Multi-host slices have 4 chips per host.
    """
    m = _TYPE_RE.match(text.strip().lower())
    if not m:
        raise LaunchError(
            f"invalid TPU type {text!r}: expected v4-N, v5p-N, v5litepod-N or v6e-N "
            f"(e.g. v4-8, v5p-64, v5litepod-16, v6e-8)")
    gen_name, n = m.group(1), int(m.group(2))
    gen = GENERATIONS[gen_name]
    if not gen.sizes(n):
        hint = ("a multiple of 8 (TensorCores, 2 per chip)" if gen.cores_per_chip == 2
                else "one of 1, 4, 8, 16, 32, 64, 128, 256 (chips)")
        raise LaunchError(f"invalid TPU type {text!r}: the size of a {gen_name} slice must be "
                          f"{hint}")
    chips = n // gen.cores_per_chip
    hosts = 1 if chips <= gen.single_host_max_chips else chips // 4
    return TpuType(name=f"{gen_name}-{n}", generation=gen_name, chips=chips, hosts=hosts,
                   runtime=gen.runtime, hbm_bytes=int(gen.hbm_gib * GIB), default_zone=gen.zone)


@dataclass(frozen=True)
class LaunchSpec:
    """Everything ``build_steps`` needs; ``config`` is the path/name ``tppo train`` gets."""

    config: str
    tpu: TpuType
    name: str
    zone: str
    project: str | None = None
    bucket: str | None = None  # gs://BUCKET (run dir and results live there when set)
    run_dir: str | None = None  # default: BUCKET/runs/NAME, or runs/NAME on the workers
    spot: bool = False
    queued: bool = False
    best_effort: bool = False  # queued only; needs `gcloud alpha`
    repo: str | None = None  # git URL to clone on the workers instead of copying this tree
    overrides: tuple[str, ...] = ()
    resume: bool = False
    keep: bool = False  # leave the TPU up at the end
    local_root: Path = REPO_ROOT

    @property
    def resolved_run_dir(self) -> str:
        if self.run_dir:
            return self.run_dir
        if self.bucket:
            return f"{self.bucket.rstrip('/')}/runs/{self.name}"
        return f"runs/{self.name}"


@dataclass(frozen=True)
class Step:
    """One launch step: ``argv`` runs as is; ``wait_for`` polls a describe command until the
    state is reached (``render`` shows it as a shell loop)."""

    title: str
    argv: tuple[str, ...]
    wait_for: str | None = None  # target state of a describe command
    fail_states: tuple[str, ...] = ()
    creates_tpu: bool = False  # after this step succeeds, a failure must mention deletion
    # A failure is reported (the launch exits 1) but the later steps still run: a failed
    # copy of the results must not leave the TPU up.
    keep_going: bool = False


def default_name(config: str, tpu: TpuType) -> str:
    """``tppo-<config stem>-<tpu type>``, lower-case letters, digits and dashes only."""
    stem = Path(config).stem.lower()
    raw = re.sub(r"[^a-z0-9-]+", "-", f"tppo-{stem}-{tpu.name}").strip("-")
    return re.sub(r"-{2,}", "-", raw)[:60].rstrip("-")


def validate_name(name: str) -> str:
    """TPU node ids: a lower-case letter, then letters/digits/dashes, at most 61 characters."""
    if not re.fullmatch(r"[a-z]([-a-z0-9]{0,59}[a-z0-9])?", name):
        raise LaunchError(f"invalid TPU name {name!r}: use lower-case letters, digits and "
                          f"dashes, starting with a letter (at most 61 characters)")
    return name


def refuse_control_chars(args: dict[str, object]) -> None:
    """``LaunchError`` naming the first argument (``--zone``, an override, ...) holding a
    control character: a newline in one would end a ``#`` comment of the printed script
    and run the rest as a command (and no zone, path or override needs one)."""
    for key, value in args.items():
        for text in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(text, str) and any(ord(c) < 32 or ord(c) == 127 for c in text):
                flag = "a key=value override" if key == "overrides" else (
                    f"--{key.replace('_', '-')}")
                raise LaunchError(f"{flag} holds a control character ({text[:60]!r}): "
                                  f"arguments of tppo launch are one line of printable text")


def _gcloud(spec: LaunchSpec, *args: str, alpha: bool = False) -> tuple[str, ...]:
    base = ("gcloud", "alpha") if alpha else ("gcloud",)
    project = ("--project", spec.project) if spec.project else ()
    return base + tuple(args) + ("--zone", spec.zone) + project


def _ssh(spec: LaunchSpec, command: str, worker: str = "all") -> tuple[str, ...]:
    return _gcloud(spec, "compute", "tpus", "tpu-vm", "ssh", spec.name, f"--worker={worker}",
                   "--command", command)


def remote_config(spec: LaunchSpec) -> str:
    """The ``--config`` value on the workers: repo-relative path, shipped name, or the copy
    made by the copy step for a file outside the repo."""
    p = Path(spec.config)
    if not p.exists():
        return spec.config  # a shipped config name such as "smoke"
    root = spec.local_root.resolve()
    # the path as given first: configs/ is a link to tppo_jax/configs, and either works there
    for q in (Path(os.path.abspath(p)), p.resolve()):
        if q.is_relative_to(root):
            return q.relative_to(root).as_posix()
    return f"run-configs/{p.name}"


def train_argv(spec: LaunchSpec) -> list[str]:
    """The per-worker training command (README: ``.venv/bin/tppo train``)."""
    argv = [".venv/bin/tppo", "train", "--config", remote_config(spec),
            "--run-dir", spec.resolved_run_dir, "--no-progress"]
    if spec.tpu.hosts > 1:
        argv += ["--distributed", "auto"]
    if spec.resume:  # the run's own config.yaml wins; --config (and the same overrides)
        argv.append("--resume")  # only decide for a run that never wrote one
    return argv + list(spec.overrides)


def build_steps(spec: LaunchSpec) -> list[Step]:
    """The launch as ordered steps; see the module docstring."""
    t = spec.tpu
    if t.hosts > 1 and not spec.resolved_run_dir.startswith("gs://"):
        raise LaunchError(f"{t.name} has {t.hosts} hosts: each writes its own checkpoint "
                          f"shards, so the run dir must be one place they all reach; pass "
                          f"--bucket gs://BUCKET or --run-dir gs://...")
    steps: list[Step] = []
    for part in (_create_steps, _install_steps, _train_steps, _results_steps):
        part(spec, steps)
    if not spec.keep:
        steps.append(delete_step(spec))
    return steps


def _create_steps(spec: LaunchSpec, steps: list[Step]) -> None:
    """Create the TPU (a VM, or a queued resource) and wait until it is up."""
    t = spec.tpu
    if spec.queued:
        create = ["compute", "tpus", "queued-resources", "create", spec.name,
                  "--node-id", spec.name, "--accelerator-type", t.name,
                  "--runtime-version", t.runtime]
        if spec.best_effort:
            create.append("--best-effort")
        elif spec.spot:
            create.append("--spot")
        steps.append(Step(f"request queued resource {spec.name} ({t.name}: {t.chips} chips, "
                          f"{t.hosts} hosts)", _gcloud(spec, *create, alpha=spec.best_effort),
                          creates_tpu=True))
        steps.append(Step("wait until the queued resource is ACTIVE",
                          _gcloud(spec, "compute", "tpus", "queued-resources", "describe",
                                  spec.name, "--format", "value(state.state)"),
                          wait_for="ACTIVE", fail_states=("FAILED", "SUSPENDED", "DELETING")))
    else:
        create = ["compute", "tpus", "tpu-vm", "create", spec.name,
                  "--accelerator-type", t.name, "--version", t.runtime]
        if spec.spot:
            create.append("--spot")
        steps.append(Step(f"create TPU VM {spec.name} ({t.name}: {t.chips} chips, "
                          f"{t.hosts} hosts)", _gcloud(spec, *create), creates_tpu=True))
        steps.append(Step("wait until the TPU VM is READY",
                          _gcloud(spec, "compute", "tpus", "tpu-vm", "describe", spec.name,
                                  "--format", "value(state)"),
                          wait_for="READY",
                          fail_states=("FAILED", "PREEMPTED", "TERMINATED", "STOPPED",
                                       "DELETING")))


def _install_steps(spec: LaunchSpec, steps: list[Step]) -> None:
    """Get this checkout (or the repo) onto every worker and run the README install."""
    if spec.repo:
        fetch = (f"(test -d {REMOTE_DIR}/.git || git clone {shlex.quote(spec.repo)} {REMOTE_DIR})"
                 f" && cd {REMOTE_DIR}")
    else:
        tarball = f"/tmp/{spec.name}.tar.gz"
        # A tarball, not `scp --recurse` of the tree: one file per worker, and .venv/runs stay
        # behind (the workers build their own venv).
        steps.append(Step("package this checkout (without .venv, runs, wandb, .git)",
                          ("tar", "-czf", tarball, "--exclude=./.venv", "--exclude=./runs",
                           "--exclude=./wandb", "--exclude=./.git", "--exclude=__pycache__",
                           "-C",
                           str(spec.local_root), ".")))
        steps.append(Step("copy it to every worker",
                          _gcloud(spec, "compute", "tpus", "tpu-vm", "scp", tarball,
                                  f"{spec.name}:{REMOTE_TARBALL}", "--worker=all")))
        fetch = (f"mkdir -p {REMOTE_DIR} && tar -xzf {REMOTE_TARBALL} -C {REMOTE_DIR}"
                 f" && cd {REMOTE_DIR}")
    cfg_path = Path(spec.config)
    if cfg_path.exists() and remote_config(spec).startswith("run-configs/"):
        fetch += " && mkdir -p run-configs"
    steps.append(Step("install on every worker (README: ./install.sh, via run_on_pod.sh)",
                      _ssh(spec, f"{fetch} && launch/run_on_pod.sh ./install.sh")))
    if cfg_path.exists() and remote_config(spec).startswith("run-configs/"):
        steps.append(Step("copy the config to every worker",
                          _gcloud(spec, "compute", "tpus", "tpu-vm", "scp", str(cfg_path),
                                  f"{spec.name}:{REMOTE_DIR}/{remote_config(spec)}",
                                  "--worker=all")))


def _train_steps(spec: LaunchSpec, steps: list[Step]) -> None:
    """Start ``tppo train`` on every worker and stream worker 0's log until it ends."""
    train = shlex.join(train_argv(spec))
    # setsid + nohup + all fds redirected: the ssh session returns at once and training
    # survives it; run_on_pod.sh writes the pid/rc files the stream step waits on.
    start = (f"cd {REMOTE_DIR} && rm -f {TRAIN_PID} {TRAIN_RC} && "
             f"(setsid nohup launch/run_on_pod.sh {train} > {TRAIN_LOG} 2>&1 < /dev/null &)")
    steps.append(Step("start training on every worker (nohup, log in ~/tppo-train.log)",
                      _ssh(spec, start)))
    stream = (f"while [ ! -s {TRAIN_PID} ]; do sleep 2; done; "
              f"tail -n +1 -F --pid=\"$(cat {TRAIN_PID})\" {TRAIN_LOG}; "
              f"exit \"$(cat {TRAIN_RC} 2>/dev/null || echo 1)\"")
    steps.append(Step("stream worker 0's log until training ends (exit = tppo train's)",
                      _ssh(spec, stream, worker="0")))


def _results_steps(spec: LaunchSpec, steps: list[Step]) -> None:
    """Copy the run back (from the bucket, or from worker 0)."""
    run_dir = spec.resolved_run_dir
    local_runs = "runs/"
    if run_dir.startswith("gs://"):
        steps.append(Step(f"copy results from {run_dir}",
                          ("gcloud", "storage", "cp", "-r", run_dir, local_runs),
                          keep_going=True))
    else:
        # An absolute --run-dir is where it says on the worker; a relative one is in the repo.
        where = run_dir if run_dir.startswith(("/", "~")) else f"{REMOTE_DIR}/{run_dir}"
        steps.append(Step("copy results from worker 0",
                          _gcloud(spec, "compute", "tpus", "tpu-vm", "scp", "--recurse",
                                  f"{spec.name}:{where}", local_runs, "--worker=0"),
                          keep_going=True))


def delete_step(spec: LaunchSpec) -> Step:
    """Deletes the TPU (``--force`` also deletes a queued resource's node)."""
    if spec.queued:
        argv = _gcloud(spec, "compute", "tpus", "queued-resources", "delete", spec.name,
                       "--force", "--quiet", alpha=spec.best_effort)
    else:
        argv = _gcloud(spec, "compute", "tpus", "tpu-vm", "delete", spec.name, "--quiet")
    return Step(f"delete {spec.name}", argv)


def wait_shell(step: Step, interval_s: int = 30, timeout_s: float = 3600.0) -> str:
    """A ``wait_for`` step as one shell line (dry-run output): polls until the state is
    reached; a failure state, or ``timeout_s`` seconds without it, exits 1 with one line."""
    fail = "|".join(step.fail_states) or "__never__"
    limit = int(timeout_s)
    return (f"t0=$SECONDS; until s=\"$({shlex.join(step.argv)})\"; [ \"$s\" = {step.wait_for} ]; "
            f"do case \"$s\" in {fail}) echo \"state $s\" >&2; exit 1;; esac; "
            f"if [ $((SECONDS - t0)) -ge {limit} ]; then "
            f"echo \"still ${{s:-not found}} after {limit} s\" >&2; exit 1; fi; "
            f"sleep {interval_s}; done")


def render(spec: LaunchSpec, steps: Sequence[Step], *, wait_timeout_s: float = 3600.0) -> str:
    """The launch as a shell script: a comment per step, then its command line (a wait
    gives up after ``wait_timeout_s``)."""
    t = spec.tpu
    lines = [f"# tppo launch: {spec.config} on {t.name} ({t.chips} chips, {t.hosts} hosts, "
             f"runtime {t.runtime}) in {spec.zone}; run dir {spec.resolved_run_dir}"]
    for i, s in enumerate(steps, 1):
        lines.append(f"# {i}. {s.title}")
        lines.append(wait_shell(s, timeout_s=wait_timeout_s) if s.wait_for
                     else shlex.join(s.argv))
    return "\n".join(lines) + "\n"


Runner = Callable[[Sequence[str]], int]
Capture = Callable[[Sequence[str]], tuple[int, str]]  # (exit code, stdout)


def _subprocess_runner(argv: Sequence[str]) -> int:
    # stdout/stderr are inherited, so gcloud's and the training log's output stream live.
    return subprocess.run(list(argv), check=False).returncode


def _subprocess_capture(argv: Sequence[str]) -> tuple[int, str]:
    out = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    return out.returncode, out.stdout


def _poll(step: Step, capture: Capture, timeout_s: float, interval_s: float,
          sleep: Callable[[float], None] = time.sleep) -> None:
    """Re-runs a describe command until it prints ``step.wait_for`` (or a failure state)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rc, out = capture(step.argv)
        state = out.strip()
        if rc == 0 and state == step.wait_for:
            return
        if state in step.fail_states:
            raise LaunchError(f"state is {state}")
        if time.monotonic() > deadline:
            raise LaunchError(f"still {state or 'not found'} after {timeout_s:.0f} s")
        print(f"[launch] state {state or 'not found yet'}; waiting", file=sys.stderr, flush=True)
        sleep(interval_s)


def require_gcloud() -> None:
    """``LaunchError`` unless ``gcloud`` is on PATH."""
    if shutil.which("gcloud") is None:
        raise LaunchError("gcloud not found on PATH: install the Google Cloud SDK "
                          "(https://cloud.google.com/sdk) or use --dry-run")


def run_steps(spec: LaunchSpec, steps: Sequence[Step], *, runner: Runner | None = None,
              capture: Capture | None = None, wait_timeout_s: float = 3600.0,
              poll_interval_s: float = 30.0) -> int:
    """Runs the steps in order; at the first failure prints one clear message (and how to
    delete the TPU if it was created) and returns 1. ``runner``/``capture`` default to
    ``subprocess`` (tests pass fakes)."""
    if runner is None or capture is None:
        require_gcloud()
    run = runner or _subprocess_runner
    cap = capture or _subprocess_capture
    created = False
    failed = False
    for i, step in enumerate(steps, 1):
        shown = (wait_shell(step, timeout_s=wait_timeout_s) if step.wait_for
                 else shlex.join(step.argv))
        print(f"[launch] {i}/{len(steps)} {step.title}\n$ {shown}", file=sys.stderr, flush=True)
        try:
            if step.wait_for:
                _poll(step, cap, wait_timeout_s, poll_interval_s)
                rc = 0
            else:
                rc = run(step.argv)
        except (LaunchError, OSError) as e:
            rc, detail = 1, str(e)
        else:
            detail = f"exit code {rc}"
        if rc != 0:
            msg = f"tppo launch: step {i}/{len(steps)} ({step.title}) failed: {detail}"
            if step.keep_going:
                print(f"{msg}; going on with the next steps", file=sys.stderr)
                failed = True
                continue
            if created and not step.title.startswith("delete"):
                msg += (f"; the TPU {spec.name} is still up: delete it with "
                        f"`{shlex.join(delete_step(spec).argv)}`")
            print(msg, file=sys.stderr)
            return 1
        created = created or step.creates_tpu
    return 1 if failed else 0
