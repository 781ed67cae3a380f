"""What a micro-batch weighs: `apply(weight=...)` and `weigh_micro_batches`.

`GradientAccumulation` averages a window's micro-batches weighted by their
item (or token) counts, the exact big-batch mean. The custom loop passes
each count as `optimizer.apply(grads, vars, weight=n)`. Under `model.fit`,
Keras's `train_step` calls `apply` without one; `weigh_micro_batches(model)`
makes the count reach `apply` all the same.

How it travels under `model.fit` (the one place it does): Keras's
`LossScaleOptimizer` (mixed precision) calls the wrapped optimizer's `apply`
from threads of its own and takes no extra argument, so the count cannot be
passed down the call. `weigh_micro_batches` wraps the model's
`compute_loss`, which records the denominator Keras divides the loss by for
the step being traced, keyed by replica (`pending_weight` reads it back in
`GradientAccumulation.apply`), and its `train_step`, which clears it.
"""

import collections
import threading

import keras
import numpy as np
import tensorflow as tf

from keras_accum import _replicas
from keras_accum.validation import check_float

# `apply(weight=ReplicaItems(n))`: n items (or tokens: the loss denominator)
# on this replica, gradients in the model.fit convention (this replica's mean
# gradient / replicas). Set by `weigh_micro_batches`.
ReplicaItems = collections.namedtuple("ReplicaItems", ["items"])

# The loss denominator of the micro-batch being traced on this thread, set
# by `weigh_micro_batches`. MirroredStrategy traces each replica on its own
# thread, so this is each replica's own count.
_fit_items = threading.local()
# The same by replica id, while a weighed `train_step` is traced: a
# `LossScaleOptimizer` around us calls `apply` from threads of its own.
_fit_items_by_replica = {}


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
    optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)  # a loss scaler's
    if getattr(optimizer, "takes_weights", True) is False:
        raise ValueError(
            f"`weigh_micro_batches` has no effect with {type(optimizer).__name__}, which "
            "averages micro-batches equally; compile with GradientAccumulation(...) "
            f"to weigh them. Received: optimizer={optimizer.name!r}"
        )
    original_step, original_loss = model.train_step, model.compute_loss
    pass_training = getattr(model, "_compute_loss_has_training_arg", True)

    def compute_loss(x=None, y=None, y_pred=None, sample_weight=None, training=True):
        if getattr(_fit_items, "active", False):
            # The loss as compiled now: a later `compile` may change it.
            reduction = _reduction(model)
            _fit_items.value = loss_denominator(reduction, x, y_pred, sample_weight)
            _fit_items_by_replica[_replicas.replica_id()] = _fit_items.value
        if pass_training:
            return original_loss(x, y, y_pred, sample_weight, training=training)
        return original_loss(x, y, y_pred, sample_weight)

    def train_step(data):
        _fit_items.active = True
        try:
            return original_step(data)
        finally:
            _fit_items.active, _fit_items.value = False, None
            _fit_items_by_replica.pop(_replicas.replica_id(), None)

    model.compute_loss = compute_loss
    model.train_step = train_step
    model.train_function = None  # rebuild with the new step
    return model


def pending_weight():
    """The loss denominator `weigh_micro_batches` recorded for the step
    being traced on this replica, as `ReplicaItems`, or None."""
    items = getattr(_fit_items, "value", None)
    if items is None:
        items = _fit_items_by_replica.get(_replicas.replica_id())
    return None if items is None else ReplicaItems(items)


def check_weight(weight):
    """`apply(weight=...)`: None (1), a number > 0 or a scalar tensor (its
    value checked when eager), or `ReplicaItems`."""
    if weight is None:
        return 1.0
    if isinstance(weight, ReplicaItems):
        return weight
    error = f"`weight` must be a scalar number > 0. Received: weight={weight!r}"
    if isinstance(weight, bool):
        raise ValueError(error)
    if isinstance(weight, (int, float, np.number)):
        return check_float("weight", weight, minimum=0.0, open_minimum=True)
    if isinstance(weight, np.ndarray):
        if weight.shape != ():
            raise ValueError(error)
        return check_float("weight", float(weight), minimum=0.0, open_minimum=True)
    shape = getattr(weight, "shape", None)
    if shape is None or tf.TensorShape(shape).rank not in (0, None):
        raise ValueError(error)
    if not tf.is_symbolic_tensor(weight) and hasattr(weight, "numpy"):
        if not float(weight.numpy()) > 0:
            raise ValueError(error)
    return weight
