"""One process of the two-process test (``test_multihost.py``): ``tppo train`` through the
CLI with the multi-host flags, then a digest of the final checkpoint's params.

The digest is taken after restoring the checkpoint as global arrays on this process's
mesh and gathering the full values, so equal digests mean the hosts agree on every
parameter of the policy and value models. With ``TPPO_TEST_DIGEST_ALL=1`` every kept
checkpoint gets a digest line (oldest first, the final one last).
"""

import hashlib
import json
import os
import sys
from pathlib import Path

from tppo_jax import cli


def params_digest(ckpt_dir: Path, step: int | None = None) -> dict:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils

    mngr = ocp.CheckpointManager(ckpt_dir)
    step = mngr.latest_step() if step is None else step
    out = {"step": step}
    for item in ("policy", "value"):
        tree = mngr.restore(step, args=ocp.args.Composite(
            **{item: ocp.args.StandardRestore()}))[item]
        leaves = jax.tree_util.tree_leaves_with_path(tree)
        h = hashlib.sha256()
        finite = True
        for path, x in leaves:
            full = np.asarray(multihost_utils.process_allgather(x, tiled=True))
            finite &= bool(np.isfinite(full).all())
            h.update(jax.tree_util.keystr(path).encode())
            h.update(full.astype(np.float32).tobytes())
        out[item] = h.hexdigest()
        out[f"{item}_finite"] = finite
    # The rollout KV cache as saved: its leaves and, paged, its page bookkeeping.
    kv = mngr.restore(step, args=ocp.args.Composite(kv_cache=ocp.args.StandardRestore()))
    flat = {jax.tree_util.keystr(p): np.asarray(multihost_utils.process_allgather(x, tiled=True))
            for p, x in jax.tree_util.tree_leaves_with_path(kv["kv_cache"])}
    out["kv_leaves"] = sorted(flat)
    pages = {k.rsplit("'", 2)[-2]: v for k, v in flat.items() if "'pages'" in k}
    if pages:
        out["kv_pages"] = {"table": pages["page_table"].tolist(),
                           "refcount": pages["refcount"].tolist()}
    mngr.close()
    return out


if __name__ == "__main__":
    argv = sys.argv[1:]
    rc = cli.main(argv)
    if rc != 0:
        sys.exit(rc)
    ckpts = Path(argv[argv.index("--run-dir") + 1]) / "checkpoints"
    steps = [None]
    if os.environ.get("TPPO_TEST_DIGEST_ALL") == "1":
        steps = sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
    for step in steps:
        print("DIGEST " + json.dumps(params_digest(ckpts, step)), flush=True)
