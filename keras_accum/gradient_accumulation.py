"""Gradient accumulation around any Keras optimizer."""

import threading
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf
from keras import optimizers, saving

from keras_accum import base, schedules

# The loss denominator of the micro-batch being traced on this thread, set
# by `weigh_micro_batches`. MirroredStrategy traces each replica on its own
# thread, so this is each replica's own count.
_fit_items = threading.local()
# The same by replica id, while a weighed `train_step` is traced: a
# `LossScaleOptimizer` around us calls `apply` from threads of its own.
_fit_items_by_replica = {}


def _replica_id():
    context = tf.distribute.get_replica_context()
    if context is None:
        return None
    replica = tf.get_static_value(context.replica_id_in_sync_group)
    return None if replica is None else int(replica)


ReplicaItems = base.ReplicaItems

MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


def _single_loss(model):
    """The model's one compiled loss (a `Loss`, a name or a function)."""
    loss = model.loss
    if isinstance(loss, dict) and len(loss) == 1:
        loss = next(iter(loss.values()))
    if isinstance(loss, (list, tuple)) and len(loss) == 1:
        loss = loss[0]
    return loss


def _reduction(model):
    loss = _single_loss(model)
    if isinstance(loss, (dict, list, tuple)):
        reductions = [
            getattr(x, "reduction", "sum_over_batch_size") for x in keras.tree.flatten(loss)
        ]
        if "mean_with_sample_weight" in reductions:
            raise ValueError(
                "`weigh_micro_batches` needs one loss when a loss has "
                "reduction='mean_with_sample_weight' (several token means "
                f"have no common denominator). Received: model.loss={loss!r}"
            )
        return None  # several per-item means: weigh by batch size
    reduction = getattr(loss, "reduction", "sum_over_batch_size")
    if reduction not in MEAN_REDUCTIONS:
        raise ValueError(
            "`weigh_micro_batches` needs a loss averaged over items or tokens "
            f"(reduction in {MEAN_REDUCTIONS}). Received: reduction={reduction!r}"
        )
    return reduction


def loss_denominator(reduction, x, y_pred, sample_weight):
    """The number Keras divides the micro-batch's summed loss by: the sum of
    the sample weights (times the Keras mask) for
    `reduction="mean_with_sample_weight"`, the number of unmasked entries
    when `y_pred` carries a mask, else the batch size (proportional to the
    element count, which is all the weighting needs)."""
    mask = None
    if reduction is not None and not isinstance(y_pred, (dict, list, tuple)):
        mask = getattr(y_pred, "_keras_mask", None)  # Keras's mask on a tensor
    weights = None
    if reduction == "mean_with_sample_weight" and sample_weight is not None:
        weights = tf.cast(keras.tree.flatten(sample_weight)[0], "float32")
    if mask is not None:
        mask = tf.cast(mask, "float32")
        if weights is None:
            weights = mask
        else:
            # Keras expands the lower-rank one by trailing axes.
            while len(weights.shape) < len(mask.shape):
                weights = weights[..., None]
            while len(mask.shape) < len(weights.shape):
                mask = mask[..., None]
            weights = weights * mask
        if reduction != "mean_with_sample_weight":
            weights = mask  # sum(l * w * mask) / (unmasked count)
    if weights is not None:
        return tf.reduce_sum(weights)
    first = next(t for t in keras.tree.flatten(x) if t is not None)
    return tf.cast(tf.shape(first)[0], "float32")


