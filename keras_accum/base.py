"""`AccumulationOptimizer`: one micro-batch per `apply`, one update per
window of `steps` calls (kappa = steps x replicas micro-batches).

`apply` checks and builds, then hands the micro-batch to the backend's
driver (`keras_accum.drivers`), which bounds windows, screens, counts and
writes; a subclass's rule fills in the hooks below. State, in creation
order (the checkpoint format): `iterations`, `WindowState`, a schedule's
state, the subclass's slots. See docs/ARCHITECTURE.md.
"""

import inspect
import weakref
from collections.abc import Sequence
from typing import Any

import keras
from keras import ops, optimizers

from keras_accum import _backend, _compat, _replicas, drivers, nonfinite, schedules, weighing
from keras_accum._saving import StateMixin
from keras_accum.last_window import LastWindowMixin, check_flush
from keras_accum.schedules import StepsSchedule
from keras_accum.validation import check_choice

NONFINITE_POLICIES = tuple(nonfinite.POLICIES)


def bounds(step, end, size, steps):
    """(start, size, end) of the window that 0-based micro-step `step` is
    in, given the previous window's `end` and `size`. `steps` (int or
    schedule) is read where a window starts. With `end` None (an int
    `steps`) size and end are None. Values in, values out."""
    if end is None:
        return step % steps == 0, None, None
    start = step >= end
    fresh = steps(step) if isinstance(steps, StepsSchedule) else steps
    size = ops.where(start, ops.cast(fresh, size.dtype), size)
    return start, size, ops.where(start, step + size, end)


class WindowState:
    """An optimizer's window bookkeeping, optimizer variables in this
    (saved) order: `micro_step`; `skipped_micro_batches` (replica-local);
    `skipped_updates`; `bad` (this window's non-finite micro-batches,
    replica-local); under a schedule `size`, `end` (fixed where the window
    starts), else None. Only the drivers write it (tests/test_structure.py).
    """

    __slots__ = ("micro_step", "skipped_micro_batches", "skipped_updates", "bad", "size", "end")

    def __init__(self, optimizer):
        counter = dict(dtype=_backend.INT, aggregation="only_first_replica")
        self.micro_step = optimizer.add_variable((), name="micro_step", **counter)
        self.skipped_micro_batches = optimizer.add_local_variable(
            (), dtype=_backend.INT, name="skipped_micro_batches"
        )
        self.skipped_updates = optimizer.add_variable((), name="skipped_updates", **counter)
        self.bad = optimizer.add_local_variable((), dtype=_backend.INT, name="window_bad")
        self.size = self.end = None
        if isinstance(optimizer.steps, StepsSchedule):
            self.size = optimizer.add_variable((), name="window_steps", **counter)
            self.end = optimizer.add_variable((), name="window_end", **counter)

    def bounds(self, steps):
        """`bounds` at the current micro-step (values)."""
        read = ops.convert_to_tensor
        if self.size is None:
            return bounds(read(self.micro_step), None, None, steps)
        return bounds(read(self.micro_step), read(self.end), read(self.size), steps)

    def done(self, micro_step, steps):
        """True when `micro_step` micro-batches complete the current window."""
        if self.end is None:
            return micro_step % steps == 0
        return ops.equal(micro_step, self.end)


class WindowMixin:
    """An optimizer's window: its size, its end, and `on_window_end`."""

    _window = None  # the `WindowState`, from `build`

    @property
    def window_steps(self):
        """Micro-batches per replica of the current window (`steps`, or the
        schedule's value where the window started, a variable)."""
        if isinstance(self.steps, StepsSchedule):
            return self._window.size
        return self.steps

    def _window_done(self, micro_step):
        """True when `micro_step` micro-batches complete the current window."""
        return self._window.done(micro_step, self.steps)

    def on_window_end(self, callback):
        """Runs `callback(keep)` after the update of every `apply` that ends
        a window, in cross-replica context; register before `apply` is traced.

        Args:
            callback: called with `keep`: None at a window's end, or under
                XLA on one replica a boolean tensor on every micro-step (write
                only where it holds). Bound methods are held weakly; a repeat
                registration does nothing; callbacks run in registration order.
        """
        self._follow_with("window_end", callback)

    def _on_each_apply(self, callback):
        """Runs `callback(optimizer)` after the micro-step's count of every
        `apply` (TensorFlow's driver, cross-replica context), as `on_window_end`."""
        self._follow_with("each_apply", callback)

    def _follow_with(self, kind, callback):
        if getattr(self, "_followers", None) is None:
            self._followers = _Followers()
        callbacks = getattr(self._followers, kind)
        if any(ref() == callback for ref in callbacks):
            return
        if inspect.ismethod(callback):
            callbacks.append(weakref.WeakMethod(callback))
        else:
            callbacks.append(lambda: callback)

    def _callbacks(self, kind="window_end"):
        """The live callbacks of `on_window_end` (or `_on_each_apply`), in order."""
        followers = getattr(self, "_followers", None)
        callbacks = (ref() for ref in (getattr(followers, kind) if followers else []))
        return [c for c in callbacks if c is not None]


