"""Issue 62 L-12: every CPU run printed five lines of libtpu ``E0000 ... INVALID_ARGUMENT``
noise (libtpu installed, no TPU). ``tppo`` (``cli.main``) and ``fit`` now run JAX on the
CPU alone where nothing else can run, decided without importing JAX, and leave a set
``JAX_PLATFORMS`` alone."""

import os
import subprocess
import sys

import pytest

from tppo_jax.backend_env import nothing_but_cpu

CODE = """
import os, sys
from tppo_jax.backend_env import cpu_only_where_nothing_else
did = cpu_only_where_nothing_else()
print(did, os.environ.get("JAX_PLATFORMS"), "jax" in sys.modules)
"""


def test_jax_runs_on_the_cpu_alone_where_there_is_nothing_else(monkeypatch):
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    if not nothing_but_cpu():
        pytest.skip("this machine has an accelerator (or a JAX plugin for one)")
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.stdout.split() == ["True", "cpu", "False"], r.stderr  # set before JAX loads
    monkeypatch.setenv("JAX_PLATFORMS", "tpu,cpu")  # the user's choice stands
    assert not nothing_but_cpu()