def weigh_micro_batches(model: keras.Model) -> keras.Model:
    """Makes `model.fit` weight the window mean by each micro-batch's loss
    denominator.

    Keras's `train_step` does not tell the optimizer what a batch's loss was
    averaged over, so by default `GradientAccumulation` under `model.fit`
    averages micro-batches equally: the mean of means, wrong when the last
    batch of an epoch is short or when a token-mean loss
    (`reduction="mean_with_sample_weight"` with padding masked by sample
    weights, or a Keras mask) sees unequal token counts. After
    `weigh_micro_batches(model)`, each replica passes the denominator Keras
    divided its summed loss by (tokens with nonzero weight, items), and the
    window mean is sum_r D_r g_r / sum_r D_r: exactly the big batch, on one
    device or across replicas. Needs one loss for token means. Call it after
    `compile`; it holds through later `compile` calls (the loss is read when
    the step is traced), not through `keras.models.load_model`, which
    builds a new model: call it again there. Returns `model`.
    """
    if not isinstance(model, keras.Model):
        raise ValueError(f"`model` must be a `keras.Model`. Received: model={model!r}")
    if not getattr(model, "compiled", False):
        raise ValueError(
            "`weigh_micro_batches` must be called after `model.compile`. "
            f"Received: model={model.name!r} (not compiled)"
        )
    _reduction(model)  # refuse a loss it cannot weigh now, not at the first step
    original_step, original_loss = model.train_step, model.compute_loss
    pass_training = getattr(model, "_compute_loss_has_training_arg", True)

    def compute_loss(x=None, y=None, y_pred=None, sample_weight=None, training=True):
        if getattr(_fit_items, "active", False):
            # The loss as compiled now: a later `compile` may change it.
            reduction = _reduction(model)
            _fit_items.value = loss_denominator(reduction, x, y_pred, sample_weight)
            _fit_items_by_replica[_replica_id()] = _fit_items.value
        if pass_training:
            return original_loss(x, y, y_pred, sample_weight, training=training)
        return original_loss(x, y, y_pred, sample_weight)

    def train_step(data):
        _fit_items.active = True
        try:
            return original_step(data)
        finally:
            _fit_items.active, _fit_items.value = False, None
            _fit_items_by_replica.pop(_replica_id(), None)

    model.compute_loss = compute_loss
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
    * Sparse gradients (`tf.IndexedSlices`, from `Embedding`) of a
      variable with 65,536 elements or more (`base.SPARSE_MIN_ELEMENTS`)
      stay sparse: each micro-batch's rows are added to S where they fall
      (the sum is dense; the window's mean handed to `optimizer` is dense).
      Smaller ones are made dense first.

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
        nonfinite: `"skip_window"` (default: a window whose sums hold a NaN
            or an Inf is dropped, as the big batch would be; checked once
            per window), `"skip_micro_batch"` (leaves the bad micro-batch
            out and averages the rest; one more read of every gradient per
            micro-batch), `"raise"` or None; see `keras_accum.base`.
        name: optimizer name.
    """

    _checks_window_sums = True  # "skip_window": see `_read_window`

    def __init__(
        self,
        optimizer: optimizers.Optimizer,
        steps: Any = 1,
        nonfinite: str | None = "skip_window",
        name: str | None = None,
    ):
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
        if isinstance(optimizer, optimizers.LossScaleOptimizer):
            raise ValueError(
                "`optimizer` is a `LossScaleOptimizer`: it would unscale "
                "the accumulated window at the wrong moment. Put the loss "
                "scaler outside: LossScaleOptimizer(GradientAccumulation(...)) "
                "(what `model.compile` does under mixed_float16). "
                f"Received: optimizer={optimizer!r}"
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
        self._restore_deferred_state()

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

    def apply(
        self,
        grads: Sequence[Any],
        trainable_variables: Sequence[Any] | None = None,
        weight: Any = None,
    ) -> None:
        items = getattr(_fit_items, "value", None)
        if items is None:
            items = _fit_items_by_replica.get(_replica_id())
        if weight is None and items is not None:
            weight = ReplicaItems(items)
        super().apply(grads, trainable_variables, weight=weight)

    def _accumulate(self, distribution, grads, variables, weight, start):
        distribution.extended.call_for_each_replica(
            self._fold, args=(grads, variables, weight, start)
        )

    def _fold(self, grads, variables, weight, start):
        # Replica context, replica-local state only: no communication.
        accumulators = self._accumulators_of(variables)
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
        # A large Embedding's gradient stays sparse (`tf.IndexedSlices`): it
        # is added to S_r row by row, never made parameter-sized.
        grads = [base.sparse_or_dense(g, v) for g, v in zip(grads, variables)]
        grads = [base.map_values(lambda x: tf.cast(x, "float32"), g) for g in grads]
        scaled = lambda g: base.map_values(lambda x: scale * x, g)
        wgs = lambda grads: grads if unit_weight else [scaled(g) for g in grads]
        if not base.in_xla():
            self._fold_graph(accumulators, grads, wgs, share, start)
            return
        if self.nonfinite == "skip_window":
            # Under XLA the check fuses into the fold; a bad micro-batch
            # adds zeros to S_r (kept finite) and NaN to W_r, which the
            # window's end then reads as "drop" (a scalar, no read of S_r).
            ok = base.all_finite(grads)
            keep = lambda x: tf.where(ok, x, tf.zeros((), x.dtype))
            grads = [base.map_values(keep, g) for g in grads]
            share = tf.where(ok, share, tf.constant(float("nan"), "float32"))
        else:
            grads, ok = self._screen(grads)
            if ok is not None:
                # A skipped micro-batch (zeroed by `_screen`) adds no weight.
                share = share * tf.cast(ok, "float32")
        for a, wg in zip(accumulators, wgs(grads)):
            # S_r = w g at the window's start (whatever came before, also
            # when this micro-batch is skipped), else S_r + w g
            if isinstance(wg, tf.IndexedSlices):
                # S_r = 0 at the window's start (fused, in place), then the
                # rows of w g: no dense gradient, which XLA builds with a
                # scatter into zeros and one more pass.
                a.assign(tf.where(start, tf.zeros((), a.dtype), a))
                base.scatter_add(a, wg)
            else:
                a.assign(tf.where(start, wg, a + wg))
        # W_r = w at the window's start, else W_r + w
        self._weight.assign(tf.where(start, share, self._weight + share))

    def _fold_graph(self, accumulators, grads, wgs, share, start):
        """The fold of `_fold` in graph mode: the same state, with branches
        instead of masks (a `cond` costs nothing there, a mask a full pass)."""
        if self.nonfinite == "skip_window":
            ok = None  # the window's sums are checked at its end (`_read_window`)
        else:
            grads, ok = self._screen(grads, mask=False)

        def put():  # S_r = w g, W_r = w
            for a, wg in zip(accumulators, wgs(grads)):
                if isinstance(wg, tf.IndexedSlices):  # zeros, then its rows
                    a.assign(base.zeros_like_state(a))
                    base.scatter_add(a, wg)
                else:
                    a.assign(wg)
            self._weight.assign(share)

        def add():  # S_r += w g, W_r += w
            for a, wg in zip(accumulators, wgs(grads)):
                if isinstance(wg, tf.IndexedSlices):  # the rows it holds
                    base.scatter_add(a, wg)
                else:
                    a.assign_add(wg)
            self._weight.assign_add(share)

        def reset():  # A skipped first micro-batch: S_r = 0, W_r = 0.
            self._zero_window(accumulators)

        if ok is None:
            tf.cond(start, put, add)
        else:
            tf.cond(start, lambda: tf.cond(ok, put, reset), lambda: tf.cond(ok, add, lambda: None))

    def _zero_window(self, accumulators):
        """S_r = 0, W_r = 0 (replica context)."""
        for a in accumulators:
            a.assign(base.zeros_like_state(a))
        self._weight.assign(0.0)

    def _read_window(self, distribution, variables):
        """(W, whether S is finite: None when not checked here)."""
        if self.nonfinite != "skip_window":
            return base.read_total(self._weight), None  # W, summed over replicas
        if base.in_xla():
            total_weight = base.read_total(self._weight)
            # Under XLA a bad micro-batch made W NaN (`_fold`).
            return total_weight, tf.math.is_finite(total_weight)
        # Graph mode: NaN and Inf propagate into the window's sums, so one
        # check of each S_r per window (in the window end's branch) replaces
        # a check of every micro-batch, reduced with W in the window's one
        # scalar reduction.
        accumulators = self._accumulators_of(variables)

        def local():  # (W_r, 1.0 where S_r holds a NaN or an Inf)
            finite = base.all_finite([a.value for a in accumulators])
            return tf.stack([self._weight.value, 1.0 - tf.cast(finite, "float32")])

        totals = distribution.extended.call_for_each_replica(local)
        totals = distribution.reduce(tf.distribute.ReduceOp.SUM, totals, axis=None)
        return totals[0], tf.equal(totals[1], 0.0)

    def _drop_window(self, distribution, variables, dropped=None):
        if self.nonfinite != "skip_window":
            return  # the sums are finite: bad micro-batches never entered
        accumulators = self._accumulators_of(variables)

        def reset():  # no NaN left behind (the next window overwrites them)
            if not base.in_xla():  # the drop branch of a `cond`: S_r may hold NaN
                self._zero_window(accumulators)
            elif dropped is None:  # XLA, a `cond` (replicas): S_r stayed finite
                self._weight.assign(0.0)
            else:  # XLA, every micro-step: W_r is NaN after a bad micro-batch
                self._weight.assign(tf.where(dropped, 0.0, self._weight.value))

        distribution.extended.call_for_each_replica(reset)

    def _accumulators_of(self, variables):
        return [self._accumulators[self._get_variable_index(v)] for v in variables]

    def _window_ok(self, window):
        total_weight, finite = window
        if self.nonfinite == "skip_micro_batch":
            # Every micro-batch of the window skipped: nothing to apply.
            return total_weight > 0.0
        return finite if self.nonfinite == "skip_window" else None

    def _update(self, distribution, variables, window):
        total_weight, _ = window
        accumulators = self._accumulators_of(variables)
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
                    [tf.where(first, m, tf.zeros((), m.dtype)) for m in means],
                    variables,
                )

            distribution.extended.call_for_each_replica(apply_inner, args=(means,))
        else:
            # Each replica hands S_r / W; the inner optimizer's all-reduce
            # (SUM) turns it into S / W: one communication per window.
            def apply_inner(total_weight):
                inner.apply([a.value / total_weight for a in accumulators], variables)

            distribution.extended.call_for_each_replica(apply_inner, args=(total_weight,))

    def _finish_update(self, distribution, variables):
        pass  # the inner optimizer applies its EMA and constraints itself

    def _updating_optimizers(self):
        return [self, self.inner_optimizer]

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
