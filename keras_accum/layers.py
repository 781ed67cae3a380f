"""Layers that follow the optimizer's windows: `BatchNormalization`.

Under accumulation Keras's `BatchNormalization` moves its moving statistics
on every micro-batch: kappa times per update, towards micro-batch means and
variances (docs/ALGORITHMS.md, section 9). `BatchNormalization` here moves
them once per window, towards the statistics of the window's items taken
together, as one big batch would. `attach` links its layers to an optimizer
in a loop of your own; `convert_batch_normalization` swaps Keras's layers
for it in a built model.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from keras_accum import _backend, _compat, _replicas, base
from keras_accum._backend import tf


@keras.saving.register_keras_serializable(package="keras_accum")
class BatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization whose moving statistics are the window's.

    A drop-in `keras.layers.BatchNormalization` (same arguments, same
    inference, same training-time normalization) for a model trained with a
    keras_accum optimizer. Micro-batch i of a window, with n_i items, mean
    mu_i and biased variance s_i^2 per channel (over every axis but `axis`,
    masked items left out), is folded into three sums around the shift
    c = `moving_mean` (which holds still during a window):

        S1 += n_i (mu_i - c),  S2 += n_i (s_i^2 + (mu_i - c)^2),  N += n_i

    and at the window's end, with mu = c + S1 / N and s^2 = S2 / N - (S1 / N)^2
    (the biased variance of the window's N items, as Keras's layer uses):

        moving_mean     = momentum * moving_mean     + (1 - momentum) * mu
        moving_variance = momentum * moving_variance + (1 - momentum) * s^2

    then the sums restart. These are the statistics Keras's layer would
    reach at a batch of the whole window, updated once per update (to
    float32 rounding). With `renorm=True` the moving and renorm statistics
    move once per window too, as Keras moves them for a batch of mean mu and
    variance s^2.

    The horizon is the big batch's too: the moving statistics forget over
    about 1 / (1 - momentum) updates, where Keras's layer under
    accumulation forgets over as many micro-batches. In a run of few
    updates pass `momentum=0.99 ** kappa` to keep the horizon in examples
    (docs/BATCH_NORM.md measures both).

    What stays per micro-batch: the normalization in training uses the
    micro-batch's own mean and variance ("ghost" batch normalization,
    exactly as Keras's layer computes it). It cannot be the window's without
    a second pass. `synchronized=True` pools them over the replicas of a
    micro-step; `renorm=True` corrects them towards the renorm statistics.

    Which optimizer: in `model.fit`, the optimizer the model was compiled
    with (through a `keras.optimizers.LossScaleOptimizer`); in a loop of
    your own, the one given to `attach(model, optimizer)`
    (`keras_accum.training.Trainer` attaches its own). With no optimizer,
    or one that does not accumulate (e.g. `keras.optimizers.Adam`), or in
    inference, the layer is `keras.layers.BatchNormalization`, bit for bit.
    The moving statistics move in the `apply` call that ends a window (the
    same training step as the update), through
    `AccumulationOptimizer.on_window_end`.

    Replicas: each replica adds its own micro-batches to its own sums
    (replica-local variables, no communication). At the window's end the
    three sums (3 x channels numbers) are all-reduced in ONE call, in
    cross-replica context inside the optimizer's window-end branch, so the
    moving statistics are those of one device running the whole global
    window; nothing is sent on the other micro-steps. (Keras's layer, for
    comparison, writes its moving statistics on every micro-step.) With
    `synchronized=True` Keras's own all-reduce of the micro-batch's moments
    runs on every micro-step as well, for the normalization.

    State: `window_sum`, `window_square_sum`, `window_count` (S1, S2, N per
    channel; float32, float64 under a float64 policy) are non-trainable
    variables of the layer, saved with the model: a model saved inside a
    window resumes it exactly. A micro-batch the optimizer skips (a
    non-finite gradient under a loss scaler) still counts in the sums; a
    model called with `training=True` outside training adds to them, as it
    moves Keras's statistics. A layer called twice in one step folds both
    calls into its window.

    Example:
        The moving statistics move once per window of 4 micro-batches, to
        those of its 16 items:

        >>> import numpy as np, keras, keras_accum
        >>> model = keras.Sequential([
        ...     keras.Input((3,)),
        ...     keras_accum.layers.BatchNormalization(),
        ...     keras.layers.Dense(1),
        ... ])
        >>> model.compile(
        ...     optimizer=keras_accum.GradientAccumulation(keras.optimizers.SGD(0.0), steps=4),
        ...     loss="mse",
        ... )
        >>> x = np.arange(48, dtype="float32").reshape(16, 3)
        >>> _ = model.fit(x, np.zeros((16, 1)), batch_size=4, shuffle=False, verbose=0)
        >>> moving_mean = model.layers[0].moving_mean.numpy()
        >>> np.allclose(moving_mean, 0.01 * x.mean(axis=0))  # momentum 0.99, one update
        True
    """

    def __init__(self, *args: Any, **kwargs: Any):
        _backend.require_tensorflow("`keras_accum.layers.BatchNormalization`")
        super().__init__(*args, **kwargs)
        # `attach`'s optimizer (a function returning it), or None: the
        # optimizer of the model being called.
        self._follows = None

    def build(self, input_shape):
        super().build(input_shape)
        shape = (input_shape[self.axis],)
        dtype = keras.backend.result_type(self.variable_dtype, "float32")
        # Replica-local (on-read SUM): each replica adds its own part, a
        # read in cross-replica context (or a save) sees the total.
        with keras.name_scope(self.name, caller=self), _replicas.sync_on_read():
            local = dict(
                initializer="zeros",
                shape=shape,
                dtype=dtype,
                trainable=False,
                autocast=False,
                aggregation="sum",
            )
            self.window_sum = keras.Variable(name="window_sum", **local)
            self.window_square_sum = keras.Variable(name="window_square_sum", **local)
            self.window_count = keras.Variable(name="window_count", **local)

    def call(self, inputs, training=None, mask=None):
        optimizer = self._window_optimizer() if training and self.trainable else None
        bad_mask = mask is not None and len(mask.shape) != len(inputs.shape) - 1
        if optimizer is None or bad_mask:
            # Keras's layer (which also raises its own error for a bad mask).
            return super().call(inputs, training=training, mask=mask)
        # As Keras's call, without its moving updates, plus the fold.
        compute_dtype = keras.backend.result_type(inputs.dtype, "float32")
        inputs = ops.cast(inputs, compute_dtype)
        gamma = ops.cast(self.gamma, compute_dtype) if self.scale else None
        beta = ops.cast(self.beta, compute_dtype) if self.center else None
        mean, variance = _compat.batch_moments(self, inputs, mask)
        self._fold(inputs, mask, mean, variance)
        if getattr(self, "renorm", False):  # Keras 3.14+
            gamma, beta = _compat.renorm_transform(self, mean, variance, gamma, beta, compute_dtype)
        outputs = ops.batch_normalization(
            x=inputs,
            mean=mean,
            variance=variance,
            axis=self.axis,
            offset=beta,
            scale=gamma,
            epsilon=self.epsilon,
        )
        return ops.cast(outputs, self.compute_dtype)

    def _window_optimizer(self):
        """The accumulating optimizer whose windows this layer follows now
        (registered to call `_end_window`), or None: Keras's behaviour."""
        if self._follows is not None:
            optimizer = self._follows()
        else:
            optimizer = getattr(_compat.calling_model(), "optimizer", None)
        while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            optimizer = optimizer.inner_optimizer
        if not isinstance(optimizer, base.AccumulationOptimizer):
            return None
        optimizer.on_window_end(self._end_window)
        return optimizer

    def _fold(self, inputs, mask, mean, variance):
        """Replica context: this micro-batch into this replica's sums."""
        dtype = self.window_sum.dtype
        rank = len(inputs.shape)
        axes = [a for a in range(rank) if a != self.axis % rank]
        if mask is None:
            channels = self.window_sum.shape[0]
            items = tf.size(inputs, out_type=tf.int64) // channels
            count = tf.fill([channels], tf.cast(items, dtype))
        else:  # the count Keras's masked moments divide by
            weights = ops.broadcast_to(ops.expand_dims(mask, axis=-1), ops.shape(inputs))
            count = ops.sum(ops.cast(weights, dtype), axis=axes)
        mean = tf.stop_gradient(ops.cast(mean, dtype))
        variance = tf.stop_gradient(ops.cast(variance, dtype))
        shifted = mean - ops.cast(self.moving_mean, dtype)  # mu_i - c
        # S1 += n_i (mu_i - c); S2 += n_i (s_i^2 + (mu_i - c)^2); N += n_i
        self.window_sum.assign_add(count * shifted)
        self.window_square_sum.assign_add(count * (variance + shifted * shifted))
        self.window_count.assign_add(count)

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
        self._move_statistics(mean, variance, write)
        for variable in sums:
            rest = tf.zeros(variable.shape, variable.dtype)
            if keep is not None:
                rest = tf.where(keep, rest, _replicas.read_total(variable))
            _replicas.assign_total(variable, rest)

    def _move_statistics(self, mean, variance, write):
        """The moving statistics moved towards the window's `mean` and
        `variance` where `write` holds (per channel), as Keras's layer
        moves them for one batch."""
        moving = [self.moving_mean, self.moving_variance]
        if getattr(self, "renorm", False):  # Keras 3.14+
            moving += [self.moving_stddev, self.renorm_mean, self.renorm_stddev]
        before = [tf.identity(tf.convert_to_tensor(v)) for v in moving]
        if getattr(self, "renorm", False):  # Keras 3.14+
            _compat.update_renorm_statistics(self, mean, variance)
        else:  # Keras's lines, for the batch of the whole window
            moving_mean = ops.cast(self.moving_mean, mean.dtype)
            moving_variance = ops.cast(self.moving_variance, mean.dtype)
            self.moving_mean.assign(moving_mean * self.momentum + mean * (1.0 - self.momentum))
            self.moving_variance.assign(
                moving_variance * self.momentum + variance * (1.0 - self.momentum)
            )
        for variable, old in zip(moving, before):
            new = ops.cast(tf.convert_to_tensor(variable), old.dtype)
            variable.assign(tf.where(write, new, old))


