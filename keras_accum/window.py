"""Where a window starts and ends, for an int `steps` or a schedule.

A window is `steps` micro-batches per replica; with a schedule
(`keras_accum.PiecewiseSteps`, `AdaptiveSteps`) its size is read when the
window starts and holds until it ends (the size and the end micro-step are
optimizer variables, so a checkpoint may fall inside a window).

Others can follow the windows: `on_window_end(callback)` runs `callback` in
the `apply` call that ends each window (what
`keras_accum.layers.BatchNormalization` updates its moving statistics with).
"""

import inspect
import weakref

from keras import ops

from keras_accum import _backend
from keras_accum.schedules import StepsSchedule


class _Followers:
    """The callbacks of one optimizer's `on_window_end`, in the order they
    were registered, each held weakly (a plain holder: nothing Keras or
    TensorFlow tracks or saves)."""

    def __init__(self):
        self.refs = []


class WindowMixin:
    """Window bookkeeping of `keras_accum.base.AccumulationOptimizer`: where
    a window starts and ends, for an int `steps` or a schedule."""

    def _build_window(self):
        """With a schedule: the current window's size and end micro-step,
        fixed when the window starts (checkpointed), and its own state."""
        if not isinstance(self.steps, StepsSchedule):
            return
        counter = dict(dtype=_backend.INT, aggregation="only_first_replica")
        self._window_size = self.add_variable((), name="window_steps", **counter)
        self._window_end = self.add_variable((), name="window_end", **counter)
        self.steps.build(self)

    @property
    def window_steps(self):
        """Micro-batches per replica of the current window (`steps`, or with
        a schedule the value it gave when the window started, a variable)."""
        if isinstance(self.steps, StepsSchedule):
            return self._window_size
        return self.steps

    def _start_window(self):
        """Cross-replica: True at a window's first micro-batch. A schedule is
        read there, and its value holds until the window ends."""
        step = ops.convert_to_tensor(self._micro_step)
        if not isinstance(self.steps, StepsSchedule):
            return step % self.steps == 0
        end = ops.convert_to_tensor(self._window_end)
        start = step >= end
        size = ops.where(start, self.steps(step), ops.convert_to_tensor(self._window_size))
        self._window_size.assign(size)
        self._window_end.assign(ops.where(start, step + size, end))
        return start

    def on_window_end(self, callback):
        """Runs `callback(keep)` in every `apply` call that ends a window,
        after the update, in cross-replica context (a cross-replica
        reduction there is the window's one communication), so traced into
        the training step that calls `apply`: register before `apply` is
        traced (e.g. in the forward pass of the same step).

        `keep` is None when the callback runs only at a window's end (a
        `tf.cond` branch, or every micro-batch ends a window); under XLA on
        one replica the callback runs on every micro-step and `keep` is a
        boolean tensor: its writes must hold only where `keep` does (a
        select). A bound method is held weakly (it goes with its object);
        registering the same callback again does nothing. Callbacks run in
        the order they were registered.
        """
        if getattr(self, "_followers", None) is None:
            self._followers = _Followers()
        callbacks = self._followers.refs
        if any(ref() == callback for ref in callbacks):
            return
        if inspect.ismethod(callback):
            callbacks.append(weakref.WeakMethod(callback))
        else:
            callbacks.append(lambda: callback)

    def _window_end_callbacks(self):
        """The live callbacks of `on_window_end`, in order."""
        followers = getattr(self, "_followers", None)
        callbacks = (ref() for ref in (followers.refs if followers else []))
        return [c for c in callbacks if c is not None]

    def _window_done(self, micro_step):
        """True when `micro_step` micro-batches complete the current window."""
        if not isinstance(self.steps, StepsSchedule):
            return micro_step % self.steps == 0
        return ops.equal(micro_step, self._window_end)
