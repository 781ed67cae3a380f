"""Losses and metrics of the loop as per-item functions."""

import functools

import keras
import tensorflow as tf

from keras_accum import _compat


def per_item(values, rank):
    """Mean over the axes beyond `rank` (the sample weight's rank)."""
    values = tf.convert_to_tensor(values)
    extra = list(range(rank, values.shape.rank))
    return tf.reduce_mean(values, axis=extra) if extra else values


def weighted(fn, y, y_pred, sample_weight):
    """Per-item values of `fn` at the sample weight's rank, and weights."""
    values = tf.cast(fn(y, y_pred), tf.float32)
    if sample_weight is None:
        if values.shape.rank == 0:
            raise ValueError(
                "The loss and metrics must return per-item values, not "
                f"a reduced scalar. Received: {fn!r}"
            )
        values = per_item(values, 1)
        return values, tf.ones_like(values)
    weights = tf.cast(sample_weight, tf.float32)
    if values.shape.rank < weights.shape.rank:
        raise ValueError(
            "The loss and metrics must return per-item values of at "
            f"least the sample weight's rank {weights.shape.rank}. "
            f"Received: values of shape {values.shape} from {fn!r}"
        )
    return per_item(values, weights.shape.rank), weights


def resolve_loss(loss_fn):
    if isinstance(loss_fn, str):
        loss_fn = keras.losses.get(loss_fn)
    if isinstance(loss_fn, keras.losses.Loss):
        return loss_fn.call  # per-item values, no reduction
    if not callable(loss_fn):
        raise ValueError(
            "`loss_fn` must be a callable (y_true, y_pred) -> per-item "
            f"losses, a keras Loss or its name. Received: loss_fn={loss_fn!r}"
        )
    return loss_fn


def _accuracy(y_true, y_pred):
    if y_pred.shape[-1] == 1:
        return keras.metrics.binary_accuracy(y_true, y_pred)
    if y_true.shape.rank == y_pred.shape.rank and y_true.shape[-1] != 1:
        return keras.metrics.categorical_accuracy(y_true, y_pred)
    return keras.metrics.sparse_categorical_accuracy(y_true, y_pred)


def resolve_metrics(metrics):
    """(name, per-item function) pairs; a `MeanMetricWrapper` gives its function."""
    resolved = []
    for metric in metrics:
        if metric in ("accuracy", "acc"):
            resolved.append(("accuracy", _accuracy))
            continue
        if isinstance(metric, str):
            metric = keras.metrics.get(metric)
        if isinstance(metric, keras.metrics.MeanMetricWrapper):
            fn, kwargs = _compat.metric_function(metric)
            resolved.append((metric.name, functools.partial(fn, **kwargs)))
        elif callable(metric) and not isinstance(metric, keras.metrics.Metric):
            resolved.append((metric.__name__, metric))
        else:
            raise ValueError(
                "Each metric must be a name, a keras MeanMetricWrapper or a "
                "per-item function (y_true, y_pred) -> values. "
                f"Received: metric={metric!r}"
            )
    return resolved
