"""What a micro-batch weighs: `apply(weight=...)` and `weigh_micro_batches`.

`GradientAccumulation` averages a window's micro-batches weighted by their
item (or token) counts, the exact big-batch mean. The custom loop passes
each count as `optimizer.apply(grads, vars, weight=n)`. Under `model.fit`,
Keras's `train_step` calls `apply` without one; `weigh_micro_batches(model)`
makes the count reach `apply` all the same.

How it travels under `model.fit`: the optimizer owns a replica-local
variable (`GradientAccumulation.fit_items()`, one value per replica, not
part of its saved state). `weigh_micro_batches` wraps the loss the model was
compiled with (`model.compile(loss=...)`, which Keras's `compute_loss`
calls with the micro-batch's targets, predictions and sample weights); the
wrapper writes the denominator Keras divides that loss by into the
variable, and `apply`, called later in the same step, reads it and resets
it to `UNSET` (-1: a count of 0 is a real one, a micro-batch whose items
all weigh zero). Nothing is set on the model's or the optimizer's methods, and
nothing passes outside a variable (Keras's `LossScaleOptimizer` calls
`apply` from threads of its own: a variable per replica is not per thread).
"""

import weakref

import keras
import numpy as np
from keras import ops

from keras_accum import _backend, _compat, _replicas
from keras_accum.validation import check_float


class ReplicaItems:
    """`apply(weight=ReplicaItems(n))`: n items (or tokens: the loss
    denominator) on this replica, gradients in the model.fit convention
    (this replica's mean gradient / replicas). n = 0 is a micro-batch whose
    items all weigh zero (it adds nothing to the window); n < 0 (`UNSET`)
    means "not recorded": the micro-batch then counts as one, as without
    weighing."""

    def __init__(self, items):
        self.items = items


# What `FitItems` holds when no loss recorded a count this step (a count is
# >= 0: a micro-batch whose sample weights are all zero weighs 0 items).
UNSET = -1.0

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


def loss_denominator(reduction, y_pred, sample_weight):
    """The number Keras divides the micro-batch's summed loss by: the sum of
    the sample weights (times the Keras mask) for
    `reduction="mean_with_sample_weight"`, the number of unmasked entries
    when `y_pred` carries a mask, else the batch size (proportional to the
    element count, which is all the weighting needs)."""
    mask = None
    if reduction is not None and not isinstance(y_pred, (dict, list, tuple)):
        mask = _compat.keras_mask(y_pred)
    weights = None
    if reduction == "mean_with_sample_weight" and sample_weight is not None:
        weights = ops.cast(keras.tree.flatten(sample_weight)[0], "float32")
    if mask is not None:
        mask = ops.cast(mask, "float32")
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
        return ops.sum(weights)
    first = next(t for t in keras.tree.flatten(y_pred) if t is not None)
    return ops.cast(ops.shape(first)[0], "float32")


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
    device or across replicas.

    Call it after `model.compile` (any Sequential, Functional or subclassed
    model), and again after every later `compile` or
    `keras.models.load_model`: it wraps the loss of that compile (Keras
    leaves no public hook between a step's loss and its `apply`; the
    wrapped loss is the one place that sees the denominator, and `compile`
    replaces it). A model whose own `compute_loss` does not use the
    compiled loss is not weighed. Needs one loss for token means. With a
    Keras optimizer (one update per batch, whose mean is already exact)
    it changes nothing.

    Args:
        model: a compiled Keras model whose optimizer is (or wraps, through
            a `keras.optimizers.LossScaleOptimizer`) a
            `keras_accum.GradientAccumulation`; the Adam variants refuse it.

    Returns:
        `model`, its compiled loss wrapped.
    """
    if not isinstance(model, keras.Model):
        raise ValueError(f"`model` must be a `keras.Model`. Received: model={model!r}")
    if not getattr(model, "compiled", False):
        raise ValueError(
            "`weigh_micro_batches` must be called after `model.compile`. "
            f"Received: model={model.name!r} (not compiled)"
        )
    reduction = _reduction(model)  # refuse a loss it cannot weigh now, not at the first step
    optimizer = model.optimizer
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    if not hasattr(optimizer, "takes_weights"):
        # A Keras optimizer steps on every batch: its mean over the batch is
        # already the exact one, and there is nothing to weigh.
        return model
    if not optimizer.takes_weights:
        raise ValueError(
            f"`weigh_micro_batches` has no effect with {type(optimizer).__name__}, which "
            "averages micro-batches equally; compile with GradientAccumulation(...) "
            f"to weigh them. Received: optimizer={optimizer.name!r}"
        )
    compiled = _compat.compiled_loss(model)
    if isinstance(compiled, _WeighedLoss):
        compiled = compiled.compiled  # weighed twice: once is enough
    items = optimizer.fit_items()
    weighed = _WeighedLoss(compiled, reduction, items)
    _compat.set_compiled_loss(model, weighed)
    items.weighed_model = weakref.ref(model)
    # Traced again, with the weighed loss, by the next `fit`: not here, where
    # under JAX's `keras.distribution` it would fix the shardings of an
    # optimizer `fit` has not built yet.
    model.train_function = None
    return model


class _WeighedLoss:
    """The loss a model was compiled with (Keras's `CompileLoss`), which
    also records each call's denominator in `items` (the optimizer's
    `FitItems`). Every other attribute is the compiled loss's."""

    def __init__(self, compiled, reduction, items):
        # `reduction`: that of the loss compiled (a later `compile` replaces
        # this object, so it cannot change under it).
        self.compiled, self._reduction, self._items = compiled, reduction, items

    def __call__(self, y_true, y_pred, sample_weight=None, *args, **kwargs):
        items = loss_denominator(self._reduction, y_pred, sample_weight)
        loss = self.compiled(y_true, y_pred, sample_weight, *args, **kwargs)
        if _backend.BACKEND != "jax" or _differentiated(loss):
            self._items.record(items)
        return loss

    def __getattr__(self, name):
        return getattr(self.compiled, name)


