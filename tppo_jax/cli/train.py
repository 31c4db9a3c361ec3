"""``tppo train``: T-PPO training, single- or multi-host."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from tppo_jax.cli.args import add_config_args


def _train_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument("--run-dir", default=None,
                   help="output directory (default: runs/<config name>)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest good checkpoint, with the run's own "
                   "config.yaml (overrides apply on top; --config only matters for a run "
                   "that has no config.yaml yet)")
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


def setup_logging() -> None:
    """Our INFO lines (resume, warm-start, checkpoints) on stderr; libraries at WARNING.
    ``force``: importing Orbax already made absl call ``basicConfig()`` (level WARNING),
    which silently turned a later ``basicConfig(level=INFO)`` into a no-op."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s",
                        force=True)
    logging.getLogger("tppo_jax").setLevel(logging.INFO)


def cmd_train(args: argparse.Namespace) -> int:
    from tppo_jax.config import load_config
    from tppo_jax.train.checkpoint import CheckpointError
    from tppo_jax.train.loop import TrainingDiverged, nan_updates_from, train
    from tppo_jax.train.run_config import resume_config

    setup_logging()
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
    try:
        summary = train(cfg, run_dir, resume=args.resume, progress=not args.no_progress,
                        hooks=hooks)
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
    if summary["preempted"]:
        print(f"tppo train: preempted after step {summary['steps']}; checkpoint saved. "
              f"Continue with: tppo train --run-dir {summary['run_dir']} --resume")
        return 0
    b, a = summary["eval_before"], summary["eval_after"]
    k = cfg.train.eval_samples
    print(f"held-out accuracy, avg@{k} sampled at T={cfg.rollout.temperature}: "
          f"{b['accuracy']:.1f}% -> {a['accuracy']:.1f}%; greedy: {b['greedy_accuracy']:.1f}% -> "
          f"{a['greedy_accuracy']:.1f}%  ({summary['steps']} steps, "
          f"{summary['train_seconds']:.0f} s, run dir {summary['run_dir']})")
    return 0


def register(register_fn: Callable) -> None:
    register_fn("train", "run T-PPO training (no arguments: the embedded CPU default)",
                _train_args, cmd_train)
