"""GradientAccumulation on TensorFlow: each replica adds w g to its own S_r
and W_r (sparse rows kept sparse); at the window's end each hands S_r / W to
the inner optimizer, whose all-reduce makes it S / W: one per window.
"""

from keras_accum import _replicas
from keras_accum._backend import tf
from keras_accum.drivers.tensorflow import _execution


class GradientAccumulationForm:
    """The TensorFlow form of `keras_accum.GradientAccumulation` (a mixin)."""

    def _tf_fold(self, grads, variables, weight, start):
        # Replica context, replica-local state only: no communication.
        accumulators = self._accumulators_of(variables)
        scale, share = self.weights(weight, _replicas.count())
        # A large Embedding's rows are added where they fall.
        grads = [_execution.sparse_or_dense(g, v) for g, v in zip(grads, variables)]
        grads = [_execution.map_values(lambda x: tf.cast(x, "float32"), g) for g in grads]
        xla = _execution.in_xla()
        if self._nonfinite_policy.drops_windows:
            ok = None  # graph mode: the window's sums are checked at its end
            if xla:
                # XLA: a bad micro-batch adds zeros to S_r and NaN to W_r,
                # read at the window's end as "drop" (no read of S_r).
                finite = _execution.all_finite(grads)
                keep = lambda x: tf.where(finite, x, tf.zeros((), x.dtype))
                grads = [_execution.map_values(keep, g) for g in grads]
                share = tf.where(finite, share, tf.constant(float("nan"), "float32"))
        else:
            grads, ok = self._screen(grads, mask=xla)
            if ok is not None and xla:
                # A skipped micro-batch (zeroed by `_screen`) adds no weight.
                share = share * tf.cast(ok, "float32")
        if scale is not None:
            grads = [_execution.map_values(lambda x: scale * x, g) for g in grads]

        def fold(start, ok):
            # S_r = w g at the window's start, else S_r + w g; W_r with w.
            # A skipped micro-batch adds nothing (S_r = W_r = 0 at a start).
            for a, wg in zip(accumulators, grads):
                add_to_window(a, wg if ok else None, start)
            add_to_window(self._weight, share if ok else None, start)

        _execution.by_condition(fold, start, None if xla else ok)

    def _tf_read_window(self, variables):
        """((W,), ok): W over replicas; whether the window may be applied."""
        policy = self._nonfinite_policy
        if not policy.drops_windows:
            total_weight = _replicas.read_total(self._weight)
            if policy.empties_windows:
                # Every micro-batch of the window skipped: nothing to apply.
                return (total_weight,), total_weight > 0.0
            return (total_weight,), None
        if _execution.in_xla():
            total_weight = _replicas.read_total(self._weight)
            # Under XLA a bad micro-batch made W NaN (`_tf_fold`).
            return (total_weight,), tf.math.is_finite(total_weight)
        # Graph mode: a NaN propagates into S_r, so one check per window,
        # reduced with W in one scalar reduction.
        accumulators = self._accumulators_of(variables)

        def local():  # (W_r, 1.0 where S_r holds a NaN or an Inf)
            finite = _execution.all_finite([a.value for a in accumulators])
            return tf.stack([self._weight.value, 1.0 - tf.cast(finite, "float32")])

        totals = _replicas.sum_scalars(_replicas.for_each_replica(local))
        return (totals[0],), tf.equal(totals[1], 0.0)

    def _tf_drop_window(self, variables, dropped=None):
        if not self._nonfinite_policy.drops_windows:
            return  # the sums are finite: bad micro-batches never entered
        accumulators = self._accumulators_of(variables)

        def reset():  # no NaN left behind (the next window overwrites them)
            if not _execution.in_xla():  # the drop branch of a `cond`: S_r may hold NaN
                for a in accumulators + [self._weight]:
                    add_to_window(a, None, True)
            elif dropped is None:  # XLA, a `cond` (replicas): S_r stayed finite
                self._weight.assign(0.0)
            else:  # XLA, every micro-step: W_r is NaN after a bad micro-batch
                self._weight.assign(tf.where(dropped, 0.0, self._weight.value))

        _replicas.for_each_replica(reset)

    def _tf_update(self, variables, window, writes):
        (total_weight,) = window
        accumulators = self._accumulators_of(variables)
        inner = self.inner_optimizer
        clips = inner.clipnorm or inner.global_clipnorm or inner.clipvalue
        if _replicas.count() > 1 and clips:
            # The clip must see the global mean: replica 0 gets it whole, the
            # others zeros, so the inner clip then SUM gives clip(S / W).
            means = self.means([_replicas.read_total(a) for a in accumulators], total_weight)

            def apply_inner(means):
                first = _replicas.is_first_replica()
                inner.apply([tf.where(first, m, tf.zeros((), m.dtype)) for m in means], variables)

            _replicas.for_each_replica(apply_inner, means)
        else:
            # S_r / W per replica; the inner all-reduce (SUM) makes S / W.
            def apply_inner(total_weight):
                inner.apply(self.means([a.value for a in accumulators], total_weight), variables)

            _replicas.for_each_replica(apply_inner, total_weight)


def add_to_window(state, value, start):
    """S = value at the window's start, else S + value, in place. `value`:
    a tensor, `tf.IndexedSlices` (rows scattered) or None (adds nothing);
    `start`: a bool or a boolean tensor."""
    if value is None or isinstance(value, tf.IndexedSlices):
        if start is True:
            state.assign(_execution.zeros_like_state(state))
        elif start is not False:  # S = 0 at the start, fused, in place
            state.assign(tf.where(start, tf.zeros((), state.dtype), state))
        if value is not None:
            _replicas.scatter_add(state, value)
    elif start is True:
        state.assign(value)
    elif start is False:
        state.assign_add(value)
    else:
        state.assign(tf.where(start, value, state + value))
