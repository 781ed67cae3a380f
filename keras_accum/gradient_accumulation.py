"""Gradient accumulation around any Keras optimizer."""

import collections
import threading

import keras
import tensorflow as tf
from keras import optimizers, saving

from keras_accum import base, schedules

# The item count of the micro-batch being traced on this thread, set by
# `weigh_micro_batches`. MirroredStrategy traces each replica on its own
# thread, so this is each replica's own count.
_fit_items = threading.local()

# `apply(weight=ReplicaItems(n))`: n items on this replica, gradients in the
# model.fit convention (this replica's mean gradient / replicas).
ReplicaItems = collections.namedtuple("ReplicaItems", ["items"])


def weigh_micro_batches(model):
    """Makes `model.fit` weight the window mean by micro-batch sizes.

    Keras's `train_step` does not tell the optimizer how many items a batch
    held, so by default `GradientAccumulation` under `model.fit` averages
    micro-batches equally: the mean of means, wrong when the last batch of
    an epoch is short. After `weigh_micro_batches(model)`, each replica
    passes its batch size and the window mean is
    sum_r n_r g_r / sum_r n_r: exactly the big batch (for losses averaged
    over the batch, Keras's default reduction). Call it after `compile`.
    Returns `model`.
    """
    original = model.train_step

    def train_step(data):
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        first = next(t for t in keras.tree.flatten(x) if t is not None)
        _fit_items.value = tf.shape(first)[0]
        try:
            return original(data)
        finally:
            _fit_items.value = None

    model.train_step = train_step
    model.train_function = None  # rebuild with the new step
    return model


