"""The base class of the keras_accum optimizers: one micro-batch per
`apply`, one update per window.

Every keras_accum optimizer sees one *micro-batch* gradient per `apply` call
and changes the model's variables once per *window* of `steps` calls. Under a
`tf.distribute` strategy each call carries one micro-batch per replica, so a
window holds `kappa = steps * num_replicas_in_sync` micro-batches.

`apply` checks its arguments, builds, and hands the micro-batch to the
backend's driver (`keras_accum.drivers`, a base class chosen once at
import): the driver decides where a window starts and ends, screens
non-finite gradients (`keras_accum.nonfinite`), counts, and at a window's
end runs the optimizer's update, then the EMA of the weights and the
constraints. What an optimizer computes is its rule, the hooks below, in
`keras.ops`; TensorFlow runs each rule in its own form
(`keras_accum.drivers.tensorflow`).

Incoming gradients follow the Keras convention: each replica's gradient is
its share of the global mean, i.e. the gradient of the replica's summed loss
divided by the *global* number of items (what `model.fit` produces); summed
over replicas it is the gradient of the global micro-batch mean.

State, in creation order (the checkpoint format): `iterations` (updates
applied), the window's bookkeeping (`WindowState`, below:
micro-step, skip counters, bad micro-batches, a schedule's window), a
schedule's own state, then each subclass's slots.
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
    """Where micro-step `step` (0-based, the calls so far) stands: (start,
    size, end), whether a window starts there, and the size and end
    micro-step of the window it is in, given those of the window before
    (`end`, `size`). `steps` (an int or a schedule) is read where a window
    starts (`step >= end`), and its value holds until the window ends.
    Without a window's state (`end` None, an int `steps`) size and end come
    back None. Values in, values out: the caller writes them."""
    if end is None:
        return step % steps == 0, None, None
    start = step >= end
    fresh = steps(step) if isinstance(steps, StepsSchedule) else steps
    size = ops.where(start, ops.cast(fresh, size.dtype), size)
    return start, size, ops.where(start, step + size, end)


class WindowState:
    """One optimizer's window bookkeeping, each field an optimizer variable
    (created in this order, which is the saved format, after
    `iterations`):

    * `micro_step`: `apply` calls so far (micro-batches per replica);
    * `skipped_micro_batches`: micro-batches left out for a non-finite
      gradient (replica-local, summed on read);
    * `skipped_updates`: windows whose update was dropped;
    * `bad`: non-finite micro-batches in the current window (`window_bad`,
      replica-local; for `"skip_window"`);
    * `size`, `end`: under a schedule, the current window's size and end
      micro-step (`window_steps`, `window_end`), fixed where it starts, so
      a checkpoint may fall inside a window; None for an int `steps`.

    The rules read it; the drivers alone write it (`tests/test_structure.py`
    checks the source).
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
        """`bounds` at the current micro-step (values; the driver writes
        `size` and `end`)."""
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
    """An optimizer's window: its size (`window_steps`), whether it ends at
    a micro-step, and who follows the windows (`on_window_end`)."""

    _window = None  # the `WindowState`, from `build`
    _window_bounds = staticmethod(bounds)  # for a layer that counts its own windows

    @property
    def window_steps(self):
        """Micro-batches per replica of the current window (`steps`, or with
        a schedule the value it gave when the window started, a variable)."""
        if isinstance(self.steps, StepsSchedule):
            return self._window.size
        return self.steps

    def _window_done(self, micro_step):
        """True when `micro_step` micro-batches complete the current window."""
        return self._window.done(micro_step, self.steps)

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


class _Followers:
    """The callbacks of one optimizer's `on_window_end`, in the order they
    were registered, each held weakly (a plain holder: nothing Keras or
    TensorFlow tracks or saves)."""

    def __init__(self):
        self.refs = []