class _Followers:
    """`on_window_end`'s and `_on_each_apply`'s weak callbacks (a plain
    holder nobody tracks)."""

    def __init__(self):
        self.window_end = []
        self.each_apply = []


class AccumulationOptimizer(
    drivers.Driver, WindowMixin, LastWindowMixin, StateMixin, optimizers.Optimizer
):
    """Base class: one micro-batch per `apply`, one update per window."""

    # A NaN propagates into `_window_sums`: "skip_window" checks them once.
    _checks_window_sums = False
    # The update is another optimizer's step (it counts, EMA, constraints).
    _steps_inner = False
    # `apply(weight=...)` weighs the micro-batch; the others refuse a weight.
    takes_weights = False
    # Under PyTorch processes: "sums", "parts" or "gradients"
    # (`drivers.portable.across_processes`); None: refused.
    _across_processes = None

    def __init__(
        self,
        learning_rate,
        steps=1,
        nonfinite="skip_micro_batch",
        flush_last_window=False,
        **kwargs,
    ):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.steps = schedules.check_steps(steps)
        self.nonfinite = check_choice("nonfinite", nonfinite, NONFINITE_POLICIES)
        # True: `fit`'s end applies a partial last window (`flush`).
        self.flush_last_window = check_flush(self, flush_last_window)

    def build(self, var_list):
        # `fit` builds before `apply`: name a strategy mix-up here.
        self._check_strategy()
        self._processes()  # PyTorch processes: asked once, off the step
        # Before anything is created (and before JAX's `fit` takes the state).
        if isinstance(self.steps, StepsSchedule):
            schedules.check_trained_size(self.steps)
        # What a saved, never-built instance holds (see `load_own_variables`).
        self._unbuilt_count = len(self.variables)
        super().build(var_list)
        self._window = WindowState(self)
        if isinstance(self.steps, StepsSchedule):
            self.steps.build(self)

    @property
    def _nonfinite_policy(self):
        """`nonfinite`, as the drivers ask it (a `nonfinite.Policy`)."""
        return nonfinite.POLICIES[self.nonfinite]

    def add_local_variable(self, shape, dtype, name, reference=None):
        """A replica-local variable (see `_replicas.add_local_variable`)."""
        return _replicas.add_local_variable(self, shape, dtype, name, reference)

    # -- counters (0 before `build`, as Keras's `iterations`) -----------------

    @property
    def micro_step(self):
        """Number of `apply` calls so far (micro-batches per replica)."""
        return self._counter("micro_step")

    @property
    def skipped_micro_batches(self):
        """Micro-batches skipped for a non-finite gradient (all replicas)."""
        return self._counter("skipped_micro_batches")

    @property
    def skipped_updates(self):
        """Windows dropped for a non-finite gradient (`"skip_window"`)."""
        return self._counter("skipped_updates")

    def _counter(self, name):
        if self._window is None:
            return ops.convert_to_tensor(0, _backend.INT)
        return getattr(self._window, name)

    def has_updated(self):
        """True when the last `apply` ended a window (applied or dropped)."""
        if not self.built:
            return ops.convert_to_tensor(False)
        step = ops.convert_to_tensor(self._window.micro_step)
        return ops.logical_and(step > 0, self._window_done(step))

    # -- the step -----------------------------------------------------------

    def apply_gradients(self, grads_and_vars, weight=None):
        grads, trainable_variables = zip(*grads_and_vars)
        self.apply(grads, trainable_variables, weight=weight)
        return self.iterations

    def apply(
        self,
        grads: Sequence[Any],
        trainable_variables: Sequence[Any] | None = None,
        weight: Any = None,
    ) -> None:
        """Folds one micro-batch in; updates the variables at a boundary.

        Args:
            grads: one gradient per variable; under a strategy each
                replica's share of the global mean (the Keras convention).
            trainable_variables: the variables; required on the first call.
            weight: optional items (or tokens) in the global micro-batch, a
                number >= 0 or a scalar tensor (0: counted, adds nothing).
                `GradientAccumulation` weighs its window mean by it; the Adam
                variants refuse it.
        """
        self._drive(*self._checked_pairs(grads, trainable_variables, weight))

    def _checked_pairs(self, grads, trainable_variables, weight):
        """`apply`'s checks and build: (pairs, overwrite pairs, weight)."""
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "`trainable_variables` must be given on the first call "
                    "to `apply`, or the optimizer built beforehand."
                )
            trainable_variables = _compat.trainable_variables(self)
        grads, trainable_variables = list(grads), list(trainable_variables)
        if len(grads) != len(trainable_variables):
            raise ValueError(
                f"`grads` must hold one gradient per variable "
                f"({len(trainable_variables)} variables). "
                f"Received: len(grads)={len(grads)}"
            )
        if not self.takes_weights:
            self._refuse_weight(weight)
        elif weight is None:  # `weigh_micro_batches` under model.fit
            weight = self._default_weight()
        weight = 1.0 if weight is None else weighing.check_weight(weight)
        if isinstance(self.steps, StepsSchedule):  # under `fit`: boundaries where written
            schedules.check_trained_size(self.steps)
        self._check_strategy()
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        _compat.check_variables_are_known(self, trainable_variables)
        pairs = [(g, v) for g, v in zip(grads, trainable_variables) if g is not None]
        if not pairs:
            raise ValueError("No gradients provided for any variable.")
        # float8 scales (`overwrite_with_gradient`) stay out of the window.
        overwrite = [p for p in pairs if getattr(p[1], "overwrite_with_gradient", False)]
        pairs = [p for p in pairs if not getattr(p[1], "overwrite_with_gradient", False)]
        return pairs, overwrite, weight

    def _refuse_weight(self, weight):
        """A weight this optimizer would ignore: an error, never a no-op."""
        name = type(self).__name__
        if weight is not None:
            weighing.check_weight(weight)  # a bad value is named as such first
            raise ValueError(
                f"`weight` is not used by {name}: its window averages "
                "micro-batches equally (see its docstring). Pass no weight, or "
                "use GradientAccumulation(keras.optimizers.Adam(...)) for a "
                f"mean weighted by item counts. Received: weight={weight!r}"
            )

    def _default_weight(self):
        """The weight of an `apply` given none (None: one)."""
        return None

    # -- the rule's hooks (`keras.ops`, any backend) ---------------------------

    def _fold(self, grads, variables, weight, start, ok):
        """Folds one micro-batch in. `start`: first of its window; `ok`:
        False for a skipped one. Each a Python bool or a boolean tensor."""
        raise NotImplementedError

    def _window_ok(self, boundary):
        """Whether the window may be applied (True: always)."""
        if self._nonfinite_policy.drops_windows:  # no bad micro-batch in the window
            return ops.equal(ops.convert_to_tensor(self._window.bad), 0)
        return True

    def _window_sums(self):
        """The variables a NaN propagates into (`_checks_window_sums`)."""
        return []

    def _process_sums(self):
        """Variables all-reduced over PyTorch processes at a window's end."""
        return []

    def _window_state(self):
        """Variables holding the open window (cleared after a `flush`)."""
        return []

    def _update(self, variables, keep):
        """The window's update, each write kept where `keep` holds."""
        raise NotImplementedError

    def _ema_momentum_of_window(self, replicas=1):
        """The EMA momentum of one update; None: Keras's `ema_momentum`."""
        return None

    def _wrapped_optimizers(self):
        """Keras optimizers this one steps in its update."""
        return []

    def get_config(self):
        config = super().get_config()
        config.update({"steps": schedules.serialize_steps(self.steps), "nonfinite": self.nonfinite})
        config["flush_last_window"] = self.flush_last_window
        return config
