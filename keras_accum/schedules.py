"""Batch-size schedules: the number of micro-batches per window, over time.

`steps` of the three optimizers takes an integer or a `StepsSchedule`:
`PiecewiseSteps` (fixed switches) or `AdaptiveSteps` (from the gradient
noise scale, `keras_accum.adaptive_steps`). The optimizer asks it once per
window, when the window starts, for that window's micro-batches per replica
(kappa = that x replicas under a `tf.distribute` strategy); a window in
progress keeps its size. The value is a tensor: no retracing when it
changes. See docs/guides/schedules.md.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import Any

from keras import ops, saving

from keras_accum import _backend, _compat
from keras_accum.validation import check_choice, check_int, is_integer


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


# `PiecewiseSteps` units, and the argument giving each unit's amount per micro-step.
UNITS = ("micro_steps", "examples", "tokens")
_PER_MICRO_STEP = {"examples": "micro_batch_size", "tokens": "tokens_per_micro_batch"}


@saving.register_keras_serializable(package="keras_accum")
class PiecewiseSteps(StepsSchedule):
    """Window sizes that switch at fixed points of the run.

    The window that starts at micro-step s (the optimizer's `micro_step`)
    has `values[i]` micro-batches per replica, i the number of `boundaries`
    <= s. With `unit="examples"` ("tokens") the boundaries count examples
    (tokens) over all replicas: micro-step s has consumed s x
    `micro_batch_size` (s x `tokens_per_micro_batch`), and boundary b
    switches at the first micro-step whose count reaches it; two boundaries
    that round to one micro-step are refused. Under `model.fit` a `batch_size`
    other than `micro_batch_size` is refused (`check_batch_size`). With
    `ramp` > 0 a switch from a to b goes through every integer between
    them, equally spaced from the boundary (a + 1 there) to boundary +
    `ramp` (b there). `micro_step_boundaries` lists every switch in
    micro-steps. See docs/guides/schedules.md.

    Example:
        kappa = 1 for 2000 micro-steps, then 4, then 16 from micro-step 8000:

        >>> import keras_accum
        >>> steps = keras_accum.PiecewiseSteps([2000, 8000], [1, 4, 16])
        >>> optimizer = keras_accum.InvariantAdam(1e-3, steps=steps, scaling_rule="power")
        >>> steps.max_steps
        16

        The same, in examples, for micro-batches of 32 examples:

        >>> steps = keras_accum.PiecewiseSteps(
        ...     [64_000, 256_000], [1, 4, 16], unit="examples", micro_batch_size=32
        ... )
        >>> steps.micro_step_boundaries
        [2000, 8000]

        1 -> 4 at micro-step 512 through 2 (from 512) and 3 (from 576):

        >>> steps = keras_accum.PiecewiseSteps([512], [1, 4], ramp=128)
        >>> steps.micro_step_boundaries
        [512, 576, 640]

    Args:
        boundaries: strictly increasing integers >= 1, in `unit`.
        values: integers >= 1, one more than `boundaries`.
        unit: what `boundaries` count: "micro_steps" (default), "examples"
            or "tokens", over all replicas.
        micro_batch_size: with `unit="examples"` only, the examples one
            micro-step consumes over all replicas (>= 1; `fit`'s `batch_size`).
        tokens_per_micro_batch: with `unit="tokens"` only, the tokens one
            micro-step consumes over all replicas (>= 1; fixed).
        ramp: integer >= 0, in `unit`: the length of each switch's ramp
            (0, the default: none); it must end before the next boundary.
    """

    def __init__(
        self,
        boundaries: Sequence[int],
        values: Sequence[int],
        unit: str = "micro_steps",
        micro_batch_size: int | None = None,
        tokens_per_micro_batch: int | None = None,
        ramp: int = 0,
    ):
        self.unit = check_choice("unit", unit, UNITS)
        sizes = {
            "micro_batch_size": micro_batch_size,
            "tokens_per_micro_batch": tokens_per_micro_batch,
        }
        needed = _PER_MICRO_STEP.get(self.unit)
        for name, size in sizes.items():
            if name != needed and size is not None:
                wanted = next(u for u, n in _PER_MICRO_STEP.items() if n == name)
                raise ValueError(
                    f"`{name}` is only used with unit={wanted!r}; here unit={self.unit!r}. "
                    f"Received: {name}={size!r}"
                )
        if needed is not None and (
            isinstance(sizes[needed], bool) or not is_integer(sizes[needed]) or sizes[needed] < 1
        ):
            raise ValueError(
                f"`{needed}` must be an integer >= 1 with unit={self.unit!r} ({self.unit} per "
                f"micro-step over all replicas). Received: {needed}={sizes[needed]!r}"
            )
        self.micro_batch_size = None if micro_batch_size is None else int(micro_batch_size)
        self.tokens_per_micro_batch = (
            None if tokens_per_micro_batch is None else int(tokens_per_micro_batch)
        )
        per_micro_step = int(sizes[needed]) if needed else 1
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
        if isinstance(ramp, bool) or not is_integer(ramp) or ramp < 0:
            raise ValueError(f"`ramp` must be an integer >= 0. Received: ramp={ramp!r}")
        self.ramp = int(ramp)
        ends = [b + self.ramp for b in self.boundaries]
        if any(end >= b for end, b in zip(ends, self.boundaries[1:])):
            raise ValueError(
                f"`ramp` must end each switch before the next boundary ({self.unit}). "
                f"Received: ramp={ramp!r}, boundaries={boundaries!r}"
            )
        # Every switch through the integers between, in `unit`: (boundary, value) pairs.
        switches = [b for i, b in enumerate(self.boundaries) for b in self._ramp(i)]
        # The first micro-step s with s x per_micro_step >= b: ceil(b / per).
        self.micro_step_boundaries = [-(-b // per_micro_step) for b, _ in switches]
        self._values = [self.values[0]] + [v for _, v in switches]
        steps = self.micro_step_boundaries
        for i, (a, b) in enumerate(zip(steps, steps[1:])):
            if a == b:
                raise ValueError(
                    f"`boundaries` {switches[i][0]} and {switches[i + 1][0]} ({self.unit}"
                    f"{', with the ramp' if self.ramp else ''}) both switch at micro-step {a}"
                    f"{f' ({needed}={per_micro_step})' if needed else ''}, so a value would "
                    f"never be used. Received: boundaries={boundaries!r}, ramp={ramp!r}"
                )
        self.min_steps, self.max_steps = min(self.values), max(self.values)

    def _ramp(self, i):
        """[(boundary in `unit`, value)] of switch i through the integers
        between its values (one switch without a ramp or between neighbours)."""
        start, end, at = self.values[i], self.values[i + 1], self.boundaries[i]
        n = abs(end - start)
        if not self.ramp or n <= 1:
            return [(at, end)]
        sign = 1 if end > start else -1
        # value start + j x sign from at + (j - 1) x ramp / (n - 1), j = 1..n
        return [(at + (j - 1) * self.ramp // (n - 1), start + j * sign) for j in range(1, n + 1)]

    def check_batch_size(self, batch_size: int | None) -> None:
        """Refuses a `batch_size` (over all replicas) other than the one the
        boundaries were converted with (tokens: a whole number per example);
        None warns that nothing is checked."""
        needed = _PER_MICRO_STEP.get(self.unit)
        if needed is None:
            return
        size = getattr(self, needed)
        if batch_size is None:
            warnings.warn(
                f"PiecewiseSteps(unit={self.unit!r}) places its boundaries with {needed}="
                f"{size} per micro-step, and this `fit`'s data does not tell its batch size: "
                "it is not checked. Pass `batch_size` to `fit`, or batch the dataset with "
                "drop_remainder=True.",
                stacklevel=3,
            )
            return
        if self.unit == "examples" and batch_size != size:
            raise ValueError(
                "`micro_batch_size` of PiecewiseSteps(unit='examples') must be the `batch_size` "
                f"that `fit` trains: its boundaries are placed for micro-batches of {size} "
                f"examples, and with {batch_size} its switches would land at {batch_size}/{size} "
                f"times the examples written. Received: micro_batch_size={size}, "
                f"batch_size={batch_size}"
            )
        if self.unit == "tokens" and size % batch_size:
            raise ValueError(
                "`tokens_per_micro_batch` of PiecewiseSteps(unit='tokens') must be the sequence "
                f"length x the `batch_size` that `fit` trains: {size} tokens are no whole "
                f"number per example in batches of {batch_size}. "
                f"Received: tokens_per_micro_batch={size}, batch_size={batch_size}"
            )

    def __call__(self, micro_step):
        step = ops.cast(micro_step, _backend.INT)
        values = ops.convert_to_tensor(self._values, _backend.INT)
        if not self.micro_step_boundaries:
            return values[0]
        # i = number of boundaries <= s
        boundaries = ops.convert_to_tensor(self.micro_step_boundaries, _backend.INT)
        index = ops.sum(ops.cast(ops.less_equal(boundaries, step), _backend.INT))
        return ops.take(values, index)

    def _unit_arguments(self):
        """`unit` and its size, or nothing for micro-steps (as older configs)."""
        needed = _PER_MICRO_STEP.get(self.unit)
        if needed is None:
            return {}
        return {"unit": self.unit, needed: getattr(self, needed)}

    def _extra_arguments(self):
        """`unit` and its size, and `ramp` where not 0."""
        return {**self._unit_arguments(), **({"ramp": self.ramp} if self.ramp else {})}

    def get_config(self):
        config = {"boundaries": list(self.boundaries), "values": list(self.values)}
        return {**config, **self._extra_arguments()}

    def __repr__(self):
        extra = "".join(f", {k}={v!r}" for k, v in self._extra_arguments().items())
        return f"PiecewiseSteps(boundaries={self.boundaries}, values={self.values}{extra})"


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


# The schedules checked by each running `fit` (its epoch iterator), once each.
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_trained_size(steps: Any) -> None:
    """Under `model.fit`, `check_batch_size` of a schedule (or its warmup) in
    examples or tokens, once per `fit`; `apply` calls it before it writes
    anything. Outside `fit` nothing is checked."""
    for schedule in (steps, getattr(steps, "warmup", None)):
        if isinstance(schedule, PiecewiseSteps) and schedule.unit != "micro_steps":
            context = _compat.fit_context()
            if context is None:
                return
            iterator = context[1].get("epoch_iterator")
            if any(x is schedule for x in _CHECKED.get(iterator, ())):
                continue  # this `fit` was checked (PyTorch calls `apply` each step)
            try:
                schedule.check_batch_size(_compat.fit_batch_size(context))
            except ValueError:
                _compat.release_fit(context)
                raise
            _CHECKED.setdefault(iterator, []).append(schedule)


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
