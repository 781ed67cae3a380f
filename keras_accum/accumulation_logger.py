"""`AccumulationLogger`: the accumulation's counts in Keras's logs (docs/guides/fit.md)."""

from __future__ import annotations

import keras
import numpy as np

from keras_accum import _compat, base

#: The keys `AccumulationLogger` adds to `fit`'s logs ("tokens" only under
#: `weigh_micro_batches`).
KEYS = ("updates", "examples", "tokens", "window_steps", "window_loss")


def _number(value):
    return float(keras.ops.convert_to_numpy(value))


class AccumulationLogger(keras.callbacks.Callback):
    """Puts the accumulation's counts into `model.fit`'s logs (History, `CSVLogger`).

    Keys, after each batch and at each epoch's end: `updates` (the
    optimizer's `iterations`), `examples` (trained by this logger's `fit`
    runs), `tokens` (under `weigh_micro_batches`: the items windows were
    weighed by), `window_steps` (the window size in force) and `window_loss`
    (the example-weighted mean loss of the last window that ended, applied or
    dropped; before that, of the window so far). List it before `CSVLogger`.
    With `steps_per_execution` > 1, `window_loss` mixes the windows ending
    in one call. See docs/guides/diagnostics.md.

    Example:
        >>> import numpy as np, keras, keras_accum as ka
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer=ka.InvariantAdam(steps=4), loss="mse")
        >>> history = model.fit(np.ones((32, 3)), np.zeros((32, 1)), batch_size=4,
        ...                     callbacks=[ka.AccumulationLogger()], verbose=0)
        >>> history.history["updates"], history.history["examples"]
        ([2.0], [32.0])
    """

    def __init__(self):
        super().__init__()
        self._examples = 0.0  # of the epochs before this one
        self._tokens = 0.0

    def _optimizer(self):
        optimizer = self.model.optimizer
        while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            optimizer = optimizer.inner_optimizer
        if not isinstance(optimizer, base.AccumulationOptimizer):
            raise ValueError(
                "`AccumulationLogger` logs a keras_accum optimizer's counts: compile the "
                f"model with one. Received: optimizer={type(optimizer).__name__}"
            )
        return optimizer

    def _weighed(self, optimizer):
        """The window's total weight W when `weigh_micro_batches` feeds it."""
        items = getattr(optimizer, "_fit_items", None)
        if items is None or items.weighed_model() is not self.model or not optimizer.built:
            return None
        return _number(optimizer._weight)

    def on_train_begin(self, logs=None):
        optimizer = self._optimizer()
        self._pending = optimizer.pending_micro_batches()
        self._weight = self._weighed(optimizer)
        self._seen = (0.0, 0.0)  # the loss mean's (total, count) after the last batch
        self._window = [0.0, 0.0]  # loss x examples, examples, of the window so far
        self._last_window = None

    def on_epoch_begin(self, epoch, logs=None):
        self._seen = (0.0, 0.0)  # `fit` reset its loss mean

    def on_train_batch_end(self, batch, logs=None):
        if logs is None:
            return
        optimizer = self._optimizer()
        tracker = _compat.loss_tracker(self.model)
        total, count = _number(tracker.total), _number(tracker.count)
        self._window[0] += total - self._seen[0]
        self._window[1] += count - self._seen[1]
        self._seen = (total, count)
        pending = optimizer.pending_micro_batches()
        weight = self._weighed(optimizer)
        if weight is not None:
            # W restarts at a window's first micro-batch (after a boundary).
            self._tokens += weight - (self._weight if self._pending and self._weight else 0.0)
        self._pending, self._weight = pending, weight
        if pending == 0 and self._window[1] > 0:  # a window ended with this micro-batch
            self._last_window = self._window[0] / self._window[1]
            self._window = [0.0, 0.0]
        self._log(logs, optimizer, count)

    def on_epoch_end(self, epoch, logs=None):
        optimizer = self._optimizer()
        count = _number(_compat.loss_tracker(self.model).count)
        if logs is not None:
            self._log(logs, optimizer, count)
        self._examples += count

    def _log(self, logs, optimizer, count):
        logs["updates"] = _number(optimizer.iterations)
        logs["examples"] = self._examples + count
        if self._weight is not None:
            logs["tokens"] = self._tokens
        logs["window_steps"] = _number(optimizer.window_steps)
        window = self._last_window
        if window is None and self._window[1] > 0:
            window = self._window[0] / self._window[1]
        logs["window_loss"] = np.nan if window is None else window
