"""The package's import layering (docs/architecture.md): a module imports only from the units
listed below its own in ``LAYERS``, at the top of the file or lazily inside a function, type-only
imports included; no two modules import each other, even through others; nothing outside
``cli/`` imports ``cli/``. Read from the source with ``ast``: nothing is imported."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tppo_jax"

# Bottom to top. A unit is a subpackage (``data`` = tppo_jax/data/) or a top-level module
# (``config`` = tppo_jax/config.py); ``tppo_jax`` is the package's own ``__init__`` (its lazy
# ``fit`` / ``load_config`` come from ``api``). Each may import only the units before it.
LAYERS: tuple[str, ...] = (
    # leaves: import nothing of the package
    "version", "backend_env", "compat", "buckets", "configs", "warmstarts",
    "programs",  # the Program record of the program tables (jax only)
    # the config: its sections, their validation, plugin names (reward.fn, estimators), the loader
    "config_schema", "config_checks", "plugins", "config",
    "algo",  # pure jax
    "parallel", "kernels", "models",  # mesh and axis rules; attention kernels; architectures
    "data", "rewards",  # rows, readers, prompts; grading (reads data's answers)
    "learner", "rollout", "eval",  # the training step; the decode engine; evals through it
    "runs",  # a run's files: run dir, checkpoints, metrics
    "weights",  # where a policy and its critic come from
    "launch", "platform", "plan", "compile",  # TPU launch, topologies, memory plan, AOT compile
    "trainer",  # the loop
    "serve", "benchmarks", "api", "tppo_jax",
    "cli",  # the command line: imports anything, imported by nothing
)
RANK = {unit: i for i, unit in enumerate(LAYERS)}

# Allowed exceptions to the order (none now): an entry here is a debt with a reason, and one
# whose import is gone fails below.
KNOWN_UPWARD: frozenset[tuple[str, str]] = frozenset()
KNOWN_CYCLES: frozenset[frozenset[str]] = frozenset()


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _resolve(name: str) -> str:
    """The module an imported name lives in: the longest prefix that is one of ours."""
    while name not in MODULES and "." in name:
        name = name.rpartition(".")[0]
    return name


def imports(module: str) -> Iterator[tuple[str, int]]:
    """``(imported module, line)`` of every import of the package in ``module``: at the top,
    inside functions, under ``TYPE_CHECKING``, and ``importlib.import_module("tppo_jax...")``."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, *([base] if base else [])])
            names = [f"{base}.{a.name}" for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(
                node.func, "id", None)) == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names = [node.args[0].value]
        for name in names:
            if name == "tppo_jax" or name.startswith("tppo_jax."):
                yield _resolve(name), node.lineno


def _edges() -> dict[str, set[str]]:
    return {m: {t for t, _ in imports(m) if t != m} for m in MODULES}


def test_every_unit_has_a_layer():
    missing = sorted({unit(m) for m in MODULES} - set(RANK))
    assert not missing, f"place {missing} in LAYERS (tests/test_layers.py, docs/architecture.md)"


def test_no_module_imports_from_a_unit_above_it():
    bad, seen = [], set()
    for module in MODULES:
        here = unit(module)
        for target, line in imports(module):
            there = unit(target)
            if target == "tppo_jax" and module != "tppo_jax":
                continue  # the package itself: loaded before any of its modules
            if there == here or RANK.get(there, -1) < RANK.get(here, -1):
                continue
            if (module, there) in KNOWN_UPWARD:
                seen.add((module, there))
                continue
            bad.append(f"{MODULES[module].relative_to(PACKAGE.parent)}:{line} "
                       f"({here}) imports {target} ({there}, above it)")
    assert not bad, "\n".join(bad)
    stale = sorted(KNOWN_UPWARD - seen)
    assert not stale, f"no longer imported: delete {stale} from KNOWN_UPWARD"


def _cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[frozenset[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(frozenset(comp))
    return out


def test_no_import_cycles():
    edges = {m: {t for t in ts if t != "tppo_jax"} for m, ts in _edges().items()}
    cycles = _cycles(edges)
    new = [sorted(c) for c in cycles if c not in KNOWN_CYCLES]
    assert not new, f"import cycles: {new}"
    stale = [sorted(c) for c in KNOWN_CYCLES if c not in cycles]
    assert not stale, f"no longer a cycle: delete {stale} from KNOWN_CYCLES"


def test_only_cli_imports_cli():
    bad = [f"{m}:{line}" for m in MODULES if unit(m) != "cli"
           for t, line in imports(m) if unit(t) == "cli" and (m, "cli") not in KNOWN_UPWARD]
    assert not bad, f"cli/ imported outside cli/: {bad}"


@pytest.mark.parametrize("source,target", [
    ("from tppo_jax.learner.estimators import ESTIMATORS", "tppo_jax.learner.estimators"),
    ("from .learner import estimators", "tppo_jax.learner.estimators"),
    ("import tppo_jax.cli.runs as r", "tppo_jax.cli.runs"),
    ("importlib.import_module('tppo_jax.rewards.grader')", "tppo_jax.rewards.grader"),
])
def test_the_reader_sees_every_form_of_import(tmp_path, monkeypatch, source, target):
    """Each form, inside a function of a config module, is found (and would be refused)."""
    fake = "tppo_jax.config_checks"
    path = tmp_path / "config_checks.py"
    path.write_text(f"import importlib\ndef f():\n    {source}\n")
    monkeypatch.setitem(MODULES, fake, path)
    found = [t for t, _ in imports(fake)]
    assert target in found and RANK[unit(target)] > RANK[unit(fake)]


def test_loading_a_config_imports_no_jax():
    """Validation asks no registry above the config: a config with every plugin-like key set
    loads (and is checked) without jax, flax, optax, sympy or the packages above it."""
    import subprocess
    import sys

    code = ("import sys; from tppo_jax.config import load_config; "
            "load_config('default', ['data.fields={question: q}', 'reward.fn=m:f', "
            "'algo.advantage_baseline=rloo']); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('jax', 'flax', 'optax', 'sympy', 'math_verify') or m.startswith("
            "('tppo_jax.learner', 'tppo_jax.data', 'tppo_jax.rewards', 'tppo_jax.models'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=PACKAGE.parent, check=True)
    assert out.stdout.strip() == "[]", out.stdout