def attach(model: keras.Layer, optimizer: keras.optimizers.Optimizer | None) -> list:
    """Makes the `keras_accum.layers.BatchNormalization` layers of `model`
    (nested ones included) follow the windows of `optimizer`, for a training
    loop of your own that calls `optimizer.apply` (under `model.fit` they
    follow the compiled optimizer without it). While attached, a layer
    looks at no compiled optimizer; `None` undoes it. A layer that follows
    an optimizer that does not accumulate is Keras's layer.
    `keras_accum.training.Trainer` calls it for you.

    Args:
        model: a model or layer holding `BatchNormalization` layers.
        optimizer: the optimizer whose windows they follow, or None to
            detach them.

    Returns:
        The `BatchNormalization` layers attached (a list).
    """
    if not isinstance(model, keras.Layer):
        raise ValueError(f"`model` must be a Keras model or layer. Received: model={model!r}")
    if optimizer is not None and not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(
            f"`optimizer` must be a Keras optimizer or None. Received: optimizer={optimizer!r}"
        )
    # A function returning it: held without making it a tracked dependency
    # of the layer (its checkpoints stay the layer's own).
    link = None if optimizer is None else (lambda: optimizer)
    found = [x for x in [model, *_compat.all_layers(model)] if isinstance(x, BatchNormalization)]
    for layer in found:
        layer._follows = link
    return found


