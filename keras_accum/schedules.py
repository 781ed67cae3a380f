"""Batch-size schedules: the number of micro-batches per window, over time.

`steps` of the three optimizers takes an integer or one of these objects.
A schedule is asked once per window, when the window starts: given the
optimizer's `micro_step` s (micro-batches per replica consumed so far) it
returns the size of the window that starts at s. A window in progress always
finishes with the size it started with. Under a `tf.distribute` strategy a
window holds kappa = steps x replicas micro-batches, as with a constant
`steps`.

* `PiecewiseSteps(boundaries, values)`: fixed switches, e.g. 1 micro-batch
  per update for the first 2000 micro-steps, then 4, then 16 after 8000.
* `AdaptiveSteps(min_steps, max_steps, micro_batch_size)`: grows the window
  with the gradient noise scale, kappa ~ B_simple / micro-batch size
  (McCandlish et al. 2018), never decreasing.

The value is a tensor computed from variables, so a traced training step is
not retraced when the size changes.

`InvariantAdam(scaling_rule=...)` rescales its hyperparameters per window
(`keras_accum.scaling`); see its docstring.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import tensorflow as tf
from keras import initializers, saving

from keras_accum.validation import check_int, is_integer


class StepsSchedule:
    """Base class: micro-batches per replica of the window starting at s.

    Subclasses implement `__call__(micro_step)` (an int64 scalar tensor),
    `min_steps` and `max_steps` (Python ints bounding every value) and
    `get_config`. `build(optimizer)` creates any state the schedule needs as
    optimizer variables, so that it is checkpointed with the optimizer.
    """

    min_steps: int
    max_steps: int

    def __call__(self, micro_step: Any) -> tf.Tensor:
        raise NotImplementedError

    def build(self, optimizer: Any) -> None:
        """Creates the schedule's state on `optimizer` (none by default)."""
        return None  # a docstring-only body makes AutoGraph warn when traced

    def get_config(self) -> dict:
        raise NotImplementedError

    @classmethod
    def from_config(cls, config: dict) -> StepsSchedule:
        return cls(**config)


@saving.register_keras_serializable(package="keras_accum")
class PiecewiseSteps(StepsSchedule):
    """Window sizes that switch at fixed micro-steps.

    The window that starts at micro-step s (micro-batches per replica, the
    optimizer's `micro_step`) has `values[i]` micro-batches per replica,
    where i is the number of `boundaries` <= s.

    Example:

    ```python
    # kappa = 1 for 2000 micro-steps, then 4, then 16 from micro-step 8000.
    steps = keras_accum.PiecewiseSteps([2000, 8000], [1, 4, 16])
    optimizer = keras_accum.InvariantAdam(1e-3, steps=steps,
                                          scaling_rule="invariant")
    ```

    Args:
        boundaries: strictly increasing integers >= 1 (micro-steps).
        values: integers >= 1, one more than `boundaries`.
    """

    def __init__(self, boundaries: Sequence[int], values: Sequence[int]):
        self.boundaries = _int_list("boundaries", boundaries, 1)
        self.values = _int_list("values", values, 1)
        if not self.values:
            raise ValueError(f"`values` must not be empty. Received: values={values!r}")
        if len(self.values) != len(self.boundaries) + 1:
            raise ValueError(
                "`values` must have one more entry than `boundaries`. "
                f"Received: boundaries={boundaries!r}, values={values!r}"
            )
        if any(a >= b for a, b in zip(self.boundaries, self.boundaries[1:])):
            raise ValueError(
                f"`boundaries` must be strictly increasing. Received: boundaries={boundaries!r}"
            )
        self.min_steps, self.max_steps = min(self.values), max(self.values)

    def __call__(self, micro_step):
        step = tf.cast(micro_step, tf.int64)
        values = tf.constant(self.values, tf.int64)
        if not self.boundaries:
            return values[0]
        # i = number of boundaries <= s
        index = tf.reduce_sum(tf.cast(tf.constant(self.boundaries, tf.int64) <= step, tf.int64))
        return tf.gather(values, index)

    def get_config(self):
        return {"boundaries": list(self.boundaries), "values": list(self.values)}

    def __repr__(self):
        return f"PiecewiseSteps(boundaries={self.boundaries}, values={self.values})"


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
            logging.getLogger(__name__).info(
                "AdaptiveSteps: micro_step %d, B_simple %.4g -> steps %d", *decision
            )
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


def _int_list(name, values, minimum):
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(
            f"`{name}` must be a list of integers >= {minimum}. Received: {name}={values!r}"
        )
    if not all(is_integer(v) and v >= minimum for v in values):
        raise ValueError(
            f"`{name}` must be a list of integers >= {minimum}. Received: {name}={values!r}"
        )
    return [int(v) for v in values]


def check_steps(steps: Any) -> int | StepsSchedule:
    """`steps` as an int >= 1 or a `StepsSchedule` (a config dict of one is
    deserialized), else ValueError."""
    if isinstance(steps, dict):
        steps = saving.deserialize_keras_object(steps)
    if isinstance(steps, StepsSchedule):
        return steps
    return check_int("steps", steps)


def steps_range(steps: int | StepsSchedule) -> tuple[int, int]:
    """(smallest, largest) window size per replica that `steps` can give."""
    if isinstance(steps, StepsSchedule):
        return steps.min_steps, steps.max_steps
    return steps, steps


def serialize_steps(steps: int | StepsSchedule) -> Any:
    """`steps` as it goes into an optimizer config."""
    if isinstance(steps, StepsSchedule):
        return saving.serialize_keras_object(steps)
    return steps
