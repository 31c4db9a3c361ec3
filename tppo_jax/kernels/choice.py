"""Which kernels a program runs: chosen for the platform the program is FOR, never for the
machine that traces it.

A program is traced *on a mesh* (``traced_on(fn, mesh)``: the learner's steps on the training
mesh, the rollout engine's prefill and decode window on its program mesh). That mesh is the one
way the kernels learn two things: the platform (``mesh.devices.flat[0].platform``; the TPU
compiler's abstract devices of ``tppo_jax.platform`` say "tpu" as real TPU chips do) and how
to run a Mosaic kernel per shard (``shard_map`` over it: the partitioner cannot split one).
So ``tppo plan --compile`` (abstract TPU devices, any host) and a run on a TPU slice resolve
the same kernels through the same functions here (``choose_attention``, ``choose_paged``,
``kernels_for``). A program traced on no mesh runs on jax's default device: its platform.
``kernel_calls`` reads the Mosaic kernels (and their analytic FLOPs) off a lowered program.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax

from tppo_jax.parallel.mesh import MESH_AXES

# On CPU "auto" attention keeps the dense path up to this many score entries per (row, head).
AUTO_DENSE_MAX = 1024 * 1024
ATTENTION_IMPLS = ("auto", "dense", "chunked", "splash", "cudnn")
PAGED_IMPLS = ("auto", "reference", "pallas", "pallas_tpu", "pallas_gpu")

_PROGRAM_MESH: contextvars.ContextVar[Any] = contextvars.ContextVar("program_mesh",
                                                                    default=None)


@contextlib.contextmanager
def program_mesh(mesh: Any) -> Iterator[None]:
    """The kernels traced inside belong to a program that runs on ``mesh`` (a
    ``jax.sharding.Mesh``, abstract TPU devices allowed). Unlike ``jax.set_mesh`` it changes
    nothing else about tracing (no other op sees it)."""
    token = _PROGRAM_MESH.set(mesh)
    try:
        yield
    finally:
        _PROGRAM_MESH.reset(token)


def traced_on(fn: Callable, mesh: Any) -> Callable:
    """``fn`` whose body runs under ``program_mesh(mesh)``: jitted, it traces with the kernels
    chosen for ``mesh``'s platform and run per shard on it (``fn`` itself when ``mesh`` is
    None)."""
    if mesh is None:
        return fn

    @functools.wraps(fn)
    def on_mesh(*args: Any, **kwargs: Any) -> Any:
        with program_mesh(mesh):
            return fn(*args, **kwargs)

    return on_mesh


def current_mesh() -> Any:
    """The mesh of the program being traced (``traced_on``), or None."""
    return _PROGRAM_MESH.get()


def platform_of(mesh: Any) -> str:
    """``tpu`` / ``gpu`` / ``cpu``: the platform of ``mesh``'s devices (None: jax's default
    device, where a program on no mesh runs)."""
    if mesh is None:
        return jax.devices()[0].platform
    p = mesh.devices.flat[0].platform
    return "gpu" if p in ("cuda", "rocm") else p


def current_platform() -> str:
    """The platform of the program being traced (``platform_of(current_mesh())``)."""
    return platform_of(current_mesh())


def is_project_mesh(mesh: Any) -> bool:
    """A mesh with the project's (data, fsdp, tensor) axes: kernels run per shard on it."""
    return mesh is not None and set(MESH_AXES) <= set(mesh.axis_names)


def splash_runs_on(mesh: Any) -> bool:
    """Splash (a Mosaic kernel) can run in a program on ``mesh``: one device, or per shard in
    ``shard_map`` over a project mesh; on any other multi-device mesh it could not be
    partitioned."""
    return mesh is not None and (mesh.size == 1 or is_project_mesh(mesh))


