"""What a micro-batch weighs: `apply(weight=...)` and `weigh_micro_batches`.

`GradientAccumulation` averages a window's micro-batches weighted by their
item (or token) counts, the exact big-batch mean; a custom loop passes
`optimizer.apply(grads, vars, weight=n)`. Under `model.fit`,
`weigh_micro_batches(model)` wraps the compiled loss, which writes its
denominator into the optimizer's `FitItems` for `apply` to take in the same
step. See docs/guides/fit.md ("Reference").
"""

import weakref

import keras
import numpy as np
from keras import ops

from keras_accum import _backend, _compat, _replicas
from keras_accum.validation import check_float


class ReplicaItems:
    """`apply(weight=ReplicaItems(n))`: n items (the loss denominator) on this
    replica, gradients in the model.fit convention (mean / replicas). n = 0
    adds nothing to the window; n < 0 (`UNSET`, not recorded) counts as one."""

    def __init__(self, items):
        self.items = items


# What `FitItems` holds when no loss recorded a count this step (0 is a real count).
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
    """The number Keras divides the micro-batch's summed loss by: the sample
    weights' sum (times the mask) for `reduction="mean_with_sample_weight"`,
    the unmasked entries under a Keras mask, else the batch size."""
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

    Without it `GradientAccumulation` under `model.fit` averages
    micro-batches equally, which is wrong for a short last batch or a
    token-mean loss. With it each micro-batch (or replica) r passes the
    denominator D_r Keras divided its summed loss by (items, or tokens of
    nonzero weight), and the window mean is sum_r D_r g_r / sum_r D_r, the
    big batch's. Call it after `model.compile`, and again after every later
    `compile` or `keras.models.load_model`: it wraps that compile's loss. A
    model whose `compute_loss` skips the compiled loss is not weighed; a
    Keras optimizer is left as it is. See docs/guides/fit.md.

    Args:
        model: a compiled Keras model whose optimizer is (or wraps, through
            a `keras.optimizers.LossScaleOptimizer`) a
            `keras_accum.GradientAccumulation`; the Adam variants refuse it.

    Returns:
        `model`, its compiled loss wrapped.

    Raises:
        ValueError: `model` is not compiled, its loss is not a mean over items
            or tokens (or several token means), or its optimizer averages
            micro-batches equally.
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
        # A Keras optimizer steps on every batch, whose mean is already exact.
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
    # Retraced by the next `fit`, not here (under JAX's `keras.distribution`
    # that would fix the shardings of an optimizer not built yet).
    model.train_function = None
    return model


class _WeighedLoss:
    """The compiled loss (Keras's `CompileLoss`), also recording each call's
    denominator in `items` (the optimizer's `FitItems`)."""

    def __init__(self, compiled, reduction, items):
        # `reduction` is fixed: a later `compile` replaces this object.
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
    """True when a JAX loss is being differentiated (an AD tracer has a
    primal): an evaluation step's count would outlive its trace."""
    return hasattr(loss, "primal")


class FitItems:
    """The count the weighed loss hands `GradientAccumulation.apply` under
    `model.fit`: a replica-local float32 scalar (under JAX a traced value),
    taken and reset to `UNSET` by `apply` in the same step. Not saved."""

    def __init__(self):
        # JAX: the count of the train step being traced; no variable.
        self.traced = None
        # The model whose weighed loss records here (weakly): after a later
        # `compile` without weighing, `take` gives nothing.
        self.weighed_model = lambda: None
        if _backend.BACKEND == "jax":
            self.variable = None
            return
        if not _backend.IS_TENSORFLOW:  # PyTorch: one device, eager
            self.variable = keras.Variable(UNSET, trainable=False, name="fit_items")
            return
        self.variable = _replicas.replica_scalar(UNSET, "fit_items")

    def record(self, items):
        """Replica context: this replica's micro-batch weighs `items` (under
        JAX a value of the train step's trace, taken in the same trace)."""
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
    """`apply(weight=...)` checked: a finite number >= 0, a scalar tensor
    (checked when eager) or `ReplicaItems`, else ValueError.

    0 adds nothing to the window's mean and still counts as a micro-step
    (docs/guides/fit.md).
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
