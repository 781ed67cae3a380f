"""The harness's resumable `model.fit` runs (`experiment.train_and_evaluate`):
`EpochCheckpoint` (atomic `epoch_NNN.keras` with callbacks' state),
`FlushingTensorBoard`, and `find_resume`, `load_resume`, `restore_state`,
`rewind_logs` to resume. The training stream must be a deterministic
function of the epoch. See docs/guides/custom_loop.md.
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

    Put it after the callbacks that log the epoch (CSVLogger, TensorBoard).

    Args:
        directory: the checkpoint folder.
        stateful: callbacks whose `get_state()` (JSON) is saved under their
            class name.
        sync: files (e.g. metrics.csv) fsynced before each checkpoint.
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
    """Where a fit run resumes: the file, its epochs, its saved state (or None)."""

    path: str
    epoch: int
    state: dict | None


def find_resume(directory):
    """The newest intact `epoch_NNN.keras` in `directory` as a ResumePoint
    (not loaded), or None."""
    path = checkpoints.newest_keras(directory)
    if path is None:
        return None
    epoch = int(re.fullmatch(r"epoch_(\d+)\.keras", os.path.basename(path)).group(1))
    return ResumePoint(path, epoch, None)


def load_resume(point):
    """Returns the model of `point` (call in the strategy's scope); sets `point.state`."""
    model, point.state = checkpoints.load_keras(point.path)
    return model


def restore_state(point, stateful):
    """`set_state` of each callback in `stateful` from `point` (after `load_resume`)."""
    for callback in stateful:
        saved = (point.state or {}).get(type(callback).__name__)
        if saved is not None:
            callback.set_state(saved)


def rewind_logs(metrics_csv, tensorboard_dirs, epoch):
    """Keeps the first `epoch` epochs' rows of metrics.csv and values of each
    TensorBoard tag (one per epoch)."""

    def before(row):
        try:
            return int(row["epoch"]) < epoch
        except (KeyError, ValueError):
            return False

    run_logs.rewind_csv(str(metrics_csv), before)
    for logdir in tensorboard_dirs:
        if os.path.isdir(logdir):
            run_logs.rewind_events(logdir, lambda tag, step, seen: seen < epoch)
