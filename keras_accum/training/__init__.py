"""The custom training loop (library part: needs only TensorFlow and Keras).

* `step.Trainer`: one compiled window (or micro-batch) step, evaluation and
  checkpoints for one model: the *trainer*.
* `controller.Controller` / `controller.train`: epochs, checkpoints, logs,
  evaluation and resume around a `Trainer`: the *controller*.
* `stream`: the resumable data stream; `losses`: per-item losses, metrics.
* `checkpoints`: atomic, verified checkpoint files; `logs`: logs that
  rewind with them; `fit`: the same for `model.fit` runs.
* `distribute`: the strategy of this process, the chief, data sharding,
  `WorkerLostError`.
* `multiworker`: launch N local workers on 127.0.0.1
  (`python -m keras_accum.training.multiworker`).
"""

from keras_accum import _backend

# tf.distribute, tf.function and tf.train.Checkpoint: one line elsewhere.
_backend.require_tensorflow("The custom loop (`keras_accum.training`)")

from keras_accum.training.checkpoints import CheckpointError  # noqa: E402
from keras_accum.training.controller import Controller, train  # noqa: E402
from keras_accum.training.distribute import (  # noqa: E402
    WorkerLostError,
    is_chief,
    strategy_from_environment,
)
from keras_accum.training.trainer import LAST_BATCH_POLICIES, Trainer, peek_batch_size  # noqa: E402

__all__ = [
    "CheckpointError",
    "Controller",
    "LAST_BATCH_POLICIES",
    "Trainer",
    "WorkerLostError",
    "is_chief",
    "peek_batch_size",
    "strategy_from_environment",
    "train",
]
