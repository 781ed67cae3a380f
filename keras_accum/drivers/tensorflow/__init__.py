"""The TensorFlow driver: `apply` enters cross-replica context once
(`merge_call`: a synchronising `cond` in replica context crashes), folds per
replica (`_tf_fold`), and decides the window's end there
(`_execution.at_window_end`). Each optimizer's form overrides the `_tf_*`
hooks. See docs/ARCHITECTURE.md, "How a micro-batch flows".
"""

import keras

from keras_accum import _compat, _replicas, kernels
from keras_accum._backend import tf
from keras_accum.drivers.tensorflow import _execution
from keras_accum.drivers.tensorflow.batch_norm import BatchNormalizationForm
from keras_accum.drivers.tensorflow.gradient_accumulation import GradientAccumulationForm
from keras_accum.drivers.tensorflow.invariant_adam import InvariantAdamForm
from keras_accum.drivers.tensorflow.update_accumulation_adam import UpdateAccumulationAdamForm

__all__ = [
    "BatchNormalizationForm",
    "Driver",
    "GradientAccumulationForm",
    "InvariantAdamForm",
    "UpdateAccumulationAdamForm",
]


class Driver:
    """The TensorFlow route of `AccumulationOptimizer.apply`."""

    def _drive(self, pairs, overwrite, weight):
        if tf.distribute.get_replica_context() is None:
            raise ValueError(
                f"{self.__class__.__name__}.apply() must be called in a "
                "replica context (inside `strategy.run`), not in "
                "cross-replica context."
            )
        grads = [g for g, _ in pairs]
        if self.loss_scale_factor is not None:
            # g = g / loss_scale_factor, before anything else sees it.
            unscale = lambda x: x / self.loss_scale_factor
            grads = [_execution.map_values(unscale, g) for g in grads]
        with keras.name_scope(self.name, caller=self):
            _replicas.merge(self._merge_apply, grads, [v for _, v in pairs], weight, overwrite)

    def _check_strategy(self):
        """Refuses a strategy other than the optimizers' own (else TensorFlow
        fails later, naming neither)."""
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

    def _flush_window(self):
        """`flush`: the window's end and its callbacks now (cross-replica),
        then its sums and bad count cleared."""
        variables = _compat.trainable_variables(self)
        with self._creation_scope(), keras.name_scope(self.name, caller=self):
            self._end_window(variables)
            for callback in self._callbacks():
                callback(None)
        for variable in [*self._window_state(), self._window.bad]:
            variable.assign(tf.zeros(variable.shape, variable.dtype))

    def _processes(self):
        return 1  # tf.distribute's replicas are `_replicas.count()`

    def _creation_scope(self):
        """The scope of the optimizer's strategy, for state created later."""
        return _compat.optimizer_strategy(self).scope()

    def _merge_apply(self, grads, trainable_variables, weight, overwrite):
        # Cross-replica context from here on: `grads` are per-replica values.
        state = self._window
        window_start, size, end = state.bounds(self.steps)
        if size is not None:  # a schedule's window, fixed where it starts
            state.size.assign(size)
            state.end.assign(end)
        if grads:
            self._tf_accumulate(grads, trainable_variables, weight, window_start)
        micro_step = state.micro_step.assign_add(1)
        for callback in self._callbacks("each_apply"):
            callback(self)
        boundary = self._window_done(micro_step)
        self._overwrite_with_gradients(overwrite, boundary)
        followers = self._callbacks()

        def end(keep):
            self._end_window(trainable_variables, keep)
            for callback in followers:  # `on_window_end`, in the same branch
                callback(keep)

        _execution.at_window_end(boundary, end, every_step=self.steps == 1)

    def _overwrite_with_gradients(self, pairs, boundary):
        """`overwrite_with_gradient` variables take the window's last
        gradient at the boundary (a select)."""
        for grad, variable in pairs:

            def overwrite(var, grad):
                grad = tf.cast(_execution.dense(grad), var.dtype)
                var.assign(grad if self.steps == 1 else tf.where(boundary, grad, var))

            _replicas.update_each([variable], overwrite, grad)

    def _end_window(self, trainable_variables, boundary=None):
        """The window's update (or drop); with `boundary` (XLA, one
        replica) on every micro-step, writes kept where it holds."""
        window, window_ok = self._tf_read_window(trainable_variables)

        def update(writes=self):
            # `writes`: this optimizer's `assign*`, or their kept form.
            self._tf_update(trainable_variables, window, writes)
            self._finish_update(trainable_variables)
            _compat.update_counter(self).assign_add(1)

        counters = self._window

        def drop():
            counters.skipped_updates.assign_add(1)
            self._tf_drop_window(trainable_variables)

        policy = self._nonfinite_policy
        counts_bad = policy.drops_windows and not self._checks_window_sums
        if boundary is not None:
            keep = boundary if window_ok is None else boundary & window_ok
            state = list(trainable_variables) + list(self.variables)
            wrapped = self._wrapped_optimizers()
            _execution.keep_where(keep, trainable_variables, state, self, update, wrapped)
            if window_ok is not None:
                dropped = boundary & tf.logical_not(window_ok)
                counters.skipped_updates.assign_add(tf.cast(dropped, "int64"))
                self._tf_drop_window(trainable_variables, dropped)
        elif window_ok is None:
            update()
        else:
            tf.cond(window_ok, update, drop)
        if counts_bad:
            restart = 0
            if boundary is not None:  # window_bad = 0 at the window's end
                bad = _replicas.read_total(counters.bad)
                restart = tf.where(boundary, tf.zeros_like(bad), bad)
            _replicas.assign_total(counters.bad, restart)

    def _finish_update(self, variables):
        """After an update, in Keras's order: EMA, then constraints (unless
        `_steps_inner`)."""
        if self._steps_inner:
            return
        if self.use_ema:
            kernels.update_ema(self, True, _replicas.count())
        for variable in variables:
            if variable.constraint is not None:

                def constrain(var, constraint=variable.constraint):
                    var.assign(constraint(var))

                _replicas.update_each([variable], constrain)

    def _screen(self, grads, mask=True):
        """`_execution.screen` of this optimizer (replica context)."""
        return _execution.screen(self, grads, mask)

    # -- a form's hooks; by default the rule runs as written -----------------

    def _tf_accumulate(self, grads, variables, weight, start):
        """Cross-replica: folds one micro-batch in, `_tf_fold` per replica."""
        _replicas.for_each_replica(self._tf_fold, grads, variables, weight, start)

    def _tf_fold(self, grads, variables, weight, start):
        """Replica context: the rule's `_fold` of this replica's share into
        its replica-local slots; a non-finite one as zeros, `ok` False."""
        grads, ok = self._screen([_execution.dense(g) for g in grads])
        self._fold(grads, variables, weight, start, True if ok is None else ok)

    def _tf_read_window(self, variables):
        """(window, ok) at the boundary: totals for `_tf_update`, and
        whether it may be applied (None: always)."""
        ok = self._window_ok(True)
        return None, (None if ok is True else ok)

    def _tf_update(self, variables, window, writes):
        """The window's update, written with `writes.assign*` (by default
        the rule's `_update`)."""
        self._update(variables, True)

    def _tf_drop_window(self, variables, dropped=None):
        """After a dropped update (where `dropped` holds): no NaN left."""
        return None  # a docstring-only body makes AutoGraph warn when traced
