"""The base class of the keras_accum optimizers: one micro-batch per
`apply`, one update per window.

Every keras_accum optimizer sees one *micro-batch* gradient per `apply` call
and changes the model's variables once per *window* of `steps` calls. Under a
`tf.distribute` strategy each call carries one micro-batch per replica, so a
window holds `kappa = steps * num_replicas_in_sync` micro-batches.

The route of one call (TensorFlow backend):

1. `apply` (replica context, as Keras's `train_step` and a custom
   `strategy.run` loop call it) checks its arguments and enters
   cross-replica context with `merge_call`, so that the window boundary is
   decided there: a `cond` whose branch needs a sync point cannot live in
   replica context (the crash of Keras's own `gradient_accumulation_steps`
   under MirroredStrategy); Keras's `LossScaleOptimizer` does the same.
2. `_accumulate` folds the micro-batch into the optimizer state; by default
   each replica runs the subclass's `_fold` on its own replica-local state
   (no communication).
3. The micro-step counter advances; at a boundary `_update` changes the
   model variables and `iterations` (the update count, which learning-rate
   schedules see) advances by one (`_execution.at_window_end` decides how
   the boundary runs: a branch, or under XLA a kept select); the callbacks
   of `on_window_end` run there too (the moving statistics of
   `keras_accum.layers.BatchNormalization`).

Subclass hooks receive tensors and variables; every cross-replica verb is
in `keras_accum._replicas`, the non-finite policy in
`keras_accum.nonfinite`, the window's bounds in `keras_accum.window`.

Incoming gradients follow the Keras convention: each replica's gradient is
its share of the global mean, i.e. the gradient of the replica's summed loss
divided by the *global* number of items (what `model.fit` produces); summed
over replicas it is the gradient of the global micro-batch mean.

State, field by field (creation order is the checkpoint format):
`iterations` (updates applied), `micro_step` (calls to `apply`),
`skipped_micro_batches` (per replica, summed on read), `skipped_updates`
(windows whose update was dropped), `window_bad` (non-finite micro-batches
in the current window, for `"skip_window"`), then each subclass's slots.
"""

import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import keras
from keras import ops, optimizers

from keras_accum import (
    _backend,
    _compat,
    _execution,
    _replicas,
    _tensors,
    nonfinite,
    portable,
    schedules,
    weighing,
)
from keras_accum._backend import tf
from keras_accum._saving import StateMixin
from keras_accum.validation import check_choice
from keras_accum.window import WindowMixin

NONFINITE_POLICIES = tuple(nonfinite.POLICIES)


# Frames of these packages are not where a user's call is.
_LIBRARIES = tuple(
    os.path.dirname(sys.modules[name].__file__) + os.sep
    for name in ("keras", "tensorflow", "jax", "torch", __package__)
    if getattr(sys.modules.get(name), "__file__", None)
)


