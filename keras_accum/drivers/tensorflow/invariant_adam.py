"""InvariantAdam on TensorFlow: each replica's gradient a micro-batch,
folded into its replica-local m_r, v_r (`fold_dense`: one compiled kernel;
`fold_rows`: sparse rows); at the window's end one batched all-reduce.
"""

import functools

from keras_accum import _compat, _replicas, equations, kernels
from keras_accum._backend import tf
from keras_accum.drivers.tensorflow import _execution


class InvariantAdamForm:
    """The TensorFlow form of `keras_accum.InvariantAdam` (a mixin)."""

    def _tf_fold(self, grads, variables, weight, start):
        # Replica context, replica-local moments: no communication.
        replicas = _replicas.count()
        moments = [
            (self._momentums[i], self._velocities[i])
            for i in (_compat.variable_index(self, v) for v in variables)
        ]
        # Sparse rows (`fold_rows`), unless clipped or `steps` is 1 (dense).
        sparse = not (self._single_step() or self._clips())
        keep = lambda g, v: _execution.sparse_or_dense(g, v) if sparse else _execution.dense(g)
        grads = [keep(g, v) for g, v in zip(grads, variables)]
        cast = lambda g, dtype: _execution.map_values(lambda x: tf.cast(x, dtype), g)
        grads = [cast(g, m.dtype) for g, (m, _) in zip(grads, moments)]
        # A skipped micro-batch is a zero gradient: m and v still decay.
        grads, ok = self._screen(grads, mask=False)
        if self._single_step():
            _, rate_1, rate_2 = self._window_factors(replicas)

            def fold_keras_form(ok):
                if ok is False:  # a skipped micro-batch: a zero gradient
                    kept = [tf.zeros((), g.dtype) for g in grads]
                else:
                    kept = [_execution.where(ok, g, tf.zeros((), g.dtype)) for g in grads]
                    kept = self._clip_micro_batch(kept, replicas)
                keras_moments(kept, moments, rate_1, rate_2, replicas, self.assign_add)

            _execution.by_condition(fold_keras_form, ok)
            return
        grads = self._clip_micro_batch(grads, replicas)
        scalars = self._fold_scalars(replicas, start)
        rows = [(g, mv) for g, mv in zip(grads, moments) if isinstance(g, tf.IndexedSlices)]
        dense = [(g, mv) for g, mv in zip(grads, moments) if not isinstance(g, tf.IndexedSlices)]
        if rows:
            rule = (self.fold_factors, self.increments)
            fold = lambda start: fold_rows(rule, *zip(*rows), scalars, start, ok)
            _execution.by_condition(fold, start)
        if dense:
            grads = [g for g, _ in dense]
            handles = [(m.handle, v.handle) for _, (m, v) in dense]
            jit = _execution.worth_compiling(grads)
            rule = (self.fold_factors, self.fold)  # plain functions (static)
            _execution.run(fold_dense, self, rule, grads, *zip(*handles), scalars, ok, jit=jit)

    def _fold_scalars(self, replicas, start):
        """(steps, replicas / steps, 1 - beta_1,k, 1 - beta_2,k, first),
        float32: g_j / kappa = g / steps, g_j**2 / kappa = g**2 replicas / steps."""
        steps, beta_1_rate, beta_2_rate = self._window_factors(replicas)
        values = (steps, replicas / steps, beta_1_rate, beta_2_rate, start)
        return tuple(tf.cast(x, "float32") for x in values)

    def _tf_update(self, variables, window, writes):
        learning_rate, correction = self.rate_and_correction(_replicas.count())
        moments = [
            (self._momentums[i], self._velocities[i])
            for i in (_compat.variable_index(self, v) for v in variables)
        ]
        replicated = _replicas.count() > 1
        if replicated:
            totals = self._reduce_moments(variables, moments)
        else:
            totals = [(m.value, v.value) for m, v in moments]
        for var, (m, v), (m_total, v_total) in zip(variables, moments, totals):
            apply = functools.partial(self._apply_moments, writes=writes)
            _replicas.update_each([var], apply, m_total, v_total, learning_rate, correction)
            if replicated:
                # Spread the totals back evenly over the replicas.
                _replicas.assign_total(m, _replicas.local_value(m_total))
                _replicas.assign_total(v, _replicas.local_value(v_total))

    def _reduce_moments(self, variables, moments):
        """[(sum m_r, sum v_r)] per variable, in one batched all-reduce."""

        def local():  # replica context: this replica's m_r, v_r
            return [(m.value, v.value) for m, v in moments]

        parts = _replicas.for_each_replica(local)
        pairs = [
            (part, var)
            for var, (m_part, v_part) in zip(variables, parts)
            for part in (m_part, v_part)
        ]
        totals = _replicas.sum_over_replicas(pairs)
        return list(zip(totals[::2], totals[1::2]))

    def _apply_moments(self, variable, m, v, learning_rate, correction, writes):
        alpha = self.alpha(learning_rate, correction, m.dtype)
        if m.dtype != variable.dtype:  # float32 state of a bfloat16 variable: one rounding
            step = self.step(m, v, alpha, self.epsilon)
            decay = self._decay_of(variable, learning_rate)
            theta = tf.convert_to_tensor(variable)
            writes.assign(variable, kernels.minus(theta, step, decay))
            return
        self._decay(variable, tf.cast(learning_rate, variable.dtype))
        # theta = theta - alpha_k m / (sqrt(v) + epsilon)
        writes.assign_sub(variable, self.step(m, v, alpha, self.epsilon))


