"""InvariantAdam on TensorFlow: replica-local moments, each replica's
gradient a micro-batch, one batched all-reduce per window.

The rule (`keras_accum.invariant_adam`) says what a micro-batch and a
window's end compute; this is how TensorFlow runs it under `tf.distribute`:
each replica folds its own gradient into its own m_r and v_r (the replica
factor undone before squaring), a large `Embedding`'s gradient row by row
(`folds.fold_rows`), the dense ones in one compiled kernel per replica
(`folds.fold_moments`); at the window's end the moments of every replica
are summed in one all-reduce and the update runs on each variable's
devices.
"""

import functools

from keras_accum import _compat, _execution, _replicas, _tensors, equations, folds
from keras_accum._backend import tf


class InvariantAdamForm:
    """The TensorFlow form of `keras_accum.InvariantAdam` (a mixin)."""

    def _tf_fold(self, grads, variables, weight, start):
        # Replica context, replica-local moments: no communication.
        replicas = _replicas.count()
        moments = [
            (self._momentums[i], self._velocities[i])
            for i in (_compat.variable_index(self, v) for v in variables)
        ]
        # A large Embedding's gradient (`tf.IndexedSlices`) stays sparse: its
        # rows go into m and v where they fall (`folds.fold_rows`), unless
        # the micro-batch is clipped or every window is one micro-batch
        # (Keras Adam's dense arithmetic there).
        sparse = not (self._single_step() or self._clips())
        keep = lambda g, v: _tensors.sparse_or_dense(g, v) if sparse else _tensors.dense(g)
        grads = [keep(g, v) for g, v in zip(grads, variables)]
        cast = lambda g, dtype: _tensors.map_values(lambda x: tf.cast(x, dtype), g)
        grads = [cast(g, m.dtype) for g, (m, _) in zip(grads, moments)]
        # A skipped micro-batch (ok False) counts as a zero gradient: the
        # window's decay of m and v still happens.
        grads, ok = self._screen(grads, mask=False)
        if self._single_step():
            _, rate_1, rate_2 = self._window_factors(replicas)

            def fold_keras_form(ok):
                if ok is False:  # a skipped micro-batch: a zero gradient
                    kept = [tf.zeros((), g.dtype) for g in grads]
                else:
                    kept = [_execution.where(ok, g, tf.zeros((), g.dtype)) for g in grads]
                    kept = self._clip_micro_batch(kept, replicas)
                folds.keras_moments(kept, moments, rate_1, rate_2, replicas, self.assign_add)

            _execution.by_condition(fold_keras_form, ok)
            return
        grads = self._clip_micro_batch(grads, replicas)
        scalars = self._fold_scalars(replicas, start)
        rows = [(g, mv) for g, mv in zip(grads, moments) if isinstance(g, tf.IndexedSlices)]
        dense = [(g, mv) for g, mv in zip(grads, moments) if not isinstance(g, tf.IndexedSlices)]
        if rows:
            fold_rows = lambda start: folds.fold_rows(*zip(*rows), scalars, start, ok)
            _execution.by_condition(fold_rows, start)
        if dense:
            grads = [g for g, _ in dense]
            handles = [(m.handle, v.handle) for _, (m, v) in dense]
            jit = _execution.worth_compiling(grads)
            _execution.run(folds.fold_moments, self, grads, *zip(*handles), scalars, ok, jit=jit)

    def _fold_scalars(self, replicas, start):
        """(steps, replicas / steps, 1 - beta_1,k, 1 - beta_2,k, first) as
        float32 scalars: g_j / kappa = g / steps and g_j**2 / kappa =
        g**2 * replicas / steps (g = g_r / replicas: the replica factor is
        undone before squaring); first = 1 at the window's start, else 0."""
        steps, beta_1_rate, beta_2_rate = self._window_factors(replicas)
        values = (steps, replicas / steps, beta_1_rate, beta_2_rate, start)
        return tuple(tf.cast(x, "float32") for x in values)

    def _tf_update(self, variables, window, writes):
        learning_rate = self.learning_rate
        update_count = _compat.update_counter(self) + 1
        if self.scaling_rule is not None:
            learning_rate, update_count = self._scaled_rate(_replicas.count())
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
            _replicas.update_each([var], apply, m_total, v_total, learning_rate, update_count)
            if replicated:
                # Spread the totals back evenly over the replicas.
                _replicas.assign_total(m, _replicas.local_value(m_total))
                _replicas.assign_total(v, _replicas.local_value(v_total))

    def _reduce_moments(self, variables, moments):
        """[(sum of m_r, sum of v_r)] per variable, each on the devices of
        its variable: every replica-local moment in one batched all-reduce,
        the window's one communication."""

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

    def _apply_moments(self, variable, m, v, learning_rate, update_count, writes):
        if self.scaling_rule is None:
            alpha = self._adam_alpha(learning_rate, update_count, variable.dtype)
        else:  # `update_count` is the bias correction, see `_scaled_rate`
            alpha = tf.cast(learning_rate * update_count, variable.dtype)
        self._decay(variable, tf.cast(learning_rate, variable.dtype))
        # theta = theta - alpha_k m / (sqrt(v) + epsilon)
        writes.assign_sub(variable, equations.adam_step(m, v, alpha, self.epsilon))
