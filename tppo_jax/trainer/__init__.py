"""A training run around the learner: ``Trainer`` builds it from a ``Config`` (run dir,
models, data, rollout scheduler, ``Learner``), restores, evaluates and fits; ``train`` is
what ``tppo train`` and ``tppo_jax.fit`` run.

    from tppo_jax.trainer import Trainer

    with Trainer(cfg, "runs/r") as trainer:
        summary = trainer.fit()

Files: ``trainer.py`` (``Trainer``, ``train``), ``models.py`` (what a run starts from),
``params.py`` (what trains and what checkpoints hold), ``collect.py`` (a rollout window,
graded, as the learner's input), ``value_pretrain.py``, ``warmstart.py``. The run dir's
files (checkpoints, metrics, the claim) are ``tppo_jax.runs``.
"""

from typing import Any

# Loaded on first use: importing one of the package's modules (``warmstart``, ``params``)
# does not pull in the whole trainer.
__all__ = ["TrainHooks", "Trainer", "TrainingDiverged", "Update", "nan_updates_from", "train"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from tppo_jax.trainer import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'tppo_jax.trainer' has no attribute {name!r}")
