"""`NoiseScaleCallback`: B_simple during `model.fit` (re-exported by `keras_accum.diagnostics`)."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
from keras import ops

from keras_accum import _backend, _gradients
from keras_accum._noise_scale import GradientNoiseScale, squared_norm

# TensorFlow's probe is a traced `tf.while_loop`; JAX and PyTorch use `_gradients`.
if _backend.IS_TENSORFLOW:
    from keras_accum.drivers.tensorflow import noise_probe as _tensorflow
else:
    _tensorflow = None


def _numpy(value):
    """A variable's or a tensor's value as numpy."""
    return ops.convert_to_numpy(ops.convert_to_tensor(value))


class NoiseScaleCallback(keras.callbacks.Callback):
    """Estimates B_simple during `model.fit` from a probe batch.

    Every `every_n_batches` training batches it feeds a `GradientNoiseScale`
    the gradients of the compiled loss (`training=True`) on kappa probe
    micro-batches of b examples; no parameter moves and the non-trainable
    and metric variables are restored. At each epoch end it writes
    `noise_scale` (B_simple), `trace_sigma` and `grad_sq_norm` (``|G|^2``)
    into the logs, nan until the first probe; list it before `CSVLogger`.
    Cost, memory and distribution: docs/guides/diagnostics.md.

    Args:
        data: `(x, y)` or `(x, y, sample_weight)` arrays of at least
            kappa * b examples, kappa * b drawn without replacement per
            probe; or (TensorFlow) a `tf.data.Dataset` of such batches, the
            first kappa * b of each used, repeated as needed.
        micro_batch_size: b.
        kappa: micro-batches per probe (>= 2); B = kappa * b.
        every_n_batches: probe period, in `on_train_batch_end` calls (one per
            `steps_per_execution` steps), counted across epochs.
        ema: decay of the tracker's EMAs.
        seed: for the array draws.
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
        """The JAX and PyTorch probe: micro-batch gradients, summed as they come."""
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
        """JSON-serialisable state (batches seen, tracker, position in `data`):
        a resumed run probes the same batches as an uninterrupted one."""
        tracker = self.tracker
        return {
            "seen": self._seen,
            "updates": int(_numpy(tracker.updates)),
            "trace_sigma_acc": float(_numpy(tracker.trace_sigma_acc)),
            "g2_acc": float(_numpy(tracker.g2_acc)),
            "rng": self._rng.bit_generator.state,
        }

    def set_state(self, state):
        """Restores `get_state()`, advancing this callback's own dataset
        iterator (another iterator could reshuffle differently)."""
        self._seen = int(state["seen"])
        self.tracker.updates.assign(state["updates"])
        self.tracker.trace_sigma_acc.assign(state["trace_sigma_acc"])
        self.tracker.g2_acc.assign(state["g2_acc"])
        self._rng.bit_generator.state = state["rng"]
        if self._arrays is None:
            for _ in range(self._seen // self.every_n_batches):
                next(self._iterator)
