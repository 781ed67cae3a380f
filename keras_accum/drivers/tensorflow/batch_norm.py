"""`keras_accum.layers.BatchNormalization` on TensorFlow: replica-local
sums in the forward pass, the moving statistics moved in the optimizer's
`apply` that ends a window (`on_window_end`), after one all-reduce of the
sums of every replica.

The layer (`keras_accum.layers`) says what the window's statistics and the
move are; this is how TensorFlow follows the optimizer's windows.
"""

from keras import ops

from keras_accum import _compat, _replicas
from keras_accum._backend import tf


class BatchNormalizationForm:
    """The TensorFlow form of `keras_accum.layers.BatchNormalization`."""

    def _local_scope(self):
        """Replica-local (on-read SUM) sums: each replica adds its own part,
        a read in cross-replica context (or a save) sees the total."""
        return _replicas.sync_on_read()

    def _build_counters(self):
        return None  # the optimizer counts the windows (`keras_accum.base.WindowMixin`)

    def load_own_variables(self, store):
        # A file saved on JAX or PyTorch holds three window counters more
        # (TensorFlow counts with the optimizer's): they are left out.
        own = _compat.layer_own_variables(self)
        if len(store.keys()) == len(own) + 3:
            for i, variable in enumerate(own):
                variable.assign(store[f"{i}"])
            return
        super().load_own_variables(store)

    def _calling_model(self):
        return _compat.calling_model()

    def _follow(self, optimizer):
        optimizer.on_window_end(self._end_window)

    def _fold_micro_batch(self, inputs, mask, mean, variance, optimizer):
        self._fold(inputs, mask, mean, variance)

    def _fold(self, inputs, mask, mean, variance):
        """Replica context: this micro-batch into this replica's sums."""
        channels = self.window_sum.shape[0]
        items = tf.size(inputs, out_type=tf.int64) // channels
        terms = self._window_terms(inputs, mask, mean, variance, items)
        # S1 += n_i (mu_i - c); S2 += n_i (s_i^2 + (mu_i - c)^2); N += n_i
        for total, term in zip([self.window_sum, self.window_square_sum, self.window_count], terms):
            total.assign_add(term)

    def _end_window(self, keep=None):
        """Cross-replica, at a window's end (`on_window_end`): the sums of
        every replica in one all-reduce, the moving statistics moved once,
        the sums restarted. With `keep` (a boolean tensor, under XLA on
        one replica) this runs on every micro-step and writes only where
        `keep` holds."""
        sums = [self.window_sum, self.window_square_sum, self.window_count]
        parts = _replicas.for_each_replica(lambda: tf.stack([s.value for s in sums]))
        totals = _replicas.sum_over_replicas([(parts, self.moving_mean)])[0]
        total_sum, total_square_sum, count = tf.unstack(_replicas.local_value(totals))
        # mu - c = S1 / N; s^2 = S2 / N - (mu - c)^2; mu = c + S1 / N
        shifted = tf.math.divide_no_nan(total_sum, count)
        variance = tf.math.divide_no_nan(total_square_sum, count) - tf.square(shifted)
        variance = tf.maximum(variance, 0.0)
        mean = ops.cast(self.moving_mean, shifted.dtype) + shifted
        # A window this layer saw nothing of leaves its statistics alone.
        write = count > 0 if keep is None else tf.logical_and(count > 0, keep)
        optimizer = self._followed() if self._followed is not None else None
        size = 1 if optimizer is None else optimizer.window_steps
        self._move_statistics(mean, variance, write, self._momenta(size))
        for variable in sums:
            rest = tf.zeros(variable.shape, variable.dtype)
            if keep is not None:
                rest = tf.where(keep, rest, _replicas.read_total(variable))
            _replicas.assign_total(variable, rest)