def choose_attention(impl: str, platform: str, mesh: Any, q_len: int, k_len: int,
                     cudnn_applies: bool = False) -> str:
    """The training attention ``impl`` stands for in a program for ``platform`` on ``mesh``:
    splash on TPU where it can run (``splash_runs_on``; on no mesh jit may still spread the
    program over devices: chunked), cuDNN on GPU where it applies, on CPU
    dense while ``q_len * k_len <= AUTO_DENSE_MAX``, chunked otherwise."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention impl {impl!r}; expected one of "
                         f"{', '.join(ATTENTION_IMPLS)}")
    if impl == "splash" and mesh is not None and not splash_runs_on(mesh):
        return "chunked"  # asked for, but this mesh could not partition it
    if impl != "auto":
        return impl
    if platform == "tpu":
        return "splash" if splash_runs_on(mesh) else "chunked"
    if platform == "gpu" and cudnn_applies:
        return "cudnn"
    if platform == "cpu" and q_len * k_len <= AUTO_DENSE_MAX:
        return "dense"
    return "chunked"


def choose_paged(impl: str, platform: str, interpret: bool = False) -> str:
    """The decode paged-attention kernel ``impl`` stands for on ``platform``: "auto" is the
    Pallas kernel on TPU / GPU and the jnp reference elsewhere; "pallas" is the platform's
    Pallas kernel (on CPU only with ``interpret``: the TPU kernel in the Pallas
    interpreter)."""
    if impl not in PAGED_IMPLS:
        raise ValueError(f"paged attention impl {impl!r}; expected one of "
                         f"{', '.join(PAGED_IMPLS)}")
    if impl == "auto":
        impl = "pallas" if platform in ("tpu", "gpu") else "reference"
    if impl == "pallas":
        if platform == "tpu" or (platform == "cpu" and interpret):
            return "pallas_tpu"
        if platform == "gpu":
            return "pallas_gpu"
        raise ValueError(f"no Pallas paged-attention kernel for platform {platform!r}; "
                         "use impl='reference' or interpret=True")
    return impl


def kernels_for(platform: str, mesh: Any, attention: str = "auto", paged: str = "auto"
                ) -> dict[str, str]:
    """``{"attention", "paged_attention"}``: what a long prefill / training step and the
    decode window of a program for ``platform`` on ``mesh`` run (bf16, no query offset)."""
    return {"attention": choose_attention(attention, platform, mesh, 1 << 12, 1 << 12,
                                          cudnn_applies=True),
            "paged_attention": choose_paged(paged, platform)}


_CALL = re.compile(r'kernel_name = "([^"]+)"')
_SIG = re.compile(r" : \(([^()]*)\) -> ")
_TENSOR = re.compile(r"tensor<([0-9x]+)x(bf16|f16|f32)>")
# Matmuls of [rows, S] x [S, D] each kernel runs per query row: forward QK and PV; the
# backward's dq recomputes QK, then dO V and dS K; its dkv QK, dO V, P^T dO and dS^T Q.
_MATMULS = {"fwd": 2, "dq": 3, "dkv": 4}


def kernel_calls(text: str) -> list[dict[str, Any]]:
    """The Mosaic kernels (``tpu_custom_call``) in a lowered program's text: per call its
    name and analytic FLOPs, which XLA's cost analysis cannot see (it counts a custom call
    as ~0). From the operand shapes (per shard: a ``shard_map`` body has local shapes): q
    ``[..., D]`` (rows = all but D) and the keys; splash ``S`` = the key length, causal (half
    the ``T x S`` blocks); paged attention ``S`` = pages per slot x page size, every slot at
    its full length (an upper bound). Like ``cost_analysis``, a loop body counts once."""
    calls = []
    for line in text.splitlines():
        if "tpu_custom_call" not in line:
            continue
        m, sig = _CALL.search(line), _SIG.search(line[line.rfind(" : ("):])
        name = m.group(1) if m else "tpu_custom_call"
        floats = [tuple(int(x) for x in t.split("x")) for t, _ in
                  _TENSOR.findall(sig.group(1))] if sig else []
        flops = 0.0
        if len(floats) >= 2:
            q, k = floats[0], floats[1]
            rows, d = math.prod(q[:-1]), q[-1]
            if "paged" in name:
                ints = [tuple(int(x) for x in t.split("x")) for t in
                        re.findall(r"tensor<([0-9x]+)xi32>", sig.group(1))]
                table = ints[1] if len(ints) > 1 else (0,)
                s_len = (math.prod(table) // max(1, q[0])) * k[-2]
                flops = 2.0 * 2 * rows * s_len * d
            else:
                kind = next((u for u in ("dkv", "dq") if f"_{u}" in name), "fwd")
                flops = 2.0 * _MATMULS[kind] * rows * k[-2] * d / 2
        calls.append({"name": name, "flops": flops})
    return calls
