"""Where a policy and its critic come from, for every caller (train, eval, export, serve,
generate, the compile path, the benchmarks). Below ``trainer/`` (which it never imports) and
``cli/``; above ``learner/``, ``models/``, ``runs/`` and ``data/``.

- ``start.py``: a run's models as it starts (``load_models``: tiny warm-start, HF folder, Hub
  id or GGUF file; the critic; LoRA adapters; placement on the mesh), the decode layout's
  shardings, the KL reference's copy.
- ``warmstart.py``: the tiny model's supervised warm-start (cached; the shipped ones in
  ``tppo_jax/warmstarts/``; ``python -m tppo_jax.weights.warmstart`` regenerates them).
- ``params.py``: what trains (all, or LoRA adapters + value head), what checkpoints hold,
  float32 masters and the compute-dtype copy, the policy's moving average.
- ``restore.py``: ``policy_from_run``, a run's policy from its run directory (the one
  function eval, export, serve and the benchmarks read it with).
- ``named.py``: the policy a user names (run directory, HF folder or Hub id).
- ``abstract.py``: the same models shape-only (``abstract_models`` for the compile path,
  ``abstract_policy`` for a checkpoint's restore template).

Each module is imported on its own: importing one does not pull in the others' dependencies.
"""
