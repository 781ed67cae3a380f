"""UpdateAccumulationAdam on TensorFlow: the moments are mirrored, so each
micro-step's gradient is summed over the replicas, then every replica runs
`micro_step_kernel` on its copy of m, v, A (with `steps=1`, Keras's Adam).
"""

from keras_accum import _compat, _replicas, equations, kernels
from keras_accum._backend import tf
from keras_accum.drivers.tensorflow import _execution


class UpdateAccumulationAdamForm:
    """The TensorFlow form of `keras_accum.UpdateAccumulationAdam` (a mixin)."""

    def _tf_accumulate(self, grads, variables, weight, start):
        reduced = self._reduce(grads, variables)
        # The same gradient on every replica: screen and clip it on each.
        xla = _execution.in_xla()
        reduced, ok = _replicas.for_each_replica(self._prepare, reduced, variables, xla)
        if not self._nonfinite_policy.skips:
            ok = None
        else:
            ok = _replicas.local_value(ok)
        # t = micro-steps folded into the moments so far (a skip adds none)
        t = self._moment_steps.assign_add(1 if ok is None else tf.cast(ok, "int64"))
        # alpha_t, t >= 1; in each variable's dtype without A (as Keras Adam)
        count = tf.maximum(t, 1)
        dtypes = {self.alpha_dtype(self._slot_dtype(v.dtype)) for v in variables}
        alphas = {tf.as_dtype(dtype).name: self.alpha(count, dtype) for dtype in dtypes}
        scalars = (
            alphas,
            tf.constant(1 - self.beta_1, "float32"),
            tf.constant(1 - self.beta_2, "float32"),
            tf.constant(self.epsilon, "float32"),
            tf.cast(self.learning_rate, "float32"),
        )
        # One compiled kernel per replica; without A, Keras Adam's ops.
        jit = self._updates is not None and _execution.worth_compiling(variables)

        def micro_step(keep):
            _replicas.for_each_replica(
                self._micro_step_of, reduced, variables, scalars, start, keep, jit
            )

        _execution.by_condition(micro_step, ok)

    def _reduce(self, grads, variables):
        """SUM over replicas (a non-per-replica tensor: replicas x itself)."""
        grads = [_execution.dense(g) for g in grads]
        replicas = _replicas.count()
        split = [_replicas.is_per_replica(g) for g in grads]
        summed = iter(
            _replicas.sum_over_replicas([(g, v) for g, v, s in zip(grads, variables, split) if s])
        )
        return [
            next(summed) if s else g * replicas if replicas > 1 else g for g, s in zip(grads, split)
        ]

    def _prepare(self, grads, variables, mask=True):
        # In the moments' dtype (float32 for a bfloat16 variable).
        grads = [tf.cast(g, self._slot_dtype(v.dtype)) for g, v in zip(grads, variables)]
        grads, ok = self._screen(grads, mask=mask)
        grads = self._clip_micro_batch(grads, 1)
        return grads, (tf.constant(True) if ok is None else ok)

    def _micro_step_of(self, grads, variables, scalars, start, keep, jit):
        """`micro_step_kernel` for every variable (replica context)."""
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
                    (var.handle, tf.as_dtype(var.dtype)),
                    None if decay is None else tf.constant(decay, "float32"),
                )
            )
        rule = (self.changes, self.step)  # plain functions (static)
        run = _execution.run
        run(micro_step_kernel, self, rule, grads, handles, scalars, start, keep, jit=jit)

    def _tf_update(self, variables, window, writes):
        if self._updates is None:  # steps == 1: applied in the micro-step
            return
        learning_rate = self.learning_rate
        for var in variables:
            update = self._updates[_compat.variable_index(self, var)]

            def apply_update(variable, update):
                if update.dtype != variable.dtype:  # float32 A of a bfloat16 variable
                    decay = self._decay_of(variable, learning_rate)
                    theta = tf.convert_to_tensor(variable)
                    writes.assign(variable, kernels.minus(theta, update, decay))
                    return
                self._decay(variable, tf.cast(learning_rate, variable.dtype))
                # theta = theta - A
                writes.assign_sub(variable, update)

            _replicas.update_each([var], apply_update, update.value)


def micro_step_kernel(rule, grads, handles, scalars, start, keep=True):
    """The rule's micro-step on handles (`_execution.run`): moments, then
    A = step (start) or A + step; without A, theta = decayed(theta) - step.
    `handles`: (m, v, A or None, (theta, dtype), decay) per variable;
    `scalars`: (alphas by dtype name, 1 - beta_1, 1 - beta_2, epsilon, lr).
    `keep` False: nothing moves but A = 0 at the window's start."""
    changes, step_of = rule
    alphas, rate_1, rate_2, epsilon, learning_rate = scalars
    for g, (m_handle, v_handle, a_handle, (theta_handle, theta_dtype), decay) in zip(
        grads, handles
    ):
        dtype = g.dtype
        alpha = alphas.get(dtype.name, alphas.get("float32"))
        cast = lambda x, dtype=dtype: tf.cast(x, dtype)
        factor = None if isinstance(keep, bool) else cast(keep)
        if keep is False:
            if a_handle is not None and start is not False:
                a = _execution.read(a_handle, dtype)
                _execution.write(
                    a_handle, _execution.where(start, _execution.zeros_like_state(a), a)
                )
            continue
        m, v = _execution.read(m_handle, dtype), _execution.read(v_handle, dtype)
        # m += (g - m)(1 - beta_1); v += (g**2 - v)(1 - beta_2)
        dm, dv = changes(m, v, g, cast(rate_1), cast(rate_2))
        if factor is not None:  # a skipped micro-step moves nothing
            dm, dv = dm * factor, dv * factor
        m, v = m + dm, v + dv
        _execution.write(m_handle, m)
        _execution.write(v_handle, v)
        step = step_of(m, v, cast(alpha), cast(epsilon))
        if factor is not None:
            step = step * factor
        if a_handle is None:
            # In the step's dtype: one rounding, at the write.
            theta = _execution.read(theta_handle, theta_dtype)
            wide = theta if theta_dtype == dtype else cast(theta)
            if decay is not None:
                # theta = theta - theta * weight_decay * lr
                rate = cast(learning_rate) if factor is None else cast(learning_rate) * factor
                wide = equations.decayed(wide, cast(decay), rate)
            wide = wide - step
            _execution.write(
                theta_handle, wide if theta_dtype == dtype else tf.cast(wide, theta_dtype)
            )
            continue
        # A = (0 at the start, else A) + step: XLA updates A in place.
        zero = tf.zeros((), dtype)
        a = zero if start is True else _execution.read(a_handle, dtype)
        _execution.write(a_handle, _execution.where(start, zero, a) + step)
