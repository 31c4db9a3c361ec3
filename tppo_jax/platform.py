"""TPU topologies for ahead-of-time compiles: a topology name -> the TPU compiler's abstract
devices, HBM per chip and chips per host.

``jax.experimental.topologies.get_topology_desc`` gives the devices of a slice this machine
does not have (any host, even a CPU-only one, once libtpu is installed: the extra
``pip install -e ".[tpu]"``); ``jit(f).lower(...).compile()`` on a mesh of them runs the real
TPU compiler, so a pod's programs compile from one process, multi-host slices included.

Names: the accelerator types of ``tppo launch`` (``v5litepod-8``, ``v5p-512``, ``v4-8``,
``v6e-8``) or a chip grid (``v5e:2x2``, ``v5p:2x2x1``, ``v4:2x2x1``, ``v6e:2x2``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from tppo_jax.launch import GENERATIONS, GIB, LaunchError, parse_tpu_type

TPU_EXTRA = 'pip install -e ".[tpu]"'


class TopologyError(ValueError):
    """A topology name is invalid, or the TPU compiler is missing; the message is one line."""


@dataclass(frozen=True)
class Topology:
    """A slice as the TPU compiler sees it."""

    name: str  # as given
    generation: str  # v4, v5p, v5litepod, v6e
    grid: tuple[int, ...]  # chips per dimension (2D for v5e/v6e, 3D for v4/v5p)
    hbm_bytes: int  # per chip
    chips_per_host: int

    @property
    def chips(self) -> int:
        return math.prod(self.grid)

    @property
    def hosts(self) -> int:
        return max(1, self.chips // self.chips_per_host)

    @property
    def topology_name(self) -> str:
        """``get_topology_desc``'s name: ``v5e:2x2``, ``v5p:4x4x4``."""
        prefix = {"v5litepod": "v5e", "v5p": "v5p", "v4": "v4", "v6e": "v6e"}[self.generation]
        return f"{prefix}:{'x'.join(map(str, self.grid))}"

    @property
    def host_bounds(self) -> tuple[int, int, int]:
        """Chips per host along each axis (``chips_per_host_bounds``)."""
        if len(self.grid) == 2:  # v5e/v6e hosts: up to 2x4 chips
            x = min(self.grid[0], 2 if self.chips_per_host <= 4 else 4)
            y = min(self.grid[1], self.chips_per_host // x)
            return (x, y, 1)
        return (min(self.grid[0], 2), min(self.grid[1], 2), 1)  # v4/v5p hosts: 2x2x1


_GRID_RE = re.compile(r"^(v4|v5p|v5e|v5litepod|v6e):(\d+(?:x\d+)+)$")


def _grid_for(generation: str, chips: int) -> tuple[int, ...]:
    """The chip grid of a slice of ``chips`` chips (the shapes Cloud TPU creates by default)."""
    if generation in ("v5litepod", "v6e"):
        shapes = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8),
                  128: (8, 16), 256: (16, 16)}
        return shapes[chips]
    # v4 / v5p: a cube-ish 3D grid with dims that are powers of two, x <= y <= z
    if chips < 4:
        return (chips, 1, 1)
    dims = [1, 1, 1]
    n, i = chips, 0
    while n > 1:
        dims[i % 3] *= 2
        n //= 2
        i += 1
    grid = sorted(dims)
    return tuple(d for d in grid if d > 1) + tuple(d for d in grid if d == 1)  # 2x2x1


def parse_topology(text: str) -> Topology:
    """``v5litepod-8`` / ``v5e:2x4`` / ``v5p-512`` / ``v5p:8x8x8`` -> ``Topology``; raises
    ``TopologyError`` in one line."""
    t = text.strip().lower()
    m = _GRID_RE.match(t)
    if m:
        gen = "v5litepod" if m.group(1) in ("v5e", "v5litepod") else m.group(1)
        grid = tuple(int(x) for x in m.group(2).split("x"))
        if min(grid) < 1:
            raise TopologyError(f"topology {text!r}: every grid dimension must be at least 1 "
                                f"chip, e.g. v5e:2x2, v5p:2x2x1")
        if len(grid) != (2 if gen in ("v5litepod", "v6e") else 3):
            raise TopologyError(f"topology {text!r}: {m.group(1)} grids have "
                                f"{2 if gen in ('v5litepod', 'v6e') else 3} dimensions")
        g = GENERATIONS[gen]
        per_host = g.single_host_max_chips if gen in ("v5litepod", "v6e") else 4
        return Topology(text, gen, grid, int(g.hbm_gib * GIB), per_host)
    try:
        tpu = parse_tpu_type(t)
    except LaunchError as e:
        raise TopologyError(f"{e}; or a chip grid such as v5e:2x2, v5p:2x2x1") from None
    g = GENERATIONS[tpu.generation]
    per_host = tpu.chips if tpu.hosts == 1 else tpu.chips // tpu.hosts
    return Topology(text, tpu.generation, _grid_for(tpu.generation, tpu.chips),
                    tpu.hbm_bytes, per_host if tpu.hosts > 1 else g.single_host_max_chips)


def libtpu_version() -> str | None:
    """The installed libtpu's version, or None when the TPU compiler is not installed."""
    from importlib import metadata

    for dist in ("libtpu", "libtpu-nightly"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def require_tpu_compiler() -> str:
    """libtpu's version; raises ``TopologyError`` naming the extra when it is missing."""
    v = libtpu_version()
    if v is None:
        raise TopologyError(f"the TPU compiler (libtpu) is not installed: {TPU_EXTRA} "
                            f"(or pip install \"jax[tpu]\" pinned to this jax)")
    return v


def abstract_devices(topo: Topology) -> list[Any]:
    """The slice's devices as the TPU compiler sees them (no TPU needed, one process for any
    number of hosts)."""
    require_tpu_compiler()
    import os

    # Compiling touches no chip: several compiles (a test run, another user of this
    # machine) may load libtpu at once instead of waiting on its lockfile.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        desc = topologies.get_topology_desc(
            topology_name=topo.topology_name, platform="tpu", chip_config_name="default",
            chips_per_host_bounds=topo.host_bounds, num_slices=1,
            wrap=(False,) * 3)
    except Exception as e:  # the TPU client's errors are not one class
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TopologyError(f"topology {topo.name} ({topo.topology_name}): the TPU compiler "
                            f"refused it: {first}") from None
    return list(desc.devices)
