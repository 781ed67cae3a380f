"""The custom training loop (library part: needs only TensorFlow and Keras).

* `step.Trainer`: one compiled window (or micro-batch) step, evaluation and
  checkpoints for one model: the *trainer*.
* `controller.train`: epochs, checkpoints, logs, evaluation and resume
  around a `Trainer`: the *controller*.
* `distribute`: the strategy of this process, the chief, data sharding,
  `WorkerLostError`.
* `multiworker`: launch N local workers on 127.0.0.1
  (`python -m keras_accum.training.multiworker`).
"""

from keras_accum.training.controller import train
from keras_accum.training.distribute import (
    WorkerLostError,
    is_chief,
    strategy_from_environment,
)
from keras_accum.training.step import LAST_BATCH_POLICIES, Trainer, peek_batch_size

__all__ = [
    "LAST_BATCH_POLICIES",
    "Trainer",
    "WorkerLostError",
    "is_chief",
    "peek_batch_size",
    "strategy_from_environment",
    "train",
]