def convert_batch_normalization(model: keras.Model) -> keras.Model:
    """A copy of `model` with each `keras.layers.BatchNormalization` layer
    replaced by `keras_accum.layers.BatchNormalization` (same config).

    Weights and moving statistics are copied (the new window sums start at
    zero); the copy predicts exactly as `model` does. Sequential and
    Functional models, nested ones included (`keras.models.clone_model`).
    Not converted: subclasses of Keras's layer, and layers inside a layer
    of your own. The copy is not compiled; compile it. A subclassed model
    is refused: build it with `keras_accum.layers.BatchNormalization`.

    Args:
        model: a built Sequential or Functional model.

    Returns:
        A new, uncompiled model.
    """
    if not isinstance(model, keras.Model):
        raise ValueError(f"`model` must be a keras.Model. Received: model={model!r}")
    if not (isinstance(model, keras.Sequential) or _compat.is_functional(model)):
        raise ValueError(
            "`model` must be a Sequential or Functional model (a subclassed "
            "model cannot be rebuilt: create its layers with "
            "keras_accum.layers.BatchNormalization instead). "
            f"Received: model={type(model).__name__}"
        )
    pairs = []

    def clone(layer):
        if type(layer) is keras.layers.BatchNormalization:
            new = BatchNormalization.from_config(layer.get_config())
        else:
            new = layer.__class__.from_config(layer.get_config())
        pairs.append((layer, new))
        return new

    converted = keras.models.clone_model(model, clone_function=clone, recursive=True)
    for old, new in pairs:
        if not old.weights:
            continue
        if isinstance(new, BatchNormalization) and not isinstance(old, BatchNormalization):
            by_name = {v.name: v for v in new.weights}
            for variable in old.weights:
                by_name[variable.name].assign(variable)
        else:
            new.set_weights(old.get_weights())
    return converted