@saving.register_keras_serializable(package="keras_accum")
class GradientAccumulation(base.AccumulationOptimizer):
    """Averages micro-batch gradients over a window, then steps `optimizer`.

    For a window of micro-batches j with gradients g_j and weights w_j
    (item or token counts passed as `apply(..., weight=w_j)`, 1 by default):

        S = sum_j w_j * g_j ,  W = sum_j w_j
        at the end of the window:  optimizer.apply(S / W)

    With w_j the number of items, this is exactly one step of `optimizer` on
    the concatenated batch, also when the last micro-batch is short or the
    loss is masked (the mean of means would be wrong there).

    * The inner optimizer only runs at window ends, so its state, its
      `iterations`, weight decay, gradient clipping (`clipnorm`,
      `global_clipnorm`, `clipvalue`, applied to the window mean across all
      replicas), EMA and learning-rate schedules advance once per update.
    * Accumulators are float32 whatever the variables' dtype.
    * Under a `tf.distribute` strategy, the sums stay on each replica until
      the window ends; the inner optimizer's own all-reduce of `S_r / W` is
      then the only gradient communication of the window. With clipping
      configured, the window sum is reduced first so that the clip sees the
      global mean (one more reduction, still once per window).
    * Sparse gradients (`tf.IndexedSlices`, from `Embedding`) are
      accumulated densely.

    Example:

    ```python
    import keras, keras_accum as ka
    model.compile(
        optimizer=ka.GradientAccumulation(keras.optimizers.AdamW(1e-3), steps=4),
        loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=32)   # one AdamW update per 4 x 32 examples
    ```

    Args:
        optimizer: the `keras.optimizers.Optimizer` to step once per window.
        steps: micro-batches per window on each replica: an integer >= 1
            or a schedule (`keras_accum.PiecewiseSteps`, `AdaptiveSteps`).
        nonfinite: `"skip_micro_batch"`, `"skip_window"`, `"raise"` or None;
            see `keras_accum.base`.
        name: optimizer name.
    """

    def __init__(self, optimizer, steps=1, nonfinite="skip_micro_batch", name=None):
        if not isinstance(optimizer, optimizers.Optimizer):
            raise ValueError(
                "`optimizer` must be a `keras.optimizers.Optimizer` instance. "
                f"Received: optimizer={optimizer!r}"
            )
        if isinstance(optimizer, base.AccumulationOptimizer):
            raise ValueError(
                "`optimizer` already accumulates micro-batches; wrapping it "
                f"again would nest windows. Received: optimizer={optimizer!r}"
            )
        if optimizer.gradient_accumulation_steps:
            raise ValueError(
                "`optimizer` has Keras's own `gradient_accumulation_steps`="
                f"{optimizer.gradient_accumulation_steps}; use `steps` here "
                "instead."
            )
        super().__init__(learning_rate=0.0, steps=steps, nonfinite=nonfinite, name=name)
        self.inner_optimizer = optimizer

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._accumulators = [
            self.add_local_variable(v.shape, "float32", "accumulator", reference=v)
            for v in var_list
        ]
        self._weight = self.add_local_variable((), "float32", "weight")
        self.inner_optimizer.build(var_list)

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def apply(self, grads, trainable_variables=None, weight=None):
        items = getattr(_fit_items, "value", None)
        if weight is None and items is not None:
            weight = ReplicaItems(items)
        super().apply(grads, trainable_variables, weight=weight)

    def _accumulate(self, distribution, grads, variables, weight, start):
        distribution.extended.call_for_each_replica(self._fold, args=(grads, variables, weight))

    def _fold(self, grads, variables, weight):
        # Replica context, replica-local state only: no communication.
        accumulators = [self._accumulators[self._get_variable_index(v)] for v in variables]
        replicas = tf.distribute.get_replica_context().num_replicas_in_sync
        unit_weight = isinstance(weight, float) and weight == 1.0
        if isinstance(weight, ReplicaItems):
            # g = (mean gradient over this replica's n items) / replicas, so
            # its summed-loss gradient is n * replicas * g; W counts items.
            items = tf.cast(weight.items, "float32")
            scale, share = items * replicas, items
        else:
            # g is this replica's share of the global mean over `weight`
            # items, so weight * g is its summed-loss gradient. W_r gets an
            # equal share of weight: the sum over replicas is the weight.
            scale = tf.cast(weight, "float32")
            share = scale / replicas

        def weighted(grads):
            grads = [tf.cast(base.dense(g), "float32") for g in grads]
            return grads if unit_weight else [scale * g for g in grads]

        def fold(grads):
            wgs = weighted(grads)
            # A replica that has folded nothing yet in this window starts its
            # sum afresh: S_r = w g (no separate zeroing pass).
            tf.cond(
                tf.equal(self._weight, 0.0),
                lambda: [a.assign(g) for a, g in zip(accumulators, wgs)],
                lambda: [a.assign_add(g) for a, g in zip(accumulators, wgs)],
            )
            self._weight.assign_add(share)

        self._guarded(grads, fold, skip=lambda: None)

    def _read_window(self, distribution):
        return base.read_total(self._weight)  # W, summed over replicas

    def _window_ok(self, total_weight):
        if self.nonfinite == "skip_micro_batch":
            # Every micro-batch of the window skipped: nothing to apply.
            return total_weight > 0.0
        return None

    def _update(self, distribution, variables, total_weight):
        accumulators = [self._accumulators[self._get_variable_index(v)] for v in variables]
        inner = self.inner_optimizer
        clips = inner.clipnorm or inner.global_clipnorm or inner.clipvalue
        if distribution.num_replicas_in_sync > 1 and clips:
            # The clip must see the global window mean: reduce it here, hand
            # it whole to replica 0 and zeros to the others, so that the inner
            # optimizer's per-replica clip then all-reduce (SUM) yields
            # exactly clip(S / W) on every replica.
            means = [base.read_total(a) / total_weight for a in accumulators]

            def apply_inner(means):
                context = tf.distribute.get_replica_context()
                first = tf.equal(context.replica_id_in_sync_group, 0)
                inner.apply(
                    [tf.where(first, m, tf.zeros_like(m)) for m in means],
                    variables,
                )

            distribution.extended.call_for_each_replica(apply_inner, args=(means,))
        else:
            # Each replica hands S_r / W; the inner optimizer's all-reduce
            # (SUM) turns it into S / W: one communication per window.
            def apply_inner(total_weight):
                inner.apply([a.value / total_weight for a in accumulators], variables)

            distribution.extended.call_for_each_replica(apply_inner, args=(total_weight,))

    def _after_window(self, distribution):
        base.assign_total(self._weight, 0.0)

    def get_config(self):
        return {
            "name": self.name,
            "optimizer": saving.serialize_keras_object(self.inner_optimizer),
            "steps": schedules.serialize_steps(self.steps),
            "nonfinite": self.nonfinite,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        optimizer = saving.deserialize_keras_object(
            config.pop("optimizer"), custom_objects=custom_objects
        )
        return cls(optimizer, **config)