def _caller_stacklevel():
    """The `stacklevel` that points a warning at the first frame outside
    keras_accum, Keras and TensorFlow (the user's `fit` call)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARIES):
        frame, level = frame.f_back, level + 1
    return level


def _int(variable):
    """A scalar variable's value as an int, eagerly. Not through
    convert_to_numpy: NumPy 2 deprecates Keras's `Variable.__array__` (no
    `copy` argument), so under `-W error` every `fit` failed. Under
    TensorFlow the value may be a MirroredVariable, which int() refuses."""
    value = variable.value
    return int(tf.convert_to_tensor(value) if _backend.IS_TENSORFLOW else value)


class AccumulationOptimizer(WindowMixin, StateMixin, optimizers.Optimizer):
    """Base class: one micro-batch per `apply`, one update per window."""

    # True when "skip_window" checks the window's state at its end instead
    # of counting non-finite micro-batches in `window_bad`.
    _checks_window_sums = False
    # True when `apply(weight=...)` weighs the micro-batch (a weighted
    # window mean); the others refuse a weight rather than ignore it.
    takes_weights = False

    def __init__(self, learning_rate, steps=1, nonfinite="skip_micro_batch", **kwargs):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.steps = schedules.check_steps(steps)
        self.nonfinite = check_choice("nonfinite", nonfinite, NONFINITE_POLICIES)

    def build(self, var_list):
        # `model.fit` builds the optimizer before its first `apply`: a
        # strategy mix-up must be named here, before TensorFlow fails on it.
        self._check_strategy()
        # What a saved, never-built instance holds (see `load_own_variables`).
        self._unbuilt_count = len(self.variables)
        super().build(var_list)
        counter = dict(dtype=_backend.INT, aggregation="only_first_replica")
        self._micro_step = self.add_variable((), name="micro_step", **counter)
        self._skipped_micro_batches = self.add_local_variable(
            (), dtype=_backend.INT, name="skipped_micro_batches"
        )
        self._skipped_updates = self.add_variable((), name="skipped_updates", **counter)
        self._window_bad = self.add_local_variable((), dtype=_backend.INT, name="window_bad")
        self._build_window()

    def add_local_variable(self, shape, dtype, name, reference=None):
        """A replica-local variable (see `_replicas.add_local_variable`)."""
        return _replicas.add_local_variable(self, shape, dtype, name, reference)

    # -- counters -----------------------------------------------------------

    # Before the optimizer is built (its first `apply`, or `build`) the
    # counters read 0, as Keras's `iterations` does.

    @property
    def micro_step(self):
        """Number of `apply` calls so far (micro-batches per replica)."""
        return self._counter("_micro_step")

    @property
    def skipped_micro_batches(self):
        """Micro-batches left out for a non-finite gradient under
        `nonfinite="skip_micro_batch"` (summed over replicas on read)."""
        return self._counter("_skipped_micro_batches")

    @property
    def skipped_updates(self):
        """Windows whose update was dropped for a non-finite gradient under
        `nonfinite="skip_window"`."""
        return self._counter("_skipped_updates")

    def _counter(self, name):
        counter = getattr(self, name, None)
        return ops.convert_to_tensor(0, _backend.INT) if counter is None else counter

    def pending_micro_batches(self) -> int:
        """Micro-batches (per replica) folded into the current window and
        not applied yet: 0 at a window's boundary. Eager only."""
        if not self.built:
            return 0
        step = _int(self._micro_step)
        if isinstance(self.steps, int):
            return step % self.steps
        end, size = _int(self._window_end), _int(self._window_size)
        return 0 if step >= end else step - (end - size)

    def finalize_variable_values(self, var_list):
        # Keras's `fit` calls this once, when training ends.
        self._warn_pending_window()
        super().finalize_variable_values(var_list)

    def _warn_pending_window(self):
        """Says so when training ends inside a window, whose micro-batches
        are accumulated but not applied."""
        if not _backend.executing_eagerly() or getattr(self, "_warned_pending", False):
            return
        try:
            pending = self.pending_micro_batches()
        except Exception:
            # Keras calls this in a `finally` also when a step failed (under
            # JAX the state may then be unreadable): a warning must never
            # replace the user's own error.
            return
        if pending:
            # Once per optimizer: `fit(epochs=1)` in a loop is a pattern the
            # README shows, and a partial window carries over to the next.
            self._warned_pending = True
            size = self.steps if isinstance(self.steps, int) else _int(self._window_size)
            warnings.warn(
                f"{type(self).__name__} '{self.name}': training ended inside a window: "
                f"{pending} of its {size} micro-batches (per replica) are accumulated "
                "but not applied. They are applied if training goes on with this "
                "optimizer (its state is saved with it); to end on an update, make "
                "the micro-batches trained a multiple of `steps`.",
                stacklevel=_caller_stacklevel(),
            )

    def has_updated(self):
        """True when the last `apply` call ended a window (an update was
        applied, or dropped under a `skip_*` policy and counted)."""
        if not self.built:
            return ops.convert_to_tensor(False)
        step = ops.convert_to_tensor(self._micro_step)
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
                micro-batch these gradients average over, a number > 0 or a
                scalar tensor. Only `GradientAccumulation` uses it (the window
                mean is then weighted by item counts, exact for unequal
                micro-batches); the Adam variants refuse it.
        """
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
        weight = weighing.check_weight(weight)
        self._check_strategy()
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        _compat.check_variables_are_known(self, trainable_variables)
        pairs = [(g, v) for g, v in zip(grads, trainable_variables) if g is not None]
        if not pairs:
            raise ValueError("No gradients provided for any variable.")
        if not _backend.IS_TENSORFLOW:
            overwrite = [p for p in pairs if getattr(p[1], "overwrite_with_gradient", False)]
            pairs = [p for p in pairs if not getattr(p[1], "overwrite_with_gradient", False)]
            return self._portable_apply(pairs, overwrite, weight)
        if tf.distribute.get_replica_context() is None:
            raise ValueError(
                f"{self.__class__.__name__}.apply() must be called in a "
                "replica context (inside `strategy.run`), not in "
                "cross-replica context."
            )
        # Variables Keras overwrites with their gradient (float8 scales) take
        # no part in the window, as in `keras.optimizers.Optimizer.apply`.
        overwrite = [p for p in pairs if getattr(p[1], "overwrite_with_gradient", False)]
        pairs = [p for p in pairs if not getattr(p[1], "overwrite_with_gradient", False)]
        grads = [g for g, _ in pairs]
        if self.loss_scale_factor is not None:
            # g = g / loss_scale_factor, before anything else sees it.
            unscale = lambda x: x / self.loss_scale_factor
            grads = [_tensors.map_values(unscale, g) for g in grads]
        with keras.name_scope(self.name, caller=self):
            _replicas.merge(self._merge_apply, grads, [v for _, v in pairs], weight, overwrite)

    def _check_strategy(self):
        """The strategy in scope must be the one this optimizer (and one it
        wraps) was created under, else TensorFlow fails later, naming
        neither."""
        if not _backend.IS_TENSORFLOW:
            return
        strategy = tf.distribute.get_strategy()
        for optimizer in [self, *self._wrapped_optimizers()]:
            created = _compat.optimizer_strategy(optimizer)
            if created is not strategy:
                raise ValueError(
                    f"Optimizer '{optimizer.name}' ({type(optimizer).__name__}) was created "
                    f"under another tf.distribute strategy than the "
                    f"{type(strategy).__name__} it is applied in: create it, and any "
                    "optimizer it wraps, inside `strategy.scope()`, with the model. "
                    f"Received: created under {type(created).__name__}"
                )

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

    def _merge_apply(self, grads, trainable_variables, weight, overwrite):
        # Cross-replica context from here on: `grads` are per-replica values.
        window_start = self._start_window()
        if grads:
            self._accumulate(grads, trainable_variables, weight, window_start)
        micro_step = self._micro_step.assign_add(1)
        boundary = self._window_done(micro_step)
        self._overwrite_with_gradients(overwrite, boundary)
        followers = self._window_end_callbacks()

        def end(keep):
            self._end_window(trainable_variables, keep)
            for callback in followers:  # `on_window_end`, in the same branch
                callback(keep)

        _execution.at_window_end(boundary, end, every_step=self.steps == 1)

    def _overwrite_with_gradients(self, pairs, boundary):
        """`overwrite_with_gradient` variables take the gradient of the
        window's last micro-batch at the boundary (scalars, no cond)."""
        for grad, variable in pairs:

            def overwrite(var, grad):
                grad = tf.cast(_tensors.dense(grad), var.dtype)
                var.assign(grad if self.steps == 1 else tf.where(boundary, grad, var))

            _replicas.update_each([variable], overwrite, grad)

    def _end_window(self, trainable_variables, boundary=None):
        """The window's update (or its drop). With `boundary` (a boolean
        tensor, under XLA on one replica) it runs on every micro-step and
        its writes are kept only where `boundary` holds."""
        window, window_ok = self._read_window(trainable_variables)

        def update(writes=self):
            # `writes`: what the update writes its slots and variables with
            # (this optimizer's `assign*`, or their kept form under a select).
            self._update(trainable_variables, window, writes)
            self._finish_update(trainable_variables)
            _compat.update_counter(self).assign_add(1)

        def drop():
            self._skipped_updates.assign_add(1)
            self._drop_window(trainable_variables)

        counts_bad = self.nonfinite == "skip_window" and not self._checks_window_sums
        if counts_bad:
            clean = tf.equal(_replicas.read_total(self._window_bad), 0)
            window_ok = clean if window_ok is None else window_ok & clean
        if boundary is not None:
            keep = boundary if window_ok is None else boundary & window_ok
            state = list(trainable_variables) + list(self.variables)
            wrapped = self._wrapped_optimizers()
            _execution.keep_where(keep, trainable_variables, state, self, update, wrapped)
            if window_ok is not None:
                dropped = boundary & tf.logical_not(window_ok)
                self._skipped_updates.assign_add(tf.cast(dropped, "int64"))
                self._drop_window(trainable_variables, dropped)
        elif window_ok is None:
            update()
        else:
            tf.cond(window_ok, update, drop)
        if counts_bad:
            restart = 0
            if boundary is not None:  # window_bad = 0 at the window's end
                bad = _replicas.read_total(self._window_bad)
                restart = tf.where(boundary, tf.zeros_like(bad), bad)
            _replicas.assign_total(self._window_bad, restart)

    def _finish_update(self, variables):
        """After an update, in Keras's order: EMA of the weights (and its
        periodic overwrite), then each variable's constraint."""
        if self.use_ema:
            trained = _compat.trainable_variables(self)
            self._update_ema(trained)
            if self.ema_overwrite_frequency:
                tf.cond(
                    tf.equal((_compat.update_counter(self) + 1) % self.ema_overwrite_frequency, 0),
                    lambda: _compat.overwrite_with_ema(self, trained),
                    lambda: None,
                )
        for variable in variables:
            if variable.constraint is not None:

                def constrain(var, constraint=variable.constraint):
                    var.assign(constraint(var))

                _replicas.update_each([variable], constrain)

    def _update_ema(self, variables):
        """The EMA step of the weights after an update (Keras's by default)."""
        _compat.update_ema(self, variables)

    def _screen(self, grads, mask=True):
        """`nonfinite.screen` of this optimizer (replica context)."""
        return nonfinite.screen(self, grads, mask)

    # -- JAX and PyTorch (`keras_accum.portable`) -----------------------------

    # True when the update is another optimizer's step (it counts updates,
    # and applies its EMA and constraints, itself).
    _portable_steps_inner = False

    def _portable_apply(self, pairs, overwrite, weight):
        grads = [g for g, _ in pairs]
        if self.loss_scale_factor is not None:
            grads = [g / self.loss_scale_factor for g in grads]
        with keras.name_scope(self.name, caller=self):
            portable.apply(self, grads, [v for _, v in pairs], weight, overwrite)

    def _portable_fold(self, grads, variables, weight, start, ok):
        """Folds one micro-batch in (`ok` False: a skipped one; True, a
        Python bool, when nothing is screened)."""
        raise NotImplementedError

    def _portable_window_ok(self, boundary):
        """Whether the window may be applied (True: always)."""
        if self.nonfinite == "skip_window":
            return ops.equal(ops.convert_to_tensor(self._window_bad), 0)
        return True

    def _portable_drop(self, dropped):
        """After a dropped window (where `dropped` holds): leave no
        non-finite state behind. Nothing by default."""
        return None

    def _portable_update(self, variables, keep):
        """The window's update, each write kept where `keep` holds."""
        raise NotImplementedError

    def _ema_momentum_of_window(self):
        """The EMA momentum of one update."""
        return self.ema_momentum

    # -- subclass hooks (tensors and variables in, nothing distributed) -------

    def _accumulate(self, grads, variables, weight, start):
        """Cross-replica: folds one micro-batch in. By default each replica
        runs `_fold(grads, variables, weight, start)` on its own share."""
        _replicas.for_each_replica(self._fold, grads, variables, weight, start)

    def _fold(self, grads, variables, weight, start):
        raise NotImplementedError

    def _read_window(self, variables):
        """(window, ok) at the boundary (cross-replica): totals read once,
        handed to `_update`, and a boolean tensor saying whether the window
        may be applied (None: always)."""
        return None, None

    def _update(self, variables, window, writes):
        """The window's update: `writes.assign*` (this optimizer's own
        methods, or their kept form under a select) for what the update
        reads back; direct writes are kept too."""
        raise NotImplementedError

    def _drop_window(self, variables, dropped=None):
        """After a dropped update (where `dropped` holds, under XLA): leave
        no non-finite window state behind. Nothing by default."""
        return None  # a docstring-only body makes AutoGraph warn when traced

    def _wrapped_optimizers(self):
        """Keras optimizers this one steps in its update (they write with
        their own `assign*`)."""
        return []

    def get_config(self):
        config = super().get_config()
        config.update({"steps": schedules.serialize_steps(self.steps), "nonfinite": self.nonfinite})
        return config
