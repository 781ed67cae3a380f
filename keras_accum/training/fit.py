"""Resumable `model.fit` runs: atomic epoch checkpoints and logs that rewind
with them.

A run folder written with these callbacks can be killed at any moment and
resumed to the rows and weights of an uninterrupted run:

* `EpochCheckpoint` saves `epoch_NNN.keras` atomically at each epoch end
  (see `checkpoints.save_keras`), with the state of the callbacks that have
  one (`get_state` / `set_state`, e.g. `NoiseScaleCallback`) and each
  replica's part of the optimizer's replica-local variables.
* `FlushingTensorBoard` is Keras's TensorBoard callback flushed at each
  epoch end, so the events of a checkpointed epoch are on disk.
* `find_resume` finds the newest intact checkpoint, `load_resume` loads
  it, `restore_state` gives the callbacks their state back and
  `rewind_logs` cuts metrics.csv and the TensorBoard events back to the
  epochs it holds.

The data position is the epoch count: the training stream must be a
deterministic function of it (e.g. a seeded stream that skips
`epoch * steps_per_epoch` batches).
"""

import dataclasses
import os
import re

import keras

from keras_accum import _compat
from keras_accum.training import checkpoints
from keras_accum.training import logs as run_logs

PATTERN = "epoch_{epoch:03d}.keras"


class EpochCheckpoint(keras.callbacks.Callback):
    """Saves `directory/epoch_NNN.keras` (NNN = epochs done) atomically.

    Args:
        directory: the checkpoint folder.
        stateful: callbacks whose `get_state()` (JSON-serialisable) is saved
            with the model under their class name.
        sync: files (e.g. metrics.csv) fsynced before each checkpoint, so
            the rows it vouches for are durable.
    Put it after the callbacks that log the epoch (CSVLogger, TensorBoard).
    """

    def __init__(self, directory, stateful=(), sync=()):
        super().__init__()
        self.directory = str(directory)
        self.stateful = list(stateful)
        self.sync = [str(path) for path in sync]

    def on_epoch_end(self, epoch, logs=None):
        os.makedirs(self.directory, exist_ok=True)
        for path in self.sync:
            if os.path.exists(path):
                checkpoints.fsync_file(path)
        state = {"epoch": epoch + 1}
        for callback in self.stateful:
            state[type(callback).__name__] = callback.get_state()
        path = os.path.join(self.directory, PATTERN.format(epoch=epoch + 1))
        checkpoints.save_keras(self.model, path, state)


class FlushingTensorBoard(keras.callbacks.TensorBoard):
    """`keras.callbacks.TensorBoard` that flushes its writers at epoch end."""

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        for writer in _compat.tensorboard_writers(self):
            if writer is not None:
                writer.flush()


@dataclasses.dataclass
class ResumePoint:
    """Where a fit run resumes: the checkpoint file, the epochs it holds and
    the state saved with it (None for a plain Keras file)."""

    path: str
    epoch: int
    state: dict | None


def find_resume(directory):
    """The newest intact `epoch_NNN.keras` in `directory` as a ResumePoint
    (without loading the model), or None; unusable newer files are named in
    a warning, and `CheckpointError` names them when none is intact."""
    path = checkpoints.newest_keras(directory)
    if path is None:
        return None
    epoch = int(re.fullmatch(r"epoch_(\d+)\.keras", os.path.basename(path)).group(1))
    return ResumePoint(path, epoch, None)


def load_resume(point):
    """Loads the model of `point` (call inside the strategy's scope) and
    keeps the state saved with it in `point.state`; returns the model."""
    model, point.state = checkpoints.load_keras(point.path)
    return model


def restore_state(point, stateful):
    """Gives each callback in `stateful` (with `set_state`) the state saved
    under its class name in `point` (after `load_resume`)."""
    for callback in stateful:
        saved = (point.state or {}).get(type(callback).__name__)
        if saved is not None:
            callback.set_state(saved)


def rewind_logs(metrics_csv, tensorboard_dirs, epoch):
    """Keeps the rows of the first `epoch` epochs in metrics.csv (column
    `epoch` counts from 0) and the first `epoch` values of every tag in the
    TensorBoard folders (each tag is written once per epoch)."""

    def before(row):
        try:
            return int(row["epoch"]) < epoch
        except (KeyError, ValueError):
            return False

    run_logs.rewind_csv(str(metrics_csv), before)
    for logdir in tensorboard_dirs:
        if os.path.isdir(logdir):
            run_logs.rewind_events(logdir, lambda tag, step, seen: seen < epoch)