def fold_dense(rule, grads, m_handles, v_handles, scalars, ok=None):
    """The rule's fold of dense gradients on handles (`_execution.run`).
    `rule`: (fold_factors, fold); `scalars`: `_fold_scalars`; `ok` False: a
    zero gradient (take 0, `multiply_no_nan` zeroes NaN)."""
    fold_factors, fold = rule
    steps, square_factor, rate_1, rate_2, first = scalars
    # The factors once; the fold per variable in its dtype.
    keep, take = fold_factors(first, steps, square_factor, rate_1, rate_2)
    if ok is not None:
        take = tuple(tf.where(ok, t, 0.0) for t in take)
    for g, m_handle, v_handle in zip(grads, m_handles, v_handles):
        dtype = g.dtype
        m, v = _execution.read(m_handle, dtype), _execution.read(v_handle, dtype)
        cast = lambda xs, dtype=dtype: tuple(tf.cast(x, dtype) for x in xs)
        m, v = fold(m, v, g, cast(keep), cast(take), times=tf.math.multiply_no_nan)
        _execution.write(m_handle, m)
        _execution.write(v_handle, v)


def fold_rows(rule, grads, moments, scalars, start, ok=None):
    """`fold_dense` for `tf.IndexedSlices` (the fold is affine): the decay
    where `start` holds, then `increments` of the combined rows scattered."""
    fold_factors, increments = rule
    steps, square_factor, rate_1, rate_2, _ = scalars
    first = (
        _execution.where(start, 1.0, 0.0) if isinstance(start, bool) else tf.cast(start, "float32")
    )
    (keep_1, keep_2), take = fold_factors(first, steps, square_factor, rate_1, rate_2)
    if ok is not None:
        take = tuple(tf.where(ok, t, 0.0) for t in take)
    for g, (m, v) in zip(grads, moments):
        dtype = m.dtype
        scalar = lambda x, dtype=dtype: tf.cast(x, dtype)
        if start is not False:  # the window's decay
            m.assign(m * scalar(keep_1))
            v.assign(v * scalar(keep_2))
        rows, values = _execution.combine_rows(g)
        if ok is not None:  # a skipped micro-batch's NaN rows: zeros
            values = tf.where(ok, values, tf.zeros((), dtype))
        shape = g.dense_shape
        change_m, change_v = increments(values, tuple(scalar(t) for t in take))
        _replicas.scatter_add(m, tf.IndexedSlices(change_m, rows, shape))
        _replicas.scatter_add(v, tf.IndexedSlices(change_v, rows, shape))


def keras_moments(grads, moments, rate_1, rate_2, replicas, assign_add):
    """`steps` = 1: m += (g_j / kappa - m)(1 - beta_1), v likewise with
    g_j**2, in Keras Adam's form (one replica: bit for bit)."""
    for g, (m, v) in zip(grads, moments):
        # g_j**2 / kappa = g**2 * replicas (the replica factor undone)
        square = None if replicas == 1 else tf.square(g) * float(replicas)
        b1, b2 = (
            x if isinstance(x, (int, float)) else tf.cast(x, m.dtype) for x in (rate_1, rate_2)
        )
        change_m, change_v = equations.adam_moment_changes(m, v, g, b1, b2, square)
        assign_add(m, change_m)
        assign_add(v, change_v)
