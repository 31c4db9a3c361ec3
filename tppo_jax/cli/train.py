"""``tppo train``: T-PPO training, single- or multi-host."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tppo_jax.cli.args import add_config_args
from tppo_jax.cli.log import log_to_stderr

if TYPE_CHECKING:
    from tppo_jax.runs.run_dir import RunDir


def _train_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument("--run-dir", default=None,
                   help="output directory (default: runs/<config name>)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest good checkpoint, with the run's own "
                   "config.yaml (overrides apply on top; --config only matters for a run "
                   "that has no config.yaml yet)")
    p.add_argument("--start-over", action="store_true",
                   help="start again at step 0 in a run dir that holds a run's logs but no "
                   "usable checkpoint (all set aside as damaged, or a new checkpoint.dir): "
                   "its logs and config.yaml are first moved to RUN/replaced-<time>/, "
                   "nothing is deleted; refused while the run has checkpoints (with "
                   "--resume, the run's config.yaml still applies)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    d = p.add_argument_group(
        "multi-host", "start jax.distributed (also from TPPO_COORDINATOR, TPPO_NUM_PROCESSES, "
        "TPPO_PROCESS_ID, or TPPO_DISTRIBUTED=auto); every process runs the same command")
    d.add_argument("--distributed", choices=["auto"], default=None,
                   help="auto: the cluster describes itself (Cloud TPU pods, SLURM)")
    d.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="address of process 0")
    d.add_argument("--num-processes", type=int, default=None)
    d.add_argument("--process-id", type=int, default=None)


def start_distributed(args: argparse.Namespace) -> None:
    """``jax.distributed.initialize`` from the multi-host flags/environment (before any
    device is touched); a bad setting is a one-line error."""
    from tppo_jax.config import ConfigError
    from tppo_jax.parallel.multihost import initialize

    try:
        initialize(args.coordinator, args.num_processes, args.process_id,
                   auto=args.distributed == "auto")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def start_over(rd: RunDir) -> None:
    """``--start-over``: refused while the run has checkpoints (it never discards one);
    else process 0 moves the run's logs and config.yaml aside (a bucket run's pulled back
    first, so the aside copy is mirrored) and every process waits for it."""
    from tppo_jax.parallel import multihost as mh
    from tppo_jax.runs.checkpoint import listed_steps
    from tppo_jax.runs.run_dir import RunDirError, pull, set_aside_logs

    steps, _ = listed_steps(rd.checkpoints)
    if steps:
        raise RunDirError(f"--start-over: {rd.checkpoints} has checkpoints (latest step "
                          f"{steps[0]}) and --start-over never discards one: --resume "
                          f"continues the run, or choose a new --run-dir")
    if mh.is_primary():
        pull(rd)
        set_aside_logs(rd.local)
    mh.barrier("start-over")


def run_files_error(e: OSError, rd: RunDir) -> str | None:
    """One line for a failed write of the run's files (a full disk or quota, or a file or
    folder under the run dir that cannot be written): what failed and what is intact.
    None for an OSError that is not about the run's files."""
    from tppo_jax.runs.checkpoint import listed_steps
    from tppo_jax.runs.run_dir import DISK_FULL

    # shutil.Error (a copied folder) lists its files' errors as text, without an errno.
    said = next((os.strerror(n) for n in DISK_FULL if os.strerror(n) in str(e)), None)
    full = e.errno in DISK_FULL or said is not None
    name = os.path.abspath(e.filename) if isinstance(e.filename, str) else ""
    under = bool(name) and (name.startswith(str(rd.local) + os.sep)
                            or name.startswith(str(rd.checkpoints)))
    if not (full or under):
        return None
    steps, _ = listed_steps(rd.checkpoints)
    why = e.strerror or said or " ".join(str(e).split())[:200]
    where = f" ({e.filename})" if name else ""
    fix = "free space" if full else "fix access"
    kept = (f"the last checkpoint (step {steps[0]}) and metrics.jsonl are intact; {fix}, "
            f"then --resume" if steps else f"metrics.jsonl is intact (no checkpoint was "
            f"written yet); {fix}, then run again")
    return f"{'disk full' if full else 'cannot write'} under {rd.local}: {why}{where}; {kept}"


def cmd_train(args: argparse.Namespace) -> int:
    from tppo_jax.api import before_after
    from tppo_jax.config import load_config
    from tppo_jax.rewards.custom import RewardFnError
    from tppo_jax.runs.checkpoint import CheckpointError
    from tppo_jax.runs.run_claim import claim_run_dir
    from tppo_jax.runs.run_config import resume_config
    from tppo_jax.runs.run_dir import RunDirError, resolve_run_dir
    from tppo_jax.trainer.trainer import TrainingDiverged, nan_updates_from, train

    log_to_stderr(logging.WARNING, ours=logging.INFO)  # ours: resume, warm-start, checkpoints
    start_distributed(args)
    name = Path(args.config).stem if args.config else "default"
    run_dir = args.run_dir or str(Path("runs") / name)  # str: may be a gs:// URL
    # A resume is the same run: its own config.yaml, the command line's changes on top.
    cfg = resume_config(run_dir, args.config, args.overrides) if args.resume else None
    if cfg is None:
        cfg = load_config(args.config, args.overrides)
    # Fault injection for the reliability tests (they run this command in a subprocess):
    # TPPO_FAULT_NAN_FROM_STEP=N makes every update from step N on see NaN advantages.
    fault = os.environ.get("TPPO_FAULT_NAN_FROM_STEP")
    hooks = nan_updates_from(int(fault)) if fault else None
    rd = resolve_run_dir(run_dir, cfg.checkpoint.dir)
    try:
        # The lock is held from here to the summary (lent once: the set-up takes it again).
        release = claim_run_dir(rd, args.resume, check=False, lend=True)
    except RunDirError as e:
        print(f"tppo train: refused: {e}", file=sys.stderr)
        return 2
    try:
        if args.start_over:
            start_over(rd)
        summary = train(cfg, run_dir, resume=args.resume and not args.start_over,
                        progress=not args.no_progress, hooks=hooks)
    except RunDirError as e:
        print(f"tppo train: refused: {e}", file=sys.stderr)
        return 2
    except RewardFnError as e:
        print(f"tppo train: stopped: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        line = run_files_error(e, rd)
        if line is None:
            raise
        print(f"tppo train: stopped: {line}", file=sys.stderr)
        return 1
    except (TrainingDiverged, CheckpointError) as e:
        print(f"tppo train: stopped: {e}", file=sys.stderr)
        if isinstance(e, CheckpointError):
            # After a failed write, Orbax writes still in flight can report the same cause
            # again while the interpreter exits (a writer thread ending, asyncio collecting
            # its task): exit now, so the stop line stays the last line and nothing writes
            # into the discarded step.
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        return 1
    finally:
        release()
    if summary["preempted"]:
        print(f"tppo train: preempted after step {summary['steps']}; checkpoint saved. "
              f"Continue with: tppo train --run-dir {summary['run_dir']} --resume")
        return 0
    print(before_after(cfg, summary))
    return 0


def register(register_fn: Callable) -> None:
    register_fn("train", "run T-PPO training (no arguments: the embedded CPU default)",
                _train_args, cmd_train)
