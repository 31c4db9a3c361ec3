"""Content digests of one checkpoint step: written after Orbax commits it, checked on restore.

Orbax's atomic commit guarantees that a step directory is complete, not that its bytes are
still the ones written: a flipped bit on a disk, a file truncated by an interrupted copy
from a bucket, or a hand-edited JSON all restore silently (or as garbage). ``manifest.json``
in the step directory lists every file with its size and SHA-256; ``check`` names each file
that is missing, has another size, or other content.

Multi-host: every process hashes its share of the files (``split_for_host``), the digests
are gathered and process 0 writes the manifest; checking is split the same way and every
host gets the full list of problems, so all hosts take the same decision. Paths go through
``etils.epath``, so a ``gs://`` checkpoint directory is hashed and checked the same way.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

from etils import epath

from tppo_jax.parallel import multihost as mh

MANIFEST = "manifest.json"
_CHUNK = 1 << 22  # 4 MiB reads: checkpoint files can be many GB


def list_files(step_dir: epath.Path) -> list[str]:
    """Every file under ``step_dir`` as a sorted relative POSIX path, the manifest excluded
    (walked with ``iterdir``: epath refuses recursive globs on buckets)."""
    out, todo = [], [step_dir]
    while todo:
        for p in todo.pop().iterdir():
            if p.is_dir():
                todo.append(p)
            elif p.parent != step_dir or p.name != MANIFEST:
                out.append(p.relative_to(step_dir).as_posix())
    return sorted(out)


def file_digest(path: epath.Path) -> dict[str, Any]:
    """``{"size": bytes, "sha256": hex}`` of one file, read in chunks."""
    h, size = hashlib.sha256(), 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def _digests(step_dir: epath.Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """Digests of ``names``, each host hashing its share; every host gets all of them."""
    mine = {n: file_digest(step_dir / n) for n in mh.split_for_host(names)}
    out: dict[str, dict[str, Any]] = {}
    for part in mh.gather_json(mine):
        out.update(part)
    return out


def write_manifest(step_dir: epath.Path) -> None:
    """Hashes every file of a committed step and writes ``manifest.json`` (process 0).
    Collective: every process must call it, after every process finished its save."""
    mh.barrier(f"manifest-files-{step_dir.name}")
    names = list_files(step_dir)
    files = _digests(step_dir, names)
    if mh.is_primary():
        blob = json.dumps({"version": 1, "algorithm": "sha256", "files": files}, indent=1)
        tmp = step_dir / f"{MANIFEST}.tmp"
        tmp.write_text(blob)
        tmp.rename(step_dir / MANIFEST)  # a reader sees the whole manifest or none
    mh.barrier(f"manifest-written-{step_dir.name}")


def read_manifest(step_dir: epath.Path) -> dict[str, Any] | None:
    """The step's manifest, or None when it has none (an older checkpoint, or a process
    stopped between Orbax's commit and the manifest)."""
    path = step_dir / MANIFEST
    if not path.exists():
        return None
    return json.loads(path.read_text())


def item_of(name: str) -> str:
    """The checkpoint item a file belongs to (``policy/ocdbt.process_0/d/x`` -> ``policy``)."""
    return name.split("/", 1)[0] if "/" in name else "(step)"


def check(step_dir: epath.Path, items: Iterable[str] | None = None) -> list[str] | None:
    """Problems of the step's files against its manifest, one line each naming the item and
    file (empty: every byte as written); None when the step has no manifest. ``items``
    limits the check to those items' files (e.g. only ``policy`` for an export).
    Collective when several processes run: every process must call it."""
    try:
        manifest = read_manifest(step_dir)
    except (OSError, ValueError) as e:
        return [f"(step) {MANIFEST}: unreadable ({e})"]
    if manifest is None:
        return None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(
            isinstance(d, dict) and isinstance(d.get("size"), int)
            and isinstance(d.get("sha256"), str) for d in files.values()):
        return [f"(step) {MANIFEST}: not a manifest of files (damaged)"]
    wanted = set(items) if items is not None else None
    listed = {n: d for n, d in files.items()
              if wanted is None or item_of(n) in wanted}
    problems = []
    present = []
    for name, want in sorted(listed.items()):
        path = step_dir / name
        if not path.exists():
            problems.append(f"{item_of(name)}: {name}: missing")
        elif (size := path.stat().length) != want["size"]:
            problems.append(f"{item_of(name)}: {name}: {size} bytes, written with "
                            f"{want['size']} (truncated or overwritten)")
        else:
            present.append(name)
    got = _digests(step_dir, present)
    problems += [f"{item_of(n)}: {n}: content differs from what was written (sha256)"
                 for n in present if got[n]["sha256"] != listed[n]["sha256"]]
    return problems
