"""`AdaptiveSteps`: the window size from the gradient noise scale.

A batch-size schedule (`keras_accum.schedules`) that grows the window with
B_simple estimates and never shrinks. Also importable as
`keras_accum.schedules.AdaptiveSteps`.
"""

from __future__ import annotations

import logging
from typing import Any

import tensorflow as tf
from keras import initializers, saving

from keras_accum.schedules import StepsSchedule
from keras_accum.validation import check_int

# The logger of the class's first home, so that a logging setup keeps working.
_LOGGER = logging.getLogger("keras_accum.schedules")


@saving.register_keras_serializable(package="keras_accum")
class AdaptiveSteps(StepsSchedule):
    """Window size following the gradient noise scale, never decreasing.

    The critical batch size is about B_simple = tr(Sigma) / |G|^2
    (McCandlish et al. 2018): below it, a bigger batch saves updates almost
    for free. `observe(b_simple)` (a smoothed estimate, e.g.
    `keras_accum.diagnostics.GradientNoiseScale(...).b_simple`) sets

        steps = max(steps, clip(ceil(b_simple / micro_batch_size),
                                min_steps, max_steps))

    and the optimizer uses the new value from the next window on. A
    non-finite estimate: +inf (the signal is not resolved above the noise)
    counts as `max_steps`; nan (no estimate yet) changes nothing. The
    current value is an optimizer variable (`adaptive_steps`), saved with
    the optimizer; the schedule is deterministic given its inputs.

    Call `observe` after the optimizer is built. Each eager call appends
    `(micro_step, b_simple, steps)` to `decisions` and logs it (Python
    `logging`, INFO, logger `keras_accum.schedules`).

    Args:
        min_steps: the first window's size and the lower bound (>= 1).
        max_steps: the upper bound (>= min_steps).
        micro_batch_size: items per micro-step over all replicas (the
            per-replica micro-batch size x replicas), the unit of B_simple.
    """

    def __init__(self, min_steps: int = 1, max_steps: int = 8, micro_batch_size: int = 32):
        self.min_steps = check_int("min_steps", min_steps)
        self.max_steps = check_int("max_steps", max_steps)
        if self.max_steps < self.min_steps:
            raise ValueError(
                "`max_steps` must be >= `min_steps`. Received: "
                f"min_steps={min_steps!r}, max_steps={max_steps!r}"
            )
        self.micro_batch_size = check_int("micro_batch_size", micro_batch_size)
        self.decisions = []
        self._steps = None
        self._optimizer = None

    def build(self, optimizer):
        if self._optimizer is not None and self._optimizer is not optimizer:
            raise ValueError(
                "This AdaptiveSteps already drives another optimizer; create "
                f"one per optimizer. Received: optimizer={optimizer!r}"
            )
        self._optimizer = optimizer
        self._steps = optimizer.add_variable(
            (),
            initializer=initializers.Constant(self.min_steps),
            dtype="int64",
            aggregation="only_first_replica",
            name="adaptive_steps",
        )

    @property
    def steps(self):
        """The value the next window will take (a variable)."""
        self._check_built()
        return self._steps

    def __call__(self, micro_step):
        self._check_built()
        return tf.convert_to_tensor(self._steps)

    def propose(self, b_simple: Any) -> tf.Tensor:
        """The value `observe(b_simple)` would set (no state change)."""
        self._check_built()
        b = tf.cast(b_simple, tf.float64)
        as_b = lambda x: tf.constant(x, tf.float64)  # traced, a Python float is float32
        target = tf.math.ceil(b / self.micro_batch_size)
        target = tf.where(tf.math.is_inf(b) & (b > 0), as_b(self.max_steps), target)
        target = tf.clip_by_value(target, as_b(self.min_steps), as_b(self.max_steps))
        target = tf.cast(tf.where(tf.math.is_nan(b), as_b(0.0), target), tf.int64)
        # Never decreasing; nan leaves the current value.
        return tf.maximum(tf.convert_to_tensor(self._steps), target)

    def observe(self, b_simple: Any) -> tf.Tensor:
        """Feeds one noise-scale estimate; returns the new window size."""
        proposed = self.propose(b_simple)  # checks that it is built
        steps = self._steps.assign(proposed)
        if tf.executing_eagerly():
            decision = (int(self._optimizer.micro_step.numpy()), float(b_simple), int(steps))
            self.decisions.append(decision)
            _LOGGER.info("AdaptiveSteps: micro_step %d, B_simple %.4g -> steps %d", *decision)
        return steps

    def _check_built(self):
        if self._steps is None:
            raise ValueError(
                "AdaptiveSteps is not built: pass it as `steps` to an "
                "optimizer and build the optimizer first."
            )

    def get_config(self):
        return {
            "min_steps": self.min_steps,
            "max_steps": self.max_steps,
            "micro_batch_size": self.micro_batch_size,
        }

    def __repr__(self):
        return (
            f"AdaptiveSteps(min_steps={self.min_steps}, max_steps={self.max_steps}, "
            f"micro_batch_size={self.micro_batch_size})"
        )
