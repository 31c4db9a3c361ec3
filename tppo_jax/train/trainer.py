"""The import path of earlier versions: the loop lives in ``train/loop.py``, its set-up
(models, data, grader) in ``train/setup.py``. Nothing in the package imports this module."""

from tppo_jax.train.loop import TrainHooks, TrainingDiverged, nan_updates_from, train
from tppo_jax.train.setup import Models, load_data, load_models, make_grader, model_folder

__all__ = ["Models", "TrainHooks", "TrainingDiverged", "load_data", "load_models",
           "make_grader", "model_folder", "nan_updates_from", "train"]
