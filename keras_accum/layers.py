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

import weakref
from typing import Any

import keras
from keras import ops

from keras_accum import _backend, _compat, base, drivers
from keras_accum.validation import check_choice

# What `momentum` is per: a micro-step (Keras's layer under accumulation
# moves once per micro-step; an update moves with momentum ** steps), or an
# update (the big batch's layer).
MOMENTUM_UNITS = ("micro_step", "update")


@keras.saving.register_keras_serializable(package="keras_accum")
class BatchNormalization(drivers.BatchNormalizationForm, keras.layers.BatchNormalization):
    """Batch normalization whose moving statistics are the window's.

    A drop-in `keras.layers.BatchNormalization` (same arguments, same
    inference, same training-time normalization) for a model trained with a
    keras_accum optimizer, on TensorFlow, JAX and PyTorch. Micro-batch i of
    a window, with n_i items, mean mu_i and biased variance s_i^2 per
    channel (over every axis but `axis`, masked items left out), is folded
    into three sums around the shift c = `moving_mean` (which holds still
    during a window):

        S1 += n_i (mu_i - c),  S2 += n_i (s_i^2 + (mu_i - c)^2),  N += n_i

    and at the window's end, with mu = c + S1 / N and s^2 = S2 / N - (S1 / N)^2
    (the biased variance of the window's N items, as Keras's layer uses)
    and m the momentum of one update (below):

        moving_mean     = m * moving_mean     + (1 - m) * mu
        moving_variance = m * moving_variance + (1 - m) * s^2

    then the sums restart. These are the statistics Keras's layer would
    reach at a batch of the whole window with momentum m (to float32
    rounding). With `renorm=True` the moving and renorm statistics move
    once per window too, as Keras moves them for a batch of mean mu and
    variance s^2 (`renorm_momentum` takes the same unit).

    The momentum's unit (`momentum_unit`):

    * "micro_step" (the default): `momentum` is per micro-step, as Keras's
      layer under accumulation moves; one update that ends a window of k
      micro-steps moves with m = momentum ** k (k the optimizer's
      `window_steps`: `steps`, or a schedule's value for that window; k =
      kappa on one device). The statistics forget over about
      1 / (1 - momentum) micro-steps, the same horizon in examples as
      Keras's layer under the same accumulation (docs/BATCH_NORM.md:
      0.862 test accuracy, as Keras's layer, where "update" gave 0.586).
    * "update": `momentum` is per update, m = momentum, as Keras's layer at
      the big batch: the statistics forget over about 1 / (1 - momentum)
      updates, kappa times more examples (keras_accum 0.3.0's behaviour).

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

    Where the window ends: on TensorFlow the moving statistics move in the
    optimizer's `apply` call that ends a window (the same training step as
    the update), through `AccumulationOptimizer.on_window_end`. On JAX and
    PyTorch the optimizer's step cannot write the layer's variables (JAX's
    `stateless_apply` returns the optimizer's and the trainable ones only),
    so the layer counts its own training calls (`micro_step`, with the
    window's `window_steps` and `window_end`, non-trainable variables saved
    with the model) and bounds its windows as the optimizer does: the call
    of a window's last micro-batch folds it and moves the statistics, so
    the layer's state after each micro-batch is TensorFlow's. It follows an
    integer `steps` or a `PiecewiseSteps` (it evaluates the schedule on its
    own count); `AdaptiveSteps`, sized from the optimizer's state, is
    refused there in one line. Its count is the optimizer's `micro_step` as
    long as each training step calls it once: a micro-batch skipped under
    `nonfinite="skip_micro_batch"` is counted by both; a step a
    `LossScaleOptimizer` skips (an overflow), a second call of the layer
    in one step, or a call with `training=True` outside training is
    counted by the layer alone and shifts its windows from the optimizer's
    by one micro-batch (each window still holds kappa micro-batches).

    Replicas: each replica adds its own micro-batches to its own sums
    (replica-local variables, no communication). At the window's end the
    three sums (3 x channels numbers) are all-reduced in ONE call, in
    cross-replica context inside the optimizer's window-end branch, so the
    moving statistics are those of one device running the whole global
    window; nothing is sent on the other micro-steps. (Keras's layer, for
    comparison, writes its moving statistics on every micro-step.) With
    `synchronized=True` Keras's own all-reduce of the micro-batch's moments
    runs on every micro-step as well, for the normalization. Under JAX's
    `keras.distribution.DataParallel` the layer sees the global
    micro-batch, and its state is one device's.

    State: `window_sum`, `window_square_sum`, `window_count` (S1, S2, N per
    channel; float32, float64 under a float64 policy) are non-trainable
    variables of the layer, saved with the model (with the counters off
    TensorFlow): a model saved inside a window resumes it exactly. On
    TensorFlow a micro-batch the optimizer skips (a non-finite gradient
    under a loss scaler) still counts in the sums; a model called with
    `training=True` outside training adds to them, as it moves Keras's
    statistics. A layer called twice in one step folds both calls into its
    window. A model saved on TensorFlow loads on JAX or PyTorch with the
    layer's counters at 0 (its next window starts at the next training
    call), and the other way round.

    Args:
        *args: as `keras.layers.BatchNormalization`.
        momentum_unit: "micro_step" (default) or "update": what one
            `momentum` step is (above).
        **kwargs: as `keras.layers.BatchNormalization`.

    Example:
        The moving statistics move once per window of 4 micro-batches, to
        those of its 16 items, with momentum 0.99 per micro-step:

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
        >>> np.allclose(moving_mean, (1 - 0.99**4) * x.mean(axis=0))  # one update
        True
    """

    def __init__(self, *args: Any, momentum_unit: str = "micro_step", **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.momentum_unit = check_choice("momentum_unit", momentum_unit, MOMENTUM_UNITS)
        # `attach`'s optimizer (a function returning it), or None: the
        # optimizer of the model being called.
        self._follows = None
        # The optimizer whose window the last training call folded into (a
        # weak reference): its window size sets the momentum of the update.
        self._followed = None

    def get_config(self) -> dict:
        return {**super().get_config(), "momentum_unit": self.momentum_unit}

    def build(self, input_shape):
        super().build(input_shape)
        shape = (input_shape[self.axis],)
        dtype = keras.backend.result_type(self.variable_dtype, "float32")
        # Replica-local (on-read SUM): each replica adds its own part, a
        # read in cross-replica context (or a save) sees the total.
        with keras.name_scope(self.name, caller=self), self._local_scope():
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
        self._build_counters()

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
        if getattr(self, "renorm", False):  # Keras 3.14+
            gamma, beta = _compat.renorm_transform(self, mean, variance, gamma, beta, compute_dtype)
        # After the renorm correction read the renorm statistics: a window
        # that ends here (off TensorFlow, in this call) moves them after
        # this micro-batch, as the optimizer's `apply` does on TensorFlow.
        self._fold_micro_batch(inputs, mask, mean, variance, optimizer)
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
        (on TensorFlow registered to call `_end_window`), or None: Keras's
        behaviour."""
        if self._follows is not None:
            optimizer = self._follows()
        else:
            optimizer = getattr(self._calling_model(), "optimizer", None)
        while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            optimizer = optimizer.inner_optimizer
        if not isinstance(optimizer, base.AccumulationOptimizer):
            return None
        self._followed = weakref.ref(optimizer)
        self._follow(optimizer)
        return optimizer

    def _window_terms(self, inputs, mask, mean, variance, items):
        """(n_i (mu_i - c), n_i (s_i^2 + (mu_i - c)^2), n_i) per channel:
        what micro-batch i adds to the window's sums S1, S2, N, with c the
        moving mean (a shift, for precision); `items` per channel is n_i
        without a mask (a number, or a scalar tensor)."""
        dtype = self.window_sum.dtype
        rank = len(inputs.shape)
        axes = [a for a in range(rank) if a != self.axis % rank]
        if mask is None:
            count = ops.full((self.window_sum.shape[0],), ops.cast(items, dtype), dtype=dtype)
        else:  # the count Keras's masked moments divide by
            weights = ops.broadcast_to(ops.expand_dims(mask, axis=-1), ops.shape(inputs))
            count = ops.sum(ops.cast(weights, dtype), axis=axes)
        mean = ops.stop_gradient(ops.cast(mean, dtype))
        variance = ops.stop_gradient(ops.cast(variance, dtype))
        shifted = mean - ops.cast(self.moving_mean, dtype)  # mu_i - c
        return count * shifted, count * (variance + shifted * shifted), count

    def _momenta(self, size):
        """(momentum, renorm momentum or None) of one update that ends a
        window of `size` micro-steps (an int, or an integer tensor under a
        schedule): `momentum ** size` per micro-step, `momentum` per
        update."""
        momenta = [self.momentum, getattr(self, "renorm_momentum", None)]  # Keras 3.14+
        if self.momentum_unit == "update":
            return momenta
        if isinstance(size, int):
            return [None if m is None else m**size for m in momenta]
        wide = _backend.wide_float()
        size = ops.cast(size, wide)
        return [None if m is None else ops.power(ops.cast(m, wide), size) for m in momenta]

    def _move_statistics(self, mean, variance, write, momenta):
        """The moving statistics moved towards the window's `mean` and
        `variance` where `write` holds (per channel), as Keras's layer
        moves them for one batch, with `momenta` (momentum, renorm
        momentum) for this update."""
        momentum, renorm_momentum = momenta

        def mix(old, new, m):  # Keras's line: old * m + new * (1 - m)
            m = m if isinstance(m, float) else ops.cast(m, new.dtype)
            return old * m + new * (1.0 - m)

        dtype = mean.dtype
        moving_mean = ops.cast(self.moving_mean, dtype)
        if getattr(self, "renorm", False):  # Keras 3.14+: its _update_renorm_statistics
            stddev = ops.sqrt(variance + self.epsilon)
            moving_stddev = mix(ops.cast(self.moving_stddev, dtype), stddev, momentum)
            moved = [
                (self.renorm_mean, mix(ops.cast(self.renorm_mean, dtype), mean, renorm_momentum)),
                (
                    self.renorm_stddev,
                    mix(ops.cast(self.renorm_stddev, dtype), stddev, renorm_momentum),
                ),
                (self.moving_mean, mix(moving_mean, mean, momentum)),
                (self.moving_stddev, moving_stddev),
                (
                    self.moving_variance,
                    ops.relu(moving_stddev * moving_stddev - self.epsilon),
                ),
            ]
        else:  # Keras's lines, for the batch of the whole window
            moving_variance = ops.cast(self.moving_variance, dtype)
            moved = [
                (self.moving_mean, mix(moving_mean, mean, momentum)),
                (self.moving_variance, mix(moving_variance, variance, momentum)),
            ]
        for variable, new in moved:
            old = ops.convert_to_tensor(variable)
            variable.assign(ops.where(write, ops.cast(new, old.dtype), old))


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
