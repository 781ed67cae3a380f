"""`NoiseScaleCallback`: B_simple during `model.fit`, from a probe batch
(`keras_accum.diagnostics`, which documents it and re-exports it)."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
from keras import ops

from keras_accum import _backend, _gradients
from keras_accum._noise_scale import GradientNoiseScale, squared_norm

# TensorFlow's probe (a traced `tf.while_loop`, `tf.data` input); JAX and
# PyTorch probe through `keras_accum._gradients`.
if _backend.IS_TENSORFLOW:
    from keras_accum.drivers.tensorflow import noise_probe as _tensorflow
else:
    _tensorflow = None


def _numpy(value):
    """A variable's or a tensor's value as numpy."""
    return ops.convert_to_numpy(ops.convert_to_tensor(value))


class NoiseScaleCallback(keras.callbacks.Callback):
    """Estimates B_simple during `model.fit` from a probe batch.

    Every `every_n_batches` training batches (counted across epochs) it takes
    kappa * b probe examples, splits them into kappa micro-batches of b,
    computes each micro-batch's gradient of the compiled loss
    (`model.compute_loss`, including regularisation losses) and feeds a
    `GradientNoiseScale`. At each epoch end it writes the current
    `noise_scale` (B_simple), `trace_sigma` and `grad_sq_norm` (``|G|^2``) into
    the epoch logs, so they reach `History`; put this callback before a
    `CSVLogger` in the list so the logger sees them. They are nan until the
    first probe has run.

    Cost: each probe is kappa extra forward/backward passes on b examples
    (one training step's worth of compute when kappa * b equals the training
    batch), one micro-batch at a time: under TensorFlow in a
    `tf.while_loop`, traced once; under JAX a jitted `jax.grad` of the
    model's stateless loss, compiled once; under PyTorch eager autograd.
    Memory added: one parameter-sized buffer for the running sum of the
    micro-batch gradients plus a few scalars (and, transiently, one copy of
    the non-trainable and metric variables, see below: large if a frozen
    backbone's weights are among them). No parameter moves.

    Side effects are undone: the forward passes run with `training=True`
    (dropout on, batch norm in batch mode, as in `train_step`), and the
    non-trainable variables (batch norm statistics, RNG seeds) and metric
    variables are restored after each probe (under JAX never written: the
    probe is stateless).

    Under `tf.distribute.MirroredStrategy` the probe runs, like every
    callback of `fit`, outside the strategy scope, in cross-replica context:
    whole micro-batches on one device, the same numbers as without the
    strategy. Calling `probe_fn` inside the scope is not supported.

    Args:
        data: `(x, y)` or `(x, y, sample_weight)` arrays with at least
            kappa * b examples; each probe draws kappa * b of them at random
            without replacement. Or a `tf.data.Dataset` of such batches
            (each with at least kappa * b examples; the first kappa * b are
            used), repeated as needed (TensorFlow only).
        micro_batch_size: b.
        kappa: micro-batches per probe (>= 2); B = kappa * b.
        every_n_batches: probe period, in `on_train_batch_end` calls (one per
            `steps_per_execution` steps).
        ema: decay of the tracker's EMAs. seed: for the array draws.
    """

    def __init__(
        self,
        data: Any,
        micro_batch_size: int,
        kappa: int,
        every_n_batches: int = 100,
        ema: float = 0.95,
        seed: int | None = None,
    ):
        super().__init__()
        for name, value, low in (
            ("micro_batch_size", micro_batch_size, 1),
            ("kappa", kappa, 2),
            ("every_n_batches", every_n_batches, 1),
        ):
            if not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"`{name}` must be an integer >= {low}. Received: {name}={value}")
        self.micro_batch_size, self.kappa = int(micro_batch_size), int(kappa)
        self.every_n_batches = int(every_n_batches)
        self.tracker = GradientNoiseScale(ema)
        self._rng = np.random.default_rng(seed)
        n = self.kappa * self.micro_batch_size
        if _tensorflow is not None and _tensorflow.is_dataset(data):
            self._arrays, self._iterator = None, iter(data.repeat())
        else:
            self._arrays = _backend.map_structure(np.asarray, tuple(data))
            size = len(_backend.flatten(self._arrays)[0])
            if size < n:
                raise ValueError(
                    "`data` must hold at least kappa * micro_batch_size = "
                    f"{n} examples. Received: {size} examples"
                )
        self._seen = 0
        if _tensorflow is not None:
            self.probe_fn = _tensorflow.probe_function(self)
        else:
            self.probe_fn = self._probe_portable
            self._gradients = None

    def _next_probe(self):
        n = self.kappa * self.micro_batch_size
        if self._arrays is not None:
            idx = self._rng.choice(len(_backend.flatten(self._arrays)[0]), n, replace=False)
            data = _backend.map_structure(lambda a: a[idx], self._arrays)
        else:
            data = _tensorflow.next_batch(self._iterator, n)
        if _tensorflow is None:
            return data  # numpy arrays, of one fixed shape: JAX compiles once
        return _tensorflow.as_tensors(data)

    def _probe_portable(self, data):
        """The probe under JAX and PyTorch: the micro-batches' gradients from
        `keras_accum._gradients`, summed as they come."""
        model, kappa, b = self.model, self.kappa, self.micro_batch_size
        if self._gradients is None or self._gradients.model is not model:
            self._gradients = _gradients.MicroBatchGradients(model)
        x, y, sw = keras.utils.unpack_x_y_sample_weight(data)
        batches = (
            _backend.map_structure(lambda t, i=i: t[i * b : (i + 1) * b], (x, y, sw))
            for i in range(kappa)
        )
        small, acc = 0.0, None
        for grads in self._gradients.gradients(batches):
            small = small + squared_norm(grads)
            acc = grads if acc is None else [a + g for a, g in zip(acc, grads)]
        # |g_b|^2 = mean_j |g_j|^2 ; |g_B|^2 = |sum_j g_j / kappa|^2
        return self.tracker.update(small / kappa, squared_norm(acc) / kappa**2, b, kappa * b)

    def on_train_batch_end(self, batch, logs=None):
        self._seen += 1
        if self._seen % self.every_n_batches == 0:
            self.probe_fn(self._next_probe())

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs.update({k: float(v) for k, v in self.tracker.result().items()})

    def get_state(self):
        """The estimator's state as JSON-serialisable values: batches seen,
        the tracker's variables and the position in `data`, so that a
        resumed run (`set_state`) probes the same batches and reports the
        same numbers as an uninterrupted one."""
        tracker = self.tracker
        return {
            "seen": self._seen,
            "updates": int(_numpy(tracker.updates)),
            "trace_sigma_acc": float(_numpy(tracker.trace_sigma_acc)),
            "g2_acc": float(_numpy(tracker.g2_acc)),
            "rng": self._rng.bit_generator.state,
        }

    def set_state(self, state):
        """Restores `get_state()` into a fresh callback; its dataset
        iterator is advanced past the probes already drawn (a new iterator
        of a reshuffling dataset could see another order)."""
        self._seen = int(state["seen"])
        self.tracker.updates.assign(state["updates"])
        self.tracker.trace_sigma_acc.assign(state["trace_sigma_acc"])
        self.tracker.g2_acc.assign(state["g2_acc"])
        self._rng.bit_generator.state = state["rng"]
        if self._arrays is None:
            for _ in range(self._seen // self.every_n_batches):
                next(self._iterator)
