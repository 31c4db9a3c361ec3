"""Orbax checkpoints: one item per tree the caller passes, named as the caller names it
(a training run: its ``TrainState``'s params and optimizer states, the scheduler's slots and
KV cache), plus JSON metadata (step, data-iterator and scheduler host state).

Multi-host: every process calls ``save``/``restore`` with global arrays; Orbax writes each
shard once from the host that holds it, and process 0 writes the JSON metadata."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath

from tppo_jax.config import ConfigError
from tppo_jax.parallel import multihost as mh
from tppo_jax.parallel.multihost import global_to_host
from tppo_jax.runs.manifest import MANIFEST, check, write_manifest

log = logging.getLogger(__name__)


def all_finite(tree: Any) -> bool:
    """True when every floating-point leaf of ``tree`` is finite. Reduced on device, so
    params sharded over several hosts are checked without gathering them."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
    if not leaves:
        return True
    ok = jax.jit(lambda xs: jnp.all(jnp.stack([jnp.isfinite(x).all() for x in xs])))(leaves)
    return bool(global_to_host(ok))


def _non_finite(trees: dict[str, Any], *, every: bool) -> list[str]:
    """The restored items holding NaN or inf: the params (which a save never writes
    non-finite, so such values are damage) and, with ``every`` (a step no manifest
    vouches for), every item."""
    return [k for k, tree in trees.items()
            if (every or k in FINITE_ITEMS) and not all_finite(tree)]


def checkpoint_path(directory: str | Path) -> epath.Path:
    """A local directory (made absolute) or a bucket URL such as ``gs://b/run/checkpoints``,
    which Orbax writes directly: on a pod every host must write to one shared place."""
    s = str(directory)
    return epath.Path(s) if "://" in s else epath.Path(Path(s).absolute())

# The items a training run's checkpoints hold (``TrainState.items()`` +
# ``TruncatedRolloutScheduler.checkpoint_items()``); the Checkpointer itself saves and
# restores whatever trees it is given. kv_cache: the scheduler's cache of unfinished rows,
# so a resumed run continues exactly as an uninterrupted one would.
ITEMS = ("policy", "value", "policy_opt", "value_opt", "slots", "kv_cache")
# Items a save refuses to write when they hold NaN or inf (a diverged run's params).
FINITE_ITEMS = ("policy", "value")
DAMAGED = ".damaged"  # suffix of a step set aside by a resume (Orbax ignores the folder)
# How the models' params are laid out, written into every checkpoint's metadata: decoder
# layers stacked on a leading axis (models/transformer.py). A checkpoint without it was written
# with one subtree per layer, which no template of this version matches.
PARAM_LAYOUT = "stacked-layers"


class CheckpointError(RuntimeError):
    """No checkpoint could be written, or none could be restored; the message is one line."""


def listed_steps(directory: str | Path) -> tuple[list[int], list[str]]:
    """``(committed steps, folders set aside as damaged)`` of a checkpoint directory, newest
    first, read by listing it (no Orbax manager: nothing is created). A step is committed
    when its folder has its final name (Orbax renames a finished save to it)."""
    path = checkpoint_path(directory)
    try:
        names = [p.name for p in path.iterdir()] if path.exists() else []
    except OSError:
        return [], []
    steps = sorted((int(n) for n in names if n.isdigit()), reverse=True)
    damaged = sorted((n for n in names if DAMAGED in n), reverse=True)
    return steps, damaged


def host_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """This host's part of a checkpoint's metadata (data iterator and scheduler state)."""
    if "hosts" not in meta:  # written by a single-host version without per-host state
        return meta
    n = int(meta.get("num_processes", len(meta["hosts"])))
    if n != jax.process_count():
        raise ConfigError(f"checkpoint at step {meta['step']} was written by {n} processes; "
                          f"this run has {jax.process_count()} (per-host data and rollout "
                          f"state cannot be re-split)")
    return meta["hosts"][jax.process_index()]


