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
* `AdaptiveSteps(min_steps, max_steps, micro_batch_size, ...)`: grows the
  window with a smoothed gradient noise scale, kappa ~ B_simple / micro-batch
  size (McCandlish et al. 2018), never decreasing, optionally after a
  `PiecewiseSteps` warmup (`keras_accum.adaptive_steps`).

The value is a tensor computed from variables, so a traced training step is
not retraced when the size changes.

`InvariantAdam(scaling_rule=...)` rescales its hyperparameters per window
(`keras_accum.scaling`); see its docstring.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from keras import ops, saving

from keras_accum import _backend
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

    def __call__(self, micro_step: Any) -> Any:
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
        kappa = 1 for 2000 micro-steps, then 4, then 16 from micro-step 8000:

        >>> import keras_accum
        >>> steps = keras_accum.PiecewiseSteps([2000, 8000], [1, 4, 16])
        >>> optimizer = keras_accum.InvariantAdam(1e-3, steps=steps, scaling_rule="power")
        >>> steps.max_steps
        16

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
        step = ops.cast(micro_step, _backend.INT)
        values = ops.convert_to_tensor(self.values, _backend.INT)
        if not self.boundaries:
            return values[0]
        # i = number of boundaries <= s
        boundaries = ops.convert_to_tensor(self.boundaries, _backend.INT)
        index = ops.sum(ops.cast(ops.less_equal(boundaries, step), _backend.INT))
        return ops.take(values, index)

    def get_config(self):
        return {"boundaries": list(self.boundaries), "values": list(self.values)}

    def __repr__(self):
        return f"PiecewiseSteps(boundaries={self.boundaries}, values={self.values})"


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


def __getattr__(name: str) -> Any:
    """`keras_accum.schedules.AdaptiveSteps`, its first home, still works.
    It lives in `keras_accum.adaptive_steps`, which builds on the classes
    above: looked up on use, so that neither module imports the other while
    it loads."""
    if name == "AdaptiveSteps":
        from keras_accum.adaptive_steps import AdaptiveSteps

        return AdaptiveSteps
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
