"""`layers.BatchNormalization` on TensorFlow: replica-local sums, moved at
the optimizer's `on_window_end` after one all-reduce. See docs/BATCH_NORM.md.
"""

from keras import ops

from keras_accum import _compat, _replicas
from keras_accum._backend import tf


class BatchNormalizationForm:
    """The TensorFlow form of `keras_accum.layers.BatchNormalization`."""

    def _local_scope(self):
        """The sums are replica-local (a read sees the total)."""
        return _replicas.sync_on_read()

    def _calling_model(self):
        return _compat.calling_model()

    def _follow(self, optimizer):
        optimizer.on_window_end(self._end_window)
        optimizer._on_each_apply(self._count_from)

    def _fold_micro_batch(self, inputs, mask, mean, variance, optimizer):
        self._fold(inputs, mask, mean, variance)

    def _count_from(self, optimizer):
        """After each `apply`: the optimizer's count, as JAX's and PyTorch's
        layer keeps its own (`_count`), so that they go on from a saved file."""
        window = optimizer._window
        step = ops.convert_to_tensor(window.micro_step)
        if window.end is None:  # an integer `steps`: windows end at its multiples
            steps = optimizer.steps
            size, end = ops.full_like(step, steps), (step + steps - 1) // steps * steps
        else:
            size, end = window.size, window.end
        for counter, value in zip(self._counters(), (step, size, end)):
            counter.assign(ops.cast(value, counter.dtype))

    def _fold(self, inputs, mask, mean, variance):
        """Replica context: this micro-batch into this replica's sums."""
        channels = self.window_sum.shape[0]
        items = tf.size(inputs, out_type=tf.int64) // channels
        terms = self._window_terms(inputs, mask, mean, variance, items)
        # S1 += n_i (mu_i - c); S2 += n_i (s_i^2 + (mu_i - c)^2); N += n_i
        for total, term in zip([self.window_sum, self.window_square_sum, self.window_count], terms):
            total.assign_add(term)

    def _end_window(self, keep=None):
        """`on_window_end`: the sums in one all-reduce, the statistics moved,
        the sums restarted; with `keep` (XLA) writes only where it holds."""
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