class Checkpointer:
    """Saves every ``every`` steps (and on demand), keeps the last ``keep``; each save gets
    a content manifest (``runs/manifest.py``) that restores check first."""

    def __init__(self, directory: str | Path, *, every: int, keep: int) -> None:
        self.directory = checkpoint_path(directory)
        self.every = every
        self.mngr = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        )

    def latest_step(self) -> int | None:
        return self.mngr.latest_step()

    def due(self, step: int) -> bool:
        """Whether ``step`` is a scheduled save (every ``every`` steps)."""
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, trees: dict[str, Any], meta: dict[str, Any], *,
             force: bool = False) -> bool:
        """Saves if due (or ``force``); never saves non-finite params (returns False).
        A failed write (disk full, permissions, bucket) raises ``CheckpointError``; the
        previous checkpoint is untouched (Orbax writes to a temporary folder first)."""
        if not (force or self.due(step)):
            return False
        bad = [k for k in FINITE_ITEMS if k in trees and not all_finite(trees[k])]
        if bad:
            log.error("checkpoint at step %d skipped: non-finite values in %s", step, bad)
            return False
        args = {k: ocp.args.StandardSave(tree) for k, tree in trees.items()}
        args["meta"] = ocp.args.JsonSave({**meta, "param_layout": PARAM_LAYOUT})
        threads = set(threading.enumerate())
        hook, sys.unraisablehook = sys.unraisablehook, _ignore_closed_loops(sys.unraisablehook)
        _ABSL.addFilter(_QUIET)
        try:
            self.mngr.save(step, args=ocp.args.Composite(**args), force=force)
            self.mngr.wait_until_finished()
            write_manifest(self.directory / str(step))
        except Exception as e:  # Orbax wraps OSError (ENOSPC, EFBIG, EACCES) in its own types
            # Orbax raises at the first failed write while its other writer threads run on:
            # let them end before deleting their folder (and before the process exits).
            # Writes still in flight fail later with the same cause and report it again,
            # after the run's stop line: from a thread (it outlived the wait below) or from
            # asyncio ("Task exception was never retrieved", when the task is collected,
            # often at exit). Drop those repeats: the stop line stays the last line.
            _drop_repeated_write_failures()
            for t in set(threading.enumerate()) - threads:
                with contextlib.suppress(Exception):  # Orbax's threads re-raise in join()
                    t.join(timeout=_THREAD_WAIT_S)
            self._discard_partial(step)
            prev = [s for s in self.mngr.all_steps() if s < step]
            kept = f"step {max(prev)} is intact" if prev else "no earlier checkpoint exists"
            raise CheckpointError(
                f"could not write the checkpoint of step {step} to {self.directory} "
                f"({_write_cause(e)}); {kept}. Free space (or fix access) and --resume") from e
        # After a failure both stay: the run stops, and close() may re-raise in Orbax.
        _ABSL.removeFilter(_QUIET)
        sys.unraisablehook = hook
        return True

    def _discard_partial(self, step: int) -> None:
        """Removes what a failed save left (its temporary folder, or a step committed
        without a manifest), so the space comes back and a resume never picks it."""
        if not mh.is_primary():
            return
        for p in self.directory.iterdir():
            # The step itself only when this save committed it but wrote no manifest.
            if (p.name == str(step) and not (p / MANIFEST).exists()) or p.name.startswith(
                    f"{step}.orbax-checkpoint-tmp"):
                try:
                    p.rmtree()
                except OSError as e:
                    log.warning("could not remove %s: %s", p, e)
        self.mngr.reload()

    def verify(self, step: int, items: tuple[str, ...] | None = None) -> list[str] | None:
        """Problems of step ``step`` against its manifest (see ``manifest.check``)."""
        return check(self.directory / str(step), items)

    def restore(self, step: int, templates: dict[str, Any]) -> tuple[dict[str, Any], dict]:
        """Restores the items named by ``templates`` into their structure (and shardings)."""
        args = {k: ocp.args.StandardRestore(tree) for k, tree in templates.items()}
        args["meta"] = ocp.args.JsonRestore()
        out = self.mngr.restore(step, args=ocp.args.Composite(**args))
        return {k: out[k] for k in templates}, out["meta"]

    def restore_latest(self, templates: dict[str, Any]
                       ) -> tuple[int, dict[str, Any], dict] | None:
        """The newest step that verifies and restores, as ``(step, trees, meta)``; None when
        there are no checkpoints. A damaged step is reported (item and file), renamed to
        ``<step>.damaged`` (so the resumed run can write that step again) and skipped;
        ``CheckpointError`` when none is left."""
        steps = sorted(self.mngr.all_steps(), reverse=True)
        if not steps:
            return None
        failures = []
        for step in steps:
            self.check_layout(step)
            why = self._problems(step, None, lambda s=step: self.restore(s, templates))
            if isinstance(why, tuple):
                return (step, *why)
            failures.append(f"step {step}: {why}")
            self._set_aside(step)
        raise CheckpointError(f"no checkpoint in {self.directory} passed verification "
                              f"({'; '.join(failures)}); each was renamed <step>{DAMAGED}")

    def _problems(self, step: int, items: tuple[str, ...] | None, restore) -> Any:
        """``restore()``'s result (a tuple) when step ``step`` verifies and restores, else
        one line saying why not (logged as an error)."""
        problems = self.verify(step, items)
        if problems is None:
            log.warning("checkpoint step %d has no manifest (older version, or stopped "
                        "before it was written): restoring it unverified, then checking "
                        "that every restored tree is finite", step)
        if problems:
            for p in problems:
                log.error("CHECKPOINT DAMAGED: step %d: %s", step, p)
            log.error("checkpoint step %d failed verification (%d files): skipping it",
                      step, len(problems))
            return f"{problems[0]}" + (f" (+{len(problems) - 1} more)" if len(problems) > 1
                                       else "")
        try:
            out = restore()
        except Exception as e:
            if problems is not None:
                # Every byte is as written: the run and the checkpoint disagree (a changed
                # config or code), which skipping to an older step would not fix.
                raise CheckpointError(f"checkpoint step {step} in {self.directory} verifies "
                                      f"but does not restore: {_one_line(e)}") from e
            log.error("CHECKPOINT DAMAGED: step %d could not be restored: %s", step, e)
            return f"restore failed: {_one_line(e)}"
        bad = _non_finite(out[0] if items is None else {items[0]: out[0]},
                          every=problems is None)
        if bad:
            why = (f"non-finite values in {', '.join(bad)}"
                   + (" (no manifest to verify it against)" if problems is None else ""))
            log.error("CHECKPOINT DAMAGED: step %d: %s: skipping it", step, why)
            return why
        return out

    def check_layout(self, step: int) -> None:
        """``CheckpointError`` (one line) when step ``step`` holds params in an older layout
        (per-layer decoder params, before the layers were stacked): no restore of this
        version can read it, and it is not damaged, so it is neither skipped nor set aside.
        A step whose metadata cannot be read is left to verification."""
        try:
            meta = self.mngr.restore(step, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore()))["meta"]
        except Exception:
            return
        if meta.get("param_layout") != PARAM_LAYOUT:
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} holds per-layer decoder params "
                f"(written before layers were stacked for lax.scan); this version reads only "
                f"the stacked layout: start a new run (or export it with the version that "
                f"wrote it)")

    def _set_aside(self, step: int) -> None:
        """Renames a damaged step out of Orbax's sight, keeping it for inspection."""
        if mh.is_primary():
            src = self.directory / str(step)
            dst = self.directory / f"{step}{DAMAGED}"
            while dst.exists():
                dst = dst.parent / f"{dst.name}+"
            try:
                src.rename(dst)
                log.error("checkpoint step %d moved to %s", step, dst)
            except OSError as e:  # some buckets cannot rename a folder: drop it instead
                log.error("could not move damaged step %d (%s): deleting it", step, e)
                src.rmtree()
        mh.barrier(f"set-aside-{step}")
        self.mngr.reload()

    def restore_item(self, step: int, name: str, template: Any) -> Any:
        """Restores one item (e.g. ``policy`` for evaluation or export)."""
        out = self.mngr.restore(step, args=ocp.args.Composite(
            **{name: ocp.args.StandardRestore(template)}))
        return out[name]

    def latest_good_item(self, name: str, template: Any, step: int | None = None
                         ) -> tuple[int, Any] | None:
        """``(step, tree)`` of item ``name`` from ``step`` (default: the newest step whose
        ``name`` files verify); read-only, damaged steps are reported and skipped. None when
        there are no checkpoints; ``CheckpointError`` when none (or ``step``) is good."""
        steps = [step] if step is not None else sorted(self.mngr.all_steps(), reverse=True)
        if not steps:
            return None
        failures = []
        for s in steps:
            self.check_layout(s)
            why = self._problems(s, (name,),
                               lambda s=s: (self.restore_item(s, name, template),))
            if isinstance(why, tuple):
                return s, why[0]
            failures.append(f"step {s}: {why}")
        raise CheckpointError(f"no usable {name} checkpoint in {self.directory} "
                              f"({'; '.join(failures)})")

    def close(self) -> None:
        try:
            self.mngr.close()
        except Exception as e:  # a failed async save re-raises here; it was reported
            log.warning("closing the checkpoint manager: %s", _one_line(e))
        _ABSL.removeFilter(_QUIET)


