"""UpdateAccumulationAdam on TensorFlow: the micro-batch's gradient
reduced over the replicas every micro-step, then Adam's micro-step and the
buffer A in one compiled kernel per replica.

The rule (`keras_accum.update_accumulation_adam`) says what a micro-batch
and a window's end compute; this is how TensorFlow runs it under
`tf.distribute`: the moments are shared (mirrored), so each micro-step's
gradients are summed over the replicas first, and every replica then runs
`folds.adam_micro_step` on its copy of m, v, A (and, with `steps=1`, the
variable: Keras's Adam, op for op).
"""

from keras_accum import _compat, _execution, _replicas, _tensors, folds
from keras_accum._backend import tf


class UpdateAccumulationAdamForm:
    """The TensorFlow form of `keras_accum.UpdateAccumulationAdam` (a mixin)."""

    def _tf_accumulate(self, grads, variables, weight, start):
        # Moments are shared: reduce the gradient every micro-step (SUM of the
        # replicas' shares is the replica-mean gradient).
        reduced = self._reduce(grads, variables)
        # Every replica now holds the same micro-step gradient: screen and
        # clip it on each (each counts the skip of its own micro-batch).
        xla = _execution.in_xla()
        reduced, ok = _replicas.for_each_replica(self._prepare, reduced, variables, xla)
        if self.nonfinite in (None, "raise"):
            ok = None
        else:
            ok = _replicas.local_value(ok)
        # t = micro-steps folded into the moments so far (a skip adds none)
        t = self._moment_steps.assign_add(1 if ok is None else tf.cast(ok, "int64"))
        # alpha_t with t = micro-steps folded into the moments so far (>= 1,
        # also before the first finite one)
        # With no buffer A (plain Adam) alpha is computed in each variable's
        # dtype, as Keras Adam does (in bfloat16 beta_2 = 0.999 rounds to 1,
        # and Keras's alpha is 0); with a buffer, in float32.
        count = tf.maximum(t, 1)
        dtypes = {v.dtype for v in variables} if self._updates is None else {"float32"}
        alphas = {
            tf.as_dtype(dtype).name: self._adam_alpha(self.learning_rate, count, dtype)
            for dtype in dtypes
        }
        scalars = (
            alphas,
            tf.constant(1 - self.beta_1, "float32"),
            tf.constant(1 - self.beta_2, "float32"),
            tf.constant(self.epsilon, "float32"),
            tf.cast(self.learning_rate, "float32"),
        )
        # One compiled kernel per replica for every variable in graph mode
        # (TensorFlow ops would be a full pass per term), op by op on a small
        # model; each replica updates its own copy of the (mirrored) state
        # with the same reduced gradient.
        # With no buffer A (plain Adam) the ops stay Keras Adam's, bit for bit.
        jit = self._updates is not None and _execution.worth_compiling(variables)

        def micro_step(keep):
            _replicas.for_each_replica(
                self._micro_step_of, reduced, variables, scalars, start, keep, jit
            )

        _execution.by_condition(micro_step, ok)

    def _reduce(self, grads, variables):
        """SUM over replicas. A tensor that every replica handed in (not a
        per-replica value) sums to replicas x itself."""
        grads = [_tensors.dense(g) for g in grads]
        replicas = _replicas.count()
        split = [_replicas.is_per_replica(g) for g in grads]
        summed = iter(
            _replicas.sum_over_replicas([(g, v) for g, v, s in zip(grads, variables, split) if s])
        )
        return [
            next(summed) if s else g * replicas if replicas > 1 else g for g, s in zip(grads, split)
        ]

    def _prepare(self, grads, variables, mask=True):
        grads = [tf.cast(g, v.dtype) for g, v in zip(grads, variables)]
        grads, ok = self._screen(grads, mask=mask)
        grads = self._clip_micro_batch(grads, 1)
        return grads, (tf.constant(True) if ok is None else ok)

    def _micro_step_of(self, grads, variables, scalars, start, keep, jit):
        """`folds.adam_micro_step` for every variable (replica context)."""
        handles = []
        for var in variables:
            index = _compat.variable_index(self, var)
            update = None if self._updates is None else self._updates[index].handle
            decay = None
            if self._updates is None and self.weight_decay is not None:
                decay = self.weight_decay if _compat.uses_weight_decay(self, var) else None
            handles.append(
                (
                    self._momentums[index].handle,
                    self._velocities[index].handle,
                    update,
                    var.handle,
                    None if decay is None else tf.constant(decay, "float32"),
                )
            )
        _execution.run(folds.adam_micro_step, self, grads, handles, scalars, start, keep, jit=jit)

    def _tf_update(self, variables, window, writes):
        if self._updates is None:  # steps == 1: applied in the micro-step
            return
        learning_rate = self.learning_rate
        for var in variables:
            update = self._updates[_compat.variable_index(self, var)]

            def apply_update(variable, update):
                self._decay(variable, tf.cast(learning_rate, variable.dtype))
                # theta = theta - A
                writes.assign_sub(variable, update)

            _replicas.update_each([var], apply_update, update.value)
