"""Callbacks of the config-driven runs (`experiment.train_and_evaluate`):
honest split names in the logs, a CSV logger without invented columns, and
the optimizer's counters per epoch."""

import keras
import numpy as np


class SplitLabels(keras.callbacks.Callback):
    """Names the per-epoch evaluation after the split it ran on.

    Keras calls it `val_*` whatever it is; when the watched split is the
    test split, the logs (and metrics.csv) say `test_*` instead.
    """

    def __init__(self, split):
        super().__init__()
        self.split = split

    def on_epoch_end(self, epoch, logs=None):
        if self.split == "test":
            for key in [k for k in logs if k.startswith("val_")]:
                logs["test_" + key[4:]] = logs.pop(key)


class CSVLogger(keras.callbacks.CSVLogger):
    """Keras's CSVLogger without the empty `val_*` columns it invents when
    the first epoch's logs hold none (here the test split is `test_*`)."""

    def on_epoch_end(self, epoch, logs=None):
        if self.keys is None:
            self.keys = sorted(logs or {})
        super().on_epoch_end(epoch, logs)


class AccumulationLogger(keras.callbacks.Callback):
    """Adds learning rate, update count, skipped micro-batches and skipped
    updates (dropped windows) to logs."""

    def on_epoch_end(self, epoch, logs=None):
        optimizer = self.model.optimizer
        while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            optimizer = optimizer.inner_optimizer
        logs["learning_rate"] = float(np.asarray(optimizer.learning_rate))
        logs["updates"] = int(np.asarray(optimizer.iterations))
        logs["skipped_micro_batches"] = int(np.asarray(optimizer.skipped_micro_batches))
        logs["skipped_updates"] = int(np.asarray(optimizer.skipped_updates))
