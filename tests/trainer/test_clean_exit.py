"""A pytest run that imports the JetStream server ends without a `--- Logging error ---`.

JetStream's orchestrator adds a root handler on the ``sys.stdout`` of import time (under
pytest: the capture stream, closed at the end) and sets the root logger to DEBUG; jax's
exit-time clean-up then logged a debug line into the closed stream. The compat shim undoes
both at import.
"""

import subprocess
import sys

import pytest

TEST = '''
import jax.numpy as jnp


def test_import_server():
    import tppo_jax.rollout.server  # noqa: F401
    assert float(jnp.ones(2).sum()) == 2.0
'''


def test_importing_the_server_leaves_root_logging_alone():
    code = ("import logging; logging.getLogger().setLevel(logging.INFO); "
            "import tppo_jax.rollout.server; r = logging.getLogger(); "
            "assert r.level == logging.INFO and not r.handlers, (r.level, r.handlers)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.slow  # ~11 s in one process on 2 shared cores
def test_pytest_run_exits_without_a_logging_error(tmp_path):
    (tmp_path / "test_child.py").write_text(TEST)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(tmp_path / "test_child.py")], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Logging error" not in r.stdout + r.stderr
    assert "I/O operation on closed file" not in r.stdout + r.stderr