class AccumulationOptimizer(
    drivers.Driver, WindowMixin, LastWindowMixin, StateMixin, optimizers.Optimizer
):
    """Base class: one micro-batch per `apply`, one update per window."""

    # True when a NaN or an Inf of any micro-batch propagates into the
    # window's sums (`_window_sums`), so that "skip_window" may check them
    # once, at the window's end, instead of every micro-batch.
    _checks_window_sums = False
    # True when the update is another optimizer's step (it counts updates,
    # and applies its EMA and constraints, itself).
    _steps_inner = False
    # True when `apply(weight=...)` weighs the micro-batch (a weighted
    # window mean); the others refuse a weight rather than ignore it.
    takes_weights = False
    # Under several PyTorch processes (`drivers.torch_processes`): "sums"
    # (each process's window sums, all-reduced at the window's end),
    # "parts" (each process's gradient a micro-batch, its part of the state
    # all-reduced there), "gradients" (the mean gradient every micro-batch);
    # None: refused.
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
        # `model.fit` builds the optimizer before its first `apply`: a
        # strategy mix-up must be named here, before TensorFlow fails on it.
        self._check_strategy()
        self._processes()  # PyTorch processes: asked once, here, off the step
        # And a schedule's micro-batch, before anything is created (under
        # JAX also before `fit` moves the variables into its state).
        if isinstance(self.steps, StepsSchedule):
            schedules.check_trained_size(self.steps)
        # What a saved, never-built instance holds (see `load_own_variables`).
        self._unbuilt_count = len(self.variables)
        super().build(var_list)
        # The window's bookkeeping: written by the driver alone.
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

    # -- counters -----------------------------------------------------------

    # Before the optimizer is built (its first `apply`, or `build`) the
    # counters read 0, as Keras's `iterations` does.

    @property
    def micro_step(self):
        """Number of `apply` calls so far (micro-batches per replica)."""
        return self._counter("micro_step")

    @property
    def skipped_micro_batches(self):
        """Micro-batches left out for a non-finite gradient under
        `nonfinite="skip_micro_batch"` (summed over replicas on read)."""
        return self._counter("skipped_micro_batches")

    @property
    def skipped_updates(self):
        """Windows whose update was dropped for a non-finite gradient under
        `nonfinite="skip_window"`."""
        return self._counter("skipped_updates")

    def _counter(self, name):
        if self._window is None:
            return ops.convert_to_tensor(0, _backend.INT)
        return getattr(self._window, name)

    def has_updated(self):
        """True when the last `apply` call ended a window (an update was
        applied, or dropped under a `skip_*` policy and counted)."""
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
            grads: gradients, one per trainable variable (Keras convention
                under a strategy, see the module docstring).
            trainable_variables: the variables; required on the first call.
            weight: optional number of items (or tokens) in the global
                micro-batch these gradients average over, a number >= 0 or a
                scalar tensor (0: a micro-batch that adds nothing to the
                window's mean, still counted as a micro-step). Only
                `GradientAccumulation` uses it (the window mean is then
                weighted by item counts, exact for unequal micro-batches);
                the Adam variants refuse it.
        """
        self._drive(*self._checked_pairs(grads, trainable_variables, weight))

    def _checked_pairs(self, grads, trainable_variables, weight):
        """`apply`'s checks and build: the (gradient, variable) pairs of the
        window, those Keras overwrites with their gradient, and the weight."""
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
        # Variables Keras overwrites with their gradient (float8 scales) take
        # no part in the window, as in `keras.optimizers.Optimizer.apply`.
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

    # -- the rule: what each optimizer fills in (`keras.ops`, any backend) ----

    def _fold(self, grads, variables, weight, start, ok):
        """Folds one micro-batch in. `start`: the window's first micro-batch;
        `ok`: False for a skipped one (True, a Python bool, when nothing is
        screened). Each is a boolean tensor (JAX) or a Python bool."""
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
        """The variables all-reduced over PyTorch processes at a window's
        end (`_across_processes`)."""
        return []

    def _window_state(self):
        """The variables that hold the window's micro-batches until its end
        (cleared after a `flush`)."""
        return []

    def _update(self, variables, keep):
        """The window's update, each write kept where `keep` holds."""
        raise NotImplementedError

    def _ema_momentum_of_window(self, replicas=1):
        """The EMA momentum of one update; None: Keras's `ema_momentum`."""
        return None

    def _wrapped_optimizers(self):
        """Keras optimizers this one steps in its update (they write with
        their own `assign*`)."""
        return []

    def get_config(self):
        config = super().get_config()
        config.update({"steps": schedules.serialize_steps(self.steps), "nonfinite": self.nonfinite})
        config["flush_last_window"] = self.flush_last_window
        return config
