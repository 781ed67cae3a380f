"""`AdaptiveSteps`: the window size from the smoothed gradient noise scale.

A batch-size schedule (`keras_accum.schedules`), also `keras_accum.AdaptiveSteps`.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any, NamedTuple

import numpy as np
from keras import initializers, ops, saving

from keras_accum import _backend, diagnostics
from keras_accum.schedules import PiecewiseSteps, StepsSchedule
from keras_accum.validation import check_float, check_int

# The logger of the class's first home, so that a logging setup keeps working.
_LOGGER = logging.getLogger("keras_accum.schedules")


class Decision(NamedTuple):
    """One eager `AdaptiveSteps.observe` call, as kept in `decisions`."""

    micro_step: int  # the optimizer's micro_step at the call
    b_simple: float  # the estimate as given (nan and inf included)
    smoothed: float  # the bias-corrected average after it; nan before any
    observations: int  # finite estimates folded in so far
    steps: int  # the size of a window starting at micro_step
    reason: str  # "warmup", "settling" (too few estimates) or "decided"


@saving.register_keras_serializable(package="keras_accum")
class AdaptiveSteps(StepsSchedule):
    """Window size following the smoothed gradient noise scale, never decreasing.

    The critical batch size is about B_simple = ``tr(Sigma) / |G|^2``
    (McCandlish et al. 2018). `observe(b_simple)` (e.g. from
    `keras_accum.diagnostics.GradientNoiseScale`) folds each estimate b_n
    into a bias-corrected moving average, with s = `smoothing`::

        a_n = s * a_{n-1} + (1 - s) * clip(b_n, 0, max_steps * micro_batch_size)
        B_n = a_n / (1 - s ** n)

    (nan is skipped and not counted; +inf enters as the clip's top), and
    once n >= `min_observations`::

        decided = max(decided, clip(ceil(B_n / micro_batch_size),
                                    min_steps, max_steps))

    With a `warmup`, windows starting before its last boundary h (in
    micro-steps) have the warmup's size, and from h on
    max(warmup.values[-1], decided); estimates observed during the warmup
    feed the average. The state is optimizer variables, saved with it. Call
    `observe` after the optimizer is built (under JAX, outside the jitted
    step: from a `fit` callback, after reading `self.model`). Each eager
    call appends a `Decision` to `decisions` and logs it. See
    docs/guides/schedules.md ("Reference").

    Example:
        kappa = 1, 2, 4 for 4000 micro-steps, then from the noise scale
        (every so often: ``steps.observe(noise_scale.b_simple)``)::

            steps = keras_accum.AdaptiveSteps(
                1, 16, micro_batch_size=32,
                warmup=keras_accum.PiecewiseSteps([1000, 4000], [1, 2, 4]))
            optimizer = keras_accum.InvariantAdam(1e-3, steps=steps, scaling_rule="power")

    Args:
        min_steps: the lower bound of the decided size and, without a
            warmup, the first window's size (>= 1). The `min_steps`
            attribute is the smaller of this and the warmup's smallest value.
        max_steps: the upper bound (>= min_steps), also of the warmup.
        micro_batch_size: items per micro-step over all replicas, the unit
            of B_simple.
        smoothing: s in [0, 1), the weight of the past; 0 keeps only the
            last estimate. Default 0.9: about the last 10 estimates.
        min_observations: finite estimates before the size may change
            (>= 1). Default 4.
        warmup: None, or a `PiecewiseSteps` with at least one boundary and
            values <= max_steps (in examples: with this `micro_batch_size`).
        powers_of_two: round each decided size up to a power of two (then
            min_steps and max_steps must be powers of two), so that windows
            end where any multiple of max_steps micro-steps ends.
        noise_estimate: the norm `squared_norm` and `noise_tracker` measure
            in: a `keras_accum.diagnostics` `NOISE_ESTIMATES` name
            ("b_simple", the default, or "adam_preconditioned") or a factory
            `fn(optimizer) -> fn(grads)`.
    """

    def __init__(
        self,
        min_steps: int = 1,
        max_steps: int = 8,
        micro_batch_size: int = 32,
        smoothing: float = 0.9,
        min_observations: int = 4,
        warmup: PiecewiseSteps | None = None,
        powers_of_two: bool = False,
        noise_estimate: Any = "b_simple",
    ):
        self._floor = check_int("min_steps", min_steps)
        self.max_steps = check_int("max_steps", max_steps)
        if self.max_steps < self._floor:
            raise ValueError(
                "`max_steps` must be >= `min_steps`. Received: "
                f"min_steps={min_steps!r}, max_steps={max_steps!r}"
            )
        self.micro_batch_size = check_int("micro_batch_size", micro_batch_size)
        self.smoothing = check_float(
            "smoothing", smoothing, minimum=0.0, maximum=1.0, open_maximum=True
        )
        self.min_observations = check_int("min_observations", min_observations)
        self.warmup = _check_warmup(warmup, self.max_steps, self.micro_batch_size)
        if not isinstance(powers_of_two, bool):
            raise ValueError(
                f"`powers_of_two` must be True or False. Received: powers_of_two={powers_of_two!r}"
            )
        if powers_of_two and any(n & (n - 1) for n in (self._floor, self.max_steps)):
            raise ValueError(
                "With powers_of_two=True, `min_steps` and `max_steps` must be powers of two. "
                f"Received: min_steps={min_steps!r}, max_steps={max_steps!r}"
            )
        self.powers_of_two = bool(powers_of_two)
        if isinstance(noise_estimate, str) and noise_estimate not in diagnostics.NOISE_ESTIMATES:
            raise ValueError(
                f"`noise_estimate` must be one of {sorted(diagnostics.NOISE_ESTIMATES)} or a "
                f"callable. Received: noise_estimate={noise_estimate!r}"
            )
        if not isinstance(noise_estimate, str) and not callable(noise_estimate):
            raise ValueError(
                f"`noise_estimate` must be one of {sorted(diagnostics.NOISE_ESTIMATES)} or a "
                f"callable. Received: noise_estimate={noise_estimate!r}"
            )
        self.noise_estimate = noise_estimate
        warmup_values = self.warmup.values if self.warmup else []
        self.min_steps = min([self._floor, *warmup_values])
        self.decisions: list[Decision] = []
        self._steps = None
        self._optimizer = None
        self._float = "float64"

    def build(self, optimizer: Any) -> None:
        if self._optimizer is not None and self._optimizer is not optimizer:
            raise ValueError(
                "This AdaptiveSteps already drives another optimizer; create "
                f"one per optimizer. Received: optimizer={optimizer!r}"
            )
        self._optimizer = optimizer

        def add(name, dtype, value):
            return optimizer.add_variable(
                (),
                initializer=initializers.Constant(value),
                dtype=dtype,
                aggregation="only_first_replica",
                name=name,
            )

        after_warmup = self.warmup.values[-1] if self.warmup else 0
        self._steps = add("adaptive_steps", "int64", max(self._floor, after_warmup))
        # float64, no rounding of large estimates (float32 under JAX without x64).
        self._float = _backend.wide_float()
        self._ema = add("adaptive_ema", self._float, 0.0)
        self._count = add("adaptive_observations", "int64", 0)

    @property
    def steps(self) -> Any:
        """The size of the windows starting from the handover on (a variable)."""
        self._check_built()
        return self._steps

    @property
    def observations(self) -> Any:
        """Finite estimates folded in so far (a variable)."""
        self._check_built()
        return self._count

    @property
    def smoothed(self) -> Any:
        """The bias-corrected average B_n (float64; nan before any estimate)."""
        self._check_built()
        return self._average(ops.convert_to_tensor(self._ema), ops.convert_to_tensor(self._count))

    def __call__(self, micro_step: Any) -> Any:
        self._check_built()
        steps = ops.convert_to_tensor(self._steps)
        if self.warmup is None:
            return steps
        step = ops.cast(micro_step, steps.dtype)
        return ops.where(step < self.warmup.micro_step_boundaries[-1], self.warmup(step), steps)

    def squared_norm(self):
        """The squared-norm function of `noise_estimate` for the optimizer
        this schedule drives (built first)."""
        self._check_built()
        return diagnostics.noise_estimate_norm(self.noise_estimate, self._optimizer)

    def noise_tracker(self, ema: float = 0.9) -> diagnostics.GradientNoiseScale:
        """A `GradientNoiseScale(ema)` measuring in `noise_estimate`'s norm:
        feed it probe windows, then `observe(tracker.b_simple)`."""
        return diagnostics.GradientNoiseScale(ema, squared_norm=self.squared_norm())

    def propose(self, b_simple: Any) -> Any:
        """The value `observe(b_simple)` would give `steps` (no state change)."""
        self._check_built()
        return self._fold(b_simple)[3]

    def observe(self, b_simple: Any) -> Any:
        """Folds in one noise-scale estimate; returns the size of a window
        starting at the optimizer's current micro-step."""
        self._check_built()
        ema, count, smoothed, steps = self._fold(b_simple)
        self._ema.assign(ema)
        self._count.assign(count)
        self._steps.assign(steps)
        micro_step = self._optimizer.micro_step
        size = self(micro_step)
        if _backend.executing_eagerly() and _backend.is_concrete(size):
            self._record(
                int(_number(micro_step)),
                float(_number(b_simple)),
                float(_number(smoothed)),
                int(_number(count)),
                int(_number(size)),
            )
        return size

    def _fold(self, b_simple):
        """(a_n, n, B_n, decided) after `b_simple`, as tensors."""
        wide = self._constant  # traced, a Python float is float32
        b = ops.cast(b_simple, self._float)
        finite = ops.logical_not(ops.isnan(b))
        largest = wide(self.max_steps * self.micro_batch_size)
        clipped = ops.clip(ops.where(finite, b, wide(0.0)), wide(0.0), largest)
        ema = ops.convert_to_tensor(self._ema)
        ema = ops.where(
            finite, wide(self.smoothing) * ema + wide(1.0 - self.smoothing) * clipped, ema
        )
        count = ops.convert_to_tensor(self._count)
        count = count + ops.cast(finite, count.dtype)
        smoothed = self._average(ema, count)
        target = ops.ceil(smoothed / self.micro_batch_size)
        if self.powers_of_two:  # 2 ** ceil(log2(target)), exact for powers of two
            exponent = ops.ceil(ops.log(ops.maximum(target, wide(1.0))) / math.log(2) - 1e-9)
            target = ops.power(wide(2.0), exponent)
        target = ops.clip(target, wide(self._floor), wide(self.max_steps))
        # Unsettled (this includes no estimate yet, B_n nan): no change.
        target = ops.where(count >= self.min_observations, target, wide(0.0))
        steps = ops.convert_to_tensor(self._steps)
        # Cast back: Keras's PyTorch `maximum` gives int32 for two int64.
        decided = ops.cast(ops.maximum(steps, ops.cast(target, steps.dtype)), steps.dtype)
        return ema, count, smoothed, decided

    def _constant(self, value):
        return ops.convert_to_tensor(value, self._float)

    def _average(self, ema, count):
        """B_n = a_n / (1 - s ** n), nan for n = 0."""
        wide = self._constant
        some = count > 0
        correction = 1.0 - ops.power(wide(self.smoothing), ops.cast(count, self._float))
        correction = ops.where(some, correction, wide(1.0))
        return ops.where(some, ema / correction, wide(math.nan))

    def _record(self, micro_step, b_simple, smoothed, count, size):
        if self.warmup is not None and micro_step < self.warmup.micro_step_boundaries[-1]:
            reason = "warmup"
        elif count < self.min_observations:
            reason = "settling"
        else:
            reason = "decided"
        decision = Decision(micro_step, b_simple, smoothed, count, size, reason)
        self.decisions.append(decision)
        _LOGGER.info(
            "AdaptiveSteps: micro_step %d, B_simple %.4g, smoothed %.4g over %d -> steps %d (%s)",
            *decision,
        )

    def _check_built(self):
        if self._steps is None:
            raise ValueError(
                "AdaptiveSteps is not built: pass it as `steps` to an "
                "optimizer and build the optimizer first."
            )

    def get_config(self) -> dict:
        warmup = None if self.warmup is None else saving.serialize_keras_object(self.warmup)
        return {
            "min_steps": self._floor,
            "max_steps": self.max_steps,
            "micro_batch_size": self.micro_batch_size,
            "smoothing": self.smoothing,
            "min_observations": self.min_observations,
            "warmup": warmup,
            "powers_of_two": self.powers_of_two,
            "noise_estimate": (
                self.noise_estimate
                if isinstance(self.noise_estimate, str)
                else saving.serialize_keras_object(self.noise_estimate)
            ),
        }

    @classmethod
    def from_config(cls, config: dict) -> AdaptiveSteps:
        config = dict(config)
        if "smoothing" not in config and "min_observations" not in config:
            # Saved by keras_accum 0.2.0: load the rule it ran, and say so.
            config.update(OLD_RULE)
            warnings.warn(
                "AdaptiveSteps saved by keras_accum 0.2.0 (no `smoothing`, no "
                "`min_observations` in its config): loaded with the rule it ran, "
                f"{_kwargs(OLD_RULE)}; the defaults are now {_kwargs(NEW_DEFAULTS)}. "
                "Pass them to a new AdaptiveSteps to change rule.",
                stacklevel=2,
            )
        if isinstance(config.get("warmup"), dict):
            config["warmup"] = saving.deserialize_keras_object(config["warmup"])
        if isinstance(config.get("noise_estimate"), dict):
            config["noise_estimate"] = saving.deserialize_keras_object(config["noise_estimate"])
        return cls(**config)

    def __repr__(self):
        default = self.noise_estimate == "b_simple"
        estimate = "" if default else f", noise_estimate={self.noise_estimate!r}"
        return (
            f"AdaptiveSteps(min_steps={self._floor}, max_steps={self.max_steps}, "
            f"micro_batch_size={self.micro_batch_size}, smoothing={self.smoothing}, "
            f"min_observations={self.min_observations}, warmup={self.warmup!r}, "
            f"powers_of_two={self.powers_of_two}{estimate})"
        )


# The rule of 0.2.0 (each estimate taken as it came) and today's defaults.
OLD_RULE = {"smoothing": 0.0, "min_observations": 1}
NEW_DEFAULTS = {"smoothing": 0.9, "min_observations": 4}


def _number(value):
    """A concrete scalar as a Python number (a numpy one not rounded to float32)."""
    if isinstance(value, (int, float, np.number, np.ndarray)):
        return np.asarray(value).item()
    return np.asarray(ops.convert_to_numpy(value)).item()


def _kwargs(values):
    return ", ".join(f"{key}={value}" for key, value in values.items())


def _check_warmup(warmup, max_steps, micro_batch_size):
    """`warmup` if None or a PiecewiseSteps that can hand over, else ValueError."""
    if warmup is None:
        return None
    if not isinstance(warmup, PiecewiseSteps) or not warmup.boundaries:
        raise ValueError(
            "`warmup` must be None or a PiecewiseSteps with at least one boundary "
            f"(its last is the handover). Received: warmup={warmup!r}"
        )
    if warmup.max_steps > max_steps:
        raise ValueError(
            f"`warmup` values must be <= max_steps={max_steps}. Received: warmup={warmup!r}"
        )
    if warmup.micro_batch_size not in (None, micro_batch_size):
        raise ValueError(
            f"`warmup` in examples must have the schedule's micro_batch_size={micro_batch_size}. "
            f"Received: warmup={warmup!r}"
        )
    return warmup