class _QuietOrbaxTracebacks(logging.Filter):
    """Drops Orbax's ERROR records that carry a traceback: one failed write (a full disk)
    logs one from every item's writer thread, hundreds of lines, while ``save`` raises
    one ``CheckpointError`` that names the first cause."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and record.exc_info
                    and f"{os.sep}orbax{os.sep}" in record.pathname)


class _RepeatedWriteFailures(logging.Filter):
    """Drops records whose exception (or message) is a failed write: after a failed save,
    the writes still in flight report the cause ``save`` already raised."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not ((exc is not None and _is_write_failure(exc))
                    or "os_error_code=" in record.getMessage())


_ABSL = logging.getLogger("absl")  # Orbax logs through absl, which logs to this logger
_QUIET = _QuietOrbaxTracebacks()
_ASYNCIO = logging.getLogger("asyncio")  # where an unawaited task's exception is logged
_REPEATS = _RepeatedWriteFailures()


_THREAD_WAIT_S = 60.0  # how long a failed save waits for Orbax's other writer threads


def _ignore_closed_loops(previous):
    """An unraisable-exception hook that drops ``RuntimeError: Event loop is closed`` (a
    TensorStore write finishing after Orbax gave up on the save, calling back into its
    closed event loop) and repeats of a failed write, and passes everything else on."""
    def hook(unraisable) -> None:
        exc = unraisable.exc_value
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return
        if exc is not None and _is_write_failure(exc):
            return
        previous(unraisable)

    return hook