def _differentiated(loss):
    """True when a JAX loss is being differentiated (`jax.value_and_grad` in
    Keras's train step: an AD tracer, which carries a primal), False in an
    evaluation step. Only a training step's count may reach the optimizer:
    an evaluation's would outlive its trace."""
    return hasattr(loss, "primal")


class FitItems:
    """What `weigh_micro_batches` hands `GradientAccumulation.apply` under
    `model.fit`: a replica-local float32 scalar (one value per replica,
    created under the optimizer's strategy), written by the weighed loss
    and taken, then reset to 0, by `apply` in the same step. Not part of
    the optimizer's saved state."""

    def __init__(self):
        # JAX: the count of the step being traced, a value of the same jitted
        # train step (see `record`); no variable.
        self.traced = None
        # The model whose weighed loss records here, weakly: after a later
        # `compile` without weighing its loss records nothing, and the
        # optimizer takes nothing (an evaluation's count left here must not
        # weigh a training step).
        self.weighed_model = lambda: None
        if _backend.BACKEND == "jax":
            self.variable = None
            return
        if not _backend.IS_TENSORFLOW:  # PyTorch: one device, eager
            self.variable = keras.Variable(UNSET, trainable=False, name="fit_items")
            return
        self.variable = _replicas.replica_scalar(UNSET, "fit_items")

    def record(self, items):
        """Replica context: this replica's micro-batch weighs `items`.

        Under JAX the loss runs inside the jitted train step, under
        `jax.value_and_grad`, and the optimizer's `stateless_apply` after it
        in the same trace: the count (a value of that trace, computed from
        the batch's sample weights or mask, not from the weights being
        differentiated) is handed over as it is and taken by `take` in the
        same trace. Under `PerDeviceGradients` each device's loss records
        its shard's count inside the per-device step, which hands `take`
        the devices' counts, one per row (`DeviceRoute.train_step`)."""
        items = ops.cast(items, "float32")
        if self.variable is None:
            self.traced = items
            return
        self.variable.assign(items)

    def take(self):
        """Replica context: the recorded count as `ReplicaItems` (`UNSET`
        if none was recorded this step), the variable reset to `UNSET`."""
        model = self.weighed_model()
        loss = None if model is None else _compat.compiled_loss(model)
        if not (isinstance(loss, _WeighedLoss) and loss._items is self):
            return ReplicaItems(UNSET)  # compiled again without weighing
        if self.variable is None:  # JAX
            items, self.traced = self.traced, None
            return ReplicaItems(UNSET if items is None else items)
        if not _backend.IS_TENSORFLOW:
            items = ops.copy(ops.convert_to_tensor(self.variable))  # not a view: reset below
            self.variable.assign(UNSET)
            return ReplicaItems(items)
        items = _replicas.read_local(self.variable)
        self.variable.assign(UNSET)
        return ReplicaItems(items)


def check_weight(weight):
    """`apply(weight=...)` given (None means 1 there): a finite number >= 0
    or a scalar tensor (its value checked when eager), or `ReplicaItems`.

    0 is a micro-batch whose items all weigh zero (padding only): it adds
    nothing to the window's weighted mean and still counts as a micro-step,
    as under `weigh_micro_batches` and as a traced weight of 0; a window
    whose weights add up to 0 steps with a zero mean gradient (see
    `GradientAccumulation.means`). Negative, NaN, infinite and non-scalar
    weights are refused.
    """
    if isinstance(weight, ReplicaItems):
        return weight
    error = f"`weight` must be a finite scalar number >= 0. Received: weight={weight!r}"
    if isinstance(weight, bool):
        raise ValueError(error)
    if isinstance(weight, (int, float, np.number)):
        return check_float("weight", weight, minimum=0.0)
    if isinstance(weight, np.ndarray):
        if weight.shape != ():
            raise ValueError(error)
        return check_float("weight", float(weight), minimum=0.0)
    shape = getattr(weight, "shape", None)
    if shape is None or (shape.rank if hasattr(shape, "rank") else len(shape)) not in (0, None):
        raise ValueError(error)
    if _backend.is_concrete(weight):
        value = float(ops.convert_to_numpy(weight))
        if not (np.isfinite(value) and value >= 0):
            raise ValueError(error)
    return weight
