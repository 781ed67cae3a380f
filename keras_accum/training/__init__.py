"""The custom training loop (TensorFlow): `Trainer` runs one compiled window,
`Controller` / `train` the epochs, checkpoints, logs and resume around it.
See docs/guides/custom_loop.md.
"""

from keras_accum import _backend

# tf.distribute, tf.function, tf.train.Checkpoint: one-line error elsewhere.
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
