"""A training run around the learner: ``Trainer`` builds it from a ``Config`` (run dir,
models, data, rollout scheduler, ``Learner``), restores, evaluates and fits; ``train`` is
what ``tppo train`` and ``tppo_jax.fit`` run.

    from tppo_jax.trainer import Trainer

    with Trainer(cfg, "runs/r") as trainer:
        summary = trainer.fit()

Files: ``trainer.py`` (``Trainer``, ``train``), ``collect.py`` (a rollout window, graded, as
the learner's input, and the one sequence into ``Learner.step``), ``step_log.py`` (a step's
metrics row), ``hooks.py`` (fault injection, the eval cadence, SIGTERM),
``value_pretrain.py`` (the critic pretrained from explicit parts). What a run starts from
(models, warm-start, LoRA, what checkpoints hold) is ``tppo_jax.weights``; the run dir's files
(checkpoints, metrics, the claim) are ``tppo_jax.runs``.
"""

from typing import Any

# Loaded on first use: importing one of the package's modules (``collect``, ``hooks``) does
# not pull in the whole trainer.
__all__ = ["TrainHooks", "Trainer", "TrainingDiverged", "Update", "nan_updates_from", "train"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from tppo_jax.trainer import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'tppo_jax.trainer' has no attribute {name!r}")
