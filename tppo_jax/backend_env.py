"""JAX on a machine with no accelerator: CPU only, without libtpu's start-up noise.

With libtpu installed (``install.sh`` installs it, for ahead-of-time TPU compiles), JAX
tries the TPU backend on every start; on a machine with no TPU, libtpu prints five lines
(``E0000 ... INVALID_ARGUMENT: unexpected worker hostname ...``) before JAX falls back to
the CPU. ``cpu_only_where_nothing_else`` sets ``jax_platforms=cpu`` when nothing but the
CPU can run here: ``JAX_PLATFORMS`` unset, no TPU chip on the PCI bus, no visible NVIDIA
GPU and no JAX plugin (CUDA, ROCm) installed. Compiling for a TPU topology from here
(``tppo plan --compile``) does not use the TPU backend and still works.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from typing import Any


def _hardware_utils() -> Any:
    """JAX's ``hardware_utils`` (the PCI scan JAX itself uses to find TPU chips), loaded
    from its file: it needs only the standard library, and importing ``jax`` takes
    seconds that ``tppo config`` should not spend."""
    spec = importlib.util.find_spec("jax")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("jax is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "_src", "hardware_utils.py")
    mod_spec = importlib.util.spec_from_file_location("_tppo_jax_hardware_utils", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


def nothing_but_cpu() -> bool:
    """Whether this machine can run JAX on its CPU alone (see the module doc)."""
    if os.environ.get("JAX_PLATFORMS") or os.environ.get("JAX_FORCE_TPU_INIT"):
        return False
    try:
        hw = _hardware_utils()
        if hw.num_available_tpu_chips_and_device_id()[0] or hw.has_visible_nvidia_gpu():
            return False
    except Exception:  # noqa: BLE001 -- a JAX without these helpers: leave JAX to decide
        return False
    if importlib.util.find_spec("jax_plugins") is not None:
        return False
    return not list(importlib.metadata.entry_points(group="jax_plugins"))


def cpu_only_where_nothing_else() -> bool:
    """Makes JAX use the CPU alone when ``nothing_but_cpu``: ``JAX_PLATFORMS=cpu`` before
    JAX is imported (no import here), ``jax_platforms`` after, until a backend starts (a
    no-op then). Returns whether it did."""
    jax = sys.modules.get("jax")
    if jax is not None:
        from jax._src import xla_bridge

        if jax.config.jax_platforms or xla_bridge.backends_are_initialized():
            return False
    if not nothing_but_cpu():
        return False
    if jax is None:
        os.environ["JAX_PLATFORMS"] = "cpu"
    else:
        jax.config.update("jax_platforms", "cpu")
    return True
