"""google-jetstream 0.2.2 imports through our shim, lean (no seqio/TensorFlow), loopback-bound,
and only where serving needs it: training, the held-out eval and the rollout core never
import it (nor apply the shim's global patches)."""

import json
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


def _fresh_imports(code: str) -> list[str]:
    """The JetStream / seqio / shim modules loaded after ``code`` runs in a fresh process."""
    code += ("\nimport json, sys\nprint(json.dumps(sorted(m for m in sys.modules if m.split('.')[0]"
             " in ('jetstream', 'seqio') or m == 'tppo_jax.compat.jetstream')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_training_and_eval_never_import_jetstream():
    """The decode core is independent of the serving adapter: the training loop, the held-out
    eval, the scheduler, the CLI's command table (every group registered, as ``tppo`` does)
    and the benchmarks ``tppo bench`` runs load no JetStream and apply no shim."""
    assert _fresh_imports(
        "import tppo_jax.trainer.trainer, tppo_jax.eval.heldout, tppo_jax.rollout.scheduler\n"
        "import tppo_jax.rollout.engine, tppo_jax.cli.train, tppo_jax.cli as cli\n"
        "cli._register_optional(); cli.build_parser()\n"
        "import importlib\nfrom tppo_jax.cli.bench import BENCHMARKS\n"
        "for m in BENCHMARKS.values(): importlib.import_module('tppo_jax.benchmarks.' + m)\n"
    ) == []


def test_the_serving_adapter_brings_jetstream():
    loaded = _fresh_imports("import tppo_jax.rollout.jetstream_engine")
    assert "tppo_jax.compat.jetstream" in loaded and "jetstream.engine.engine_api" in loaded
