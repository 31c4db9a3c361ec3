"""google-jetstream 0.2.2 imports through our shim, lean (no seqio/TensorFlow), loopback-bound."""

import subprocess
import sys


def test_engine_api_and_server_lib_import():
    import tppo_jax.compat.jetstream as compat

    compat.check()
    from jetstream.core import server_lib
    from jetstream.engine import engine_api

    assert hasattr(engine_api, "Engine")
    assert server_lib._HOST == "127.0.0.1"
    import jax

    assert jax.tree_map is jax.tree.map or callable(jax.tree_map)


def test_no_tensorflow_in_a_fresh_process():
    code = ("import sys, tppo_jax.compat.jetstream as c; c.check(); "
            "import jetstream.core.orchestrator; "
            "print('tensorflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