def _drop_repeated_write_failures() -> None:
    """Installs (once per process) the asyncio log filter and the thread exception hook
    that drop repeats of a failed write."""
    if _REPEATS in _ASYNCIO.filters:
        return
    _ASYNCIO.addFilter(_REPEATS)
    threading.excepthook = _ignore_failed_writes(threading.excepthook)


def _ignore_failed_writes(previous):
    """A ``threading.excepthook`` that drops a thread's failed write (an ``OSError`` or
    TensorStore's ``[os_error_code=...]`` message, already reported by ``save``) and passes
    everything else on."""
    def hook(args: threading.ExceptHookArgs) -> None:
        exc = args.exc_value
        if exc is not None and _is_write_failure(exc):
            return
        previous(args)

    return hook


def _is_write_failure(e: BaseException) -> bool:
    return _os_cause(e) is not None


def _write_cause(e: BaseException) -> str:
    """The operating system's reason for a failed write (``No space left on device, errno
    28``), else the message."""
    return _os_cause(e) or _one_line(e)


def _os_cause(e: BaseException) -> str | None:
    """The operating system's reason for a failed write, found in the exception chain (an
    ``OSError``) or in TensorStore's message (``[os_error_code='27']``); None without one."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return f"{seen.strerror}, errno {seen.errno}"
        m = re.search(r"([^:\]]+) \[os_error_code='(\d+)'\]", str(seen))
        if m:
            return f"{m.group(1).strip()}, errno {m.group(2)}"
        seen = seen.__cause__ or seen.__context__
    return None


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:300]


# ---- what a run directory keeps besides checkpoints ------------------------------------
MODEL_SUBDIR = "model"  # an HF run's config.json and tokenizer (the weights stay at model.path)
TOKENIZER_NAMES = ("tokenizer.json", "tokenizer.model")


def record_model(run_dir: Path, config_json: Path, tokenizer: Path) -> None:
    """Copies an HF model's ``config.json`` and tokenizer into ``RUN/model/``, so the run's
    checkpoints can be evaluated, exported and served without ``model.path``."""
    own = Path(run_dir) / MODEL_SUBDIR
    own.mkdir(parents=True, exist_ok=True)
    for src in (config_json, tokenizer):
        dst = own / src.name
        if not dst.exists() or dst.read_bytes() != src.read_bytes():
            shutil.copyfile(src, dst)


def run_model_files(run_dir: Path, subdirs: tuple[str, ...]) -> tuple[Path, Path] | None:
    """``(config.json, tokenizer file)`` the run keeps in the first of ``subdirs`` that has
    both (e.g. ``warmstart/policy`` + ``warmstart``, or ``model``); None when none does."""
    for sub in subdirs:
        folder = Path(run_dir) / sub
        config = next((c for c in (folder / "config.json", folder / "policy" / "config.json")
                       if c.exists()), None)
        tok = next((folder / n for n in TOKENIZER_NAMES if (folder / n).exists()), None)
        if config is not None and tok is not None:
            return config, tok
    return None
