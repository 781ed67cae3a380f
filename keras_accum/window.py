"""Where a window starts and ends, for an int `steps` or a schedule.

A window is `steps` micro-batches per replica; with a schedule
(`keras_accum.PiecewiseSteps`, `AdaptiveSteps`) its size is read when the
window starts and holds until it ends (the size and the end micro-step are
optimizer variables, so a checkpoint may fall inside a window).
"""

import tensorflow as tf

from keras_accum.schedules import StepsSchedule


class WindowMixin:
    """Window bookkeeping of `keras_accum.base.AccumulationOptimizer`: where
    a window starts and ends, for an int `steps` or a schedule."""

    def _build_window(self):
        """With a schedule: the current window's size and end micro-step,
        fixed when the window starts (checkpointed), and its own state."""
        if not isinstance(self.steps, StepsSchedule):
            return
        counter = dict(dtype="int64", aggregation="only_first_replica")
        self._window_size = self.add_variable((), name="window_steps", **counter)
        self._window_end = self.add_variable((), name="window_end", **counter)
        self.steps.build(self)

    @property
    def window_steps(self):
        """Micro-batches per replica of the current window: `steps`, or with
        a schedule the value it gave when the window started (a variable)."""
        if isinstance(self.steps, StepsSchedule):
            return self._window_size
        return self.steps

    def _start_window(self):
        """Cross-replica: True at a window's first micro-batch. A schedule is
        read there, and its value holds until the window ends."""
        step = tf.convert_to_tensor(self._micro_step)
        if not isinstance(self.steps, StepsSchedule):
            return tf.equal(step % self.steps, 0)
        start = step >= self._window_end
        size = tf.where(start, self.steps(step), self._window_size)
        self._window_size.assign(size)
        self._window_end.assign(tf.where(start, step + size, self._window_end))
        return start

    def _window_done(self, micro_step):
        """True when `micro_step` micro-batches complete the current window."""
        if not isinstance(self.steps, StepsSchedule):
            return tf.equal(micro_step % self.steps, 0)
        return tf.equal(micro_step, self._window_end)
