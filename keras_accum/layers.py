"""Layers that follow the optimizer's windows: `BatchNormalization`.

`attach` links its layers to an optimizer in a loop of your own;
`convert_batch_normalization` swaps Keras's layers for it in a built model.
See docs/BATCH_NORM.md.
"""

from __future__ import annotations

import weakref
from typing import Any

import keras
from keras import ops

from keras_accum import _backend, _compat, base, drivers
from keras_accum.validation import check_choice

# What `momentum` is per: a micro-step (Keras's layer under accumulation) or an update.
MOMENTUM_UNITS = ("micro_step", "update")
# The training calls so far, and the size and end micro-step of the current window.
COUNTERS = ("micro_step", "window_steps", "window_end")


@keras.saving.register_keras_serializable(package="keras_accum")
class BatchNormalization(drivers.BatchNormalizationForm, keras.layers.BatchNormalization):
    """Batch normalization whose moving statistics are the window's.

    A drop-in `keras.layers.BatchNormalization` (same arguments, inference
    and training-time normalization; TensorFlow, JAX and PyTorch) whose
    moving statistics move once per window, as Keras's layer would at a
    batch of the whole window (to float32 rounding). Micro-batch i, with
    n_i items, mean mu_i and biased variance s_i^2 per channel (masked
    items left out), is folded around c = `moving_mean` (still during a
    window):

        S1 += n_i (mu_i - c),  S2 += n_i (s_i^2 + (mu_i - c)^2),  N += n_i

    and at the window's end, with mu = c + S1 / N, s^2 = S2 / N - (S1 / N)^2:

        moving_mean     = m * moving_mean     + (1 - m) * mu
        moving_variance = m * moving_variance + (1 - m) * s^2

    then the sums restart. m = momentum ** k with `momentum_unit="micro_step"`
    (k the optimizer's `window_steps` for that window: micro-steps per
    replica), m = momentum with "update". With `renorm=True` the renorm
    statistics move once per window too (`renorm_momentum` in the same
    unit). Training still normalizes each micro-batch by its own moments.

    It follows the compiled optimizer under `model.fit` (through a
    `LossScaleOptimizer`), or the one given to `attach`. With no
    accumulating optimizer, or in inference, it is Keras's layer bit for
    bit. Off TensorFlow it counts its own windows (`micro_step`,
    `window_steps`, `window_end`; JAX refuses `AdaptiveSteps`); on
    TensorFlow they hold the optimizer's count. S1, S2
    and N are the non-trainable variables `window_sum`,
    `window_square_sum` and `window_count`, saved with the model. See
    docs/BATCH_NORM.md (windows, replicas, saving, measurements).

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
        # `attach`'s optimizer (a function returning it); None: the model's.
        self._follows = None
        # Weak reference to the optimizer of the last fold: its window sets the momentum.
        self._followed = None

    def get_config(self) -> dict:
        return {**super().get_config(), "momentum_unit": self.momentum_unit}

    def build(self, input_shape):
        super().build(input_shape)
        shape = (input_shape[self.axis],)
        dtype = keras.backend.result_type(self.variable_dtype, "float32")
        # Replica-local (on-read SUM): a cross-replica read or a save sees the total.
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
        # The layer's count of its windows (`_count` off TensorFlow; on
        # TensorFlow the optimizer's, copied in after each `apply`), after the
        # sums: one saved format on every backend.
        with keras.name_scope(self.name, caller=self):
            counter = dict(
                initializer="zeros",
                shape=(),
                dtype=_backend.INT,
                trainable=False,
                aggregation="only_first_replica",
            )
            for name in COUNTERS:
                setattr(self, name, keras.Variable(name=name, **counter))

    def _counters(self):
        return [getattr(self, name) for name in COUNTERS]

    def load_own_variables(self, store):
        # A file of keras_accum 0.3.x from TensorFlow has no counters: they load as zero.
        own = _compat.layer_own_variables(self)
        saved = len(store.keys())
        if saved == len(own) - len(COUNTERS):
            for i, variable in enumerate(own[:saved]):
                variable.assign(store[f"{i}"])
            for counter in self._counters():
                counter.assign(ops.zeros((), counter.dtype))
            return
        super().load_own_variables(store)

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
        # After the renorm correction: a window ending in this call (off TensorFlow)
        # moves the statistics after this micro-batch, as `apply` does on TensorFlow.
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
        """The accumulating optimizer whose windows this layer follows now, or
        None (Keras's behaviour)."""
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

    def _count(self, optimizer):
        """This training call into the layer's count, its windows bounded as
        the optimizer bounds its own (`base.bounds`): (the window's size,
        whether this call ends it)."""
        step = ops.convert_to_tensor(self.micro_step)
        held = [ops.convert_to_tensor(self.window_end), ops.convert_to_tensor(self.window_steps)]
        _, size, end = base.bounds(step, *held, optimizer.steps)
        step = step + 1
        self.micro_step.assign(step)
        self.window_steps.assign(size)
        self.window_end.assign(end)
        return size, ops.equal(step, end)

    def _window_terms(self, inputs, mask, mean, variance, items):
        """What micro-batch i adds to S1, S2, N per channel; `items` is n_i
        without a mask."""
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
        """(momentum, renorm momentum or None) of the update ending a window
        of `size` micro-steps (an int or an integer tensor)."""
        momenta = [self.momentum, getattr(self, "renorm_momentum", None)]  # Keras 3.14+
        if self.momentum_unit == "update":
            return momenta
        if isinstance(size, int):
            return [None if m is None else m**size for m in momenta]
        wide = _backend.wide_float()
        size = ops.cast(size, wide)
        return [None if m is None else ops.power(ops.cast(m, wide), size) for m in momenta]

    def _move_statistics(self, mean, variance, write, momenta):
        """Moves the moving statistics towards the window's `mean` and
        `variance` where `write` holds (per channel), as Keras's layer does."""
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
    """Makes the `BatchNormalization` layers of `model` follow `optimizer`.

    For a loop of your own that calls `optimizer.apply` (`model.fit` and
    `keras_accum.training.Trainer` need no call). Nested layers included;
    while attached a layer ignores the compiled optimizer.

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
    # A function, so the optimizer is no tracked dependency of the layer.
    link = None if optimizer is None else (lambda: optimizer)
    found = [x for x in [model, *_compat.all_layers(model)] if isinstance(x, BatchNormalization)]
    for layer in found:
        layer._follows = link
    return found


def convert_batch_normalization(model: keras.Model) -> keras.Model:
    """A copy of `model` with Keras's `BatchNormalization` layers swapped for this one.

    Configs, weights and moving statistics are copied; the copy predicts as
    `model` does. Nested models are converted; subclasses of Keras's layer
    and layers inside a layer of your own are not.

    Args:
        model: a built Sequential or Functional model (a subclassed one
            is refused).

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
