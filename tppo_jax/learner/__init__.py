"""The T-PPO learner as a library: arrays in, state and stats out; no run dir, no I/O.

    from tppo_jax.learner import Learner, LearnerConfig, RowPlan, TrainBatch, TrainState

    learner = Learner(policy_def, value_def, LearnerConfig.from_config(cfg))
    state, stats = learner.step(state, batch, rows)

Files: ``batch.py`` (typed records), ``estimators.py`` (advantage estimators, a registry,
and the targets), ``losses.py``, ``plan.py`` (row groups), ``state.py`` (``TrainState`` and its
optimizers), ``learner.py`` (``Learner``).
"""

from tppo_jax.learner.batch import PolicyRows, Targets, TokenRows, TrainBatch, ValueRows
from tppo_jax.learner.estimators import (
    ESTIMATORS,
    Window,
    compute_targets,
    register_estimator,
    resolve_estimator,
)
from tppo_jax.learner.learner import Learner, RowPlan, StepStats, batch_spec, placed
from tppo_jax.learner.losses import LearnerConfig
from tppo_jax.learner.state import (
    TrainState,
    commit_to_mesh,
    make_optimizer,
    policy_optimizer,
    value_optimizer,
)

__all__ = ["ESTIMATORS", "Learner", "LearnerConfig", "PolicyRows", "RowPlan", "StepStats",
           "Targets", "TokenRows", "TrainBatch", "TrainState", "ValueRows", "Window",
           "batch_spec", "commit_to_mesh", "compute_targets", "make_optimizer", "placed",
           "policy_optimizer", "register_estimator", "resolve_estimator", "value_optimizer"]
