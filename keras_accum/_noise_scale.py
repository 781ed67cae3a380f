"""The gradient noise scale's estimator: squared norms, one-window estimates
and `GradientNoiseScale` (documented and re-exported by `keras_accum.diagnostics`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import keras
from keras import ops

from keras_accum import _backend, sharpness
from keras_accum._backend import tf


def _value(t):
    """A variable's value, a tensor or a Python number as a tensor."""
    return ops.convert_to_tensor(t)


def _sq_norm_one(g, weight=None):
    if g is None:
        return ops.zeros((), "float32")
    if isinstance(g, tf.IndexedSlices):  # never, except under TensorFlow
        # Repeated rows add up in the dense gradient: sum them before squaring.
        unique, pos = tf.unique(g.indices)
        values = tf.math.unsorted_segment_sum(g.values, pos, tf.shape(unique)[0])
        if weight is not None:
            weight = tf.gather(weight, unique)
        g = values
    square = ops.square(ops.cast(g, "float32"))
    if weight is not None:
        square = square * ops.cast(weight, "float32")
    return ops.sum(square)


def squared_norm(grads: Sequence[Any], weights: Sequence[Any] | None = None) -> Any:
    """Sum of squared entries of a list of gradients, as float32.

    Args:
        grads: gradients; `None` counts as zero, `tf.IndexedSlices` as its
            dense equivalent (duplicate indices summed).
        weights: optional, one tensor per gradient (the variable's shape):
            gives sum w g^2, the squared norm in the metric diag(w).
    """
    weights = [None] * len(grads) if weights is None else list(weights)
    terms = [_sq_norm_one(g, w) for g, w in zip(grads, weights)]
    return _backend.add_n(terms or [ops.zeros((), "float32")])


def euclidean_noise_norm(optimizer: Any = None):
    """The plain B_simple's squared norm, sum g^2 (`optimizer` unused)."""
    del optimizer
    return squared_norm


def adam_preconditioned_noise_norm(optimizer: Any):
    """A squared-norm function, sum g^2 / (sqrt(v_hat) + epsilon): Adam's metric P.

    B_simple in it, tr(P^-1 Sigma) / (G^T P^-1 G), is that of the SGD Adam
    runs with P frozen (docs/guides/diagnostics.md); before the first update
    (weights 1 / epsilon), the plain B_simple.

    Args:
        optimizer: built, as for `sharpness.adam_preconditioner` (v read per call).
    """
    epsilon = float(getattr(optimizer, "inner_optimizer", optimizer).epsilon)

    def norm(grads):
        inverse_roots = sharpness.adam_preconditioner(optimizer)  # 1 / sqrt(sqrt(v_hat) + eps)
        weights = [ops.where(ops.isfinite(p), ops.square(p), 1.0 / epsilon) for p in inverse_roots]
        return squared_norm(grads, weights)

    return norm


# name -> factory(optimizer) -> squared_norm(grads), for
# `GradientNoiseScale(squared_norm=...)` and `AdaptiveSteps(noise_estimate=...)`.
NOISE_ESTIMATES = {
    "b_simple": euclidean_noise_norm,
    "adam_preconditioned": adam_preconditioned_noise_norm,
}


def noise_estimate_norm(noise_estimate: Any, optimizer: Any = None):
    """The squared-norm function of a noise estimate for `optimizer`.

    Args:
        noise_estimate: a `NOISE_ESTIMATES` name ("b_simple",
            "adam_preconditioned") or a factory `fn(optimizer) -> fn(grads)`.
        optimizer: passed to the factory.
    """
    if isinstance(noise_estimate, str):
        if noise_estimate not in NOISE_ESTIMATES:
            raise ValueError(
                f"`noise_estimate` must be one of {sorted(NOISE_ESTIMATES)} or a callable. "
                f"Received: noise_estimate={noise_estimate!r}"
            )
        noise_estimate = NOISE_ESTIMATES[noise_estimate]
    if not callable(noise_estimate):
        raise ValueError(
            f"`noise_estimate` must be one of {sorted(NOISE_ESTIMATES)} or a callable. "
            f"Received: noise_estimate={noise_estimate!r}"
        )
    return noise_estimate(optimizer)


def _check_sizes(small_batch, big_batch):
    b, B = _backend.static_value(small_batch), _backend.static_value(big_batch)
    if b is not None and not b > 0:
        raise ValueError(f"`small_batch` must be > 0. Received: small_batch={b}")
    if b is not None and B is not None and not B > b:
        raise ValueError(
            f"`big_batch` must be > `small_batch`. Received: small_batch={b}, big_batch={B}"
        )


def noise_scale_estimates(
    small_sq_norm: Any, big_sq_norm: Any, small_batch: float, big_batch: float
) -> tuple[Any, Any]:
    """Unbiased one-window estimates ``(|G|^2, tr(Sigma))``.

    Args:
        small_sq_norm: ``|g_b|^2``, mean squared norm of the micro-batch gradients.
        big_sq_norm: ``|g_B|^2``, squared norm of the window's mean gradient.
        small_batch: b.
        big_batch: B; `B > b > 0` is checked when both are known at trace time.
    """
    _check_sizes(small_batch, big_batch)
    s = ops.cast(small_sq_norm, "float32")
    g = ops.cast(big_sq_norm, "float32")
    b = ops.cast(small_batch, "float32")
    B = ops.cast(big_batch, "float32")
    # |G|^2 = (B |g_B|^2 - b |g_b|^2) / (B - b)
    g2 = (B * g - b * s) / (B - b)
    # tr(Sigma) = (|g_b|^2 - |g_B|^2) / (1/b - 1/B)
    trace = (s - g) / (1.0 / b - 1.0 / B)
    return g2, trace


def _mean_grad(column):
    """Mean of one variable's gradients over the micro-batches."""
    column = [g for g in column if g is not None]
    if not column:
        return None
    if all(isinstance(g, tf.IndexedSlices) for g in column):
        # Concatenation is the sparse sum; squared_norm merges the duplicates.
        return tf.IndexedSlices(
            tf.concat([g.values for g in column], 0) / len(column),
            tf.concat([g.indices for g in column], 0),
            column[0].dense_shape,
        )
    return _backend.add_n([ops.convert_to_tensor(g) for g in column]) / len(column)


class GradientNoiseScale(_backend.Module):
    """Running B_simple from bias-corrected EMAs of ``|G|^2`` and tr(Sigma).

    State: `updates` (windows seen), `trace_sigma_acc` and `g2_acc` (raw
    EMAs from 0, acc = ema * acc + (1 - ema) * x). `trace_sigma` and `g2`
    are bias-corrected, acc / (1 - ema**updates), signs included;
    `b_simple` = trace_sigma / g2 is +inf when the smoothed ``|G|^2`` is
    <= 0. All are nan before the first update. Under TensorFlow this is a
    `tf.Module` (`tf.train.Checkpoint`); see docs/guides/diagnostics.md.

    Args:
        ema: decay in [0, 1); 0 keeps only the last window.
        name: the `tf.Module`'s name (TensorFlow).
        squared_norm: a function of a gradient list (default `squared_norm`;
            or e.g. `adam_preconditioned_noise_norm(optimizer)`).
    """

    def __init__(self, ema: float = 0.95, name: str | None = None, squared_norm=None):
        if _backend.IS_TENSORFLOW:
            super().__init__(name=name)
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"`ema` must be in [0, 1). Received: ema={ema}")
        self.ema = float(ema)
        self._squared_norm = squared_norm or globals()["squared_norm"]
        if _backend.IS_TENSORFLOW:
            with self.name_scope:
                self.updates = tf.Variable(0, dtype=tf.int64, name="updates", trainable=False)
                self.trace_sigma_acc = tf.Variable(0.0, name="trace_sigma_acc", trainable=False)
                self.g2_acc = tf.Variable(0.0, name="g2_acc", trainable=False)
        else:
            make = functools.partial(keras.Variable, trainable=False)
            self.updates = make(0, dtype="int64", name="updates")
            self.trace_sigma_acc = make(0.0, dtype="float32", name="trace_sigma_acc")
            self.g2_acc = make(0.0, dtype="float32", name="g2_acc")

    def update(
        self,
        micro_grads_sq_norm_mean: Any,
        window_grad_sq_norm: Any,
        micro_batch_size: float,
        window_size: float,
    ) -> Any:
        """Feeds one window: ``|g_b|^2``, ``|g_B|^2``, b, B. Returns `b_simple`."""
        g2, trace = noise_scale_estimates(
            micro_grads_sq_norm_mean, window_grad_sq_norm, micro_batch_size, window_size
        )
        # acc = ema * acc + (1 - ema) * x
        self.trace_sigma_acc.assign_add((1.0 - self.ema) * (trace - _value(self.trace_sigma_acc)))
        self.g2_acc.assign_add((1.0 - self.ema) * (g2 - _value(self.g2_acc)))
        self.updates.assign_add(1)
        return self.b_simple

    def update_from_micro_grads(
        self, micro_grads: Sequence[Sequence[Any]], micro_batch_size: float
    ) -> Any:
        """Feeds one window from explicit gradients; returns `b_simple`.

        Args:
            micro_grads: kappa >= 2 gradient lists (one per micro-batch, the
                same variables in the same order), each a mean over
                `micro_batch_size` examples.
            micro_batch_size: b.
        """
        kappa = len(micro_grads)
        if kappa < 2:
            raise ValueError(
                f"`micro_grads` needs at least 2 micro-batches. Received: len(micro_grads)={kappa}"
            )
        norm = self._squared_norm
        small = _backend.add_n([norm(g) for g in micro_grads]) / kappa
        big = norm([_mean_grad(col) for col in zip(*micro_grads)])
        return self.update(small, big, micro_batch_size, kappa * micro_batch_size)

    def _correction(self):
        # 1 - ema**t; 0 before any update, which makes every result nan.
        return 1.0 - ops.power(self.ema, ops.cast(self.updates, "float32"))

    @property
    def trace_sigma(self) -> Any:
        return _value(self.trace_sigma_acc) / self._correction()

    @property
    def g2(self) -> Any:
        return _value(self.g2_acc) / self._correction()

    @property
    def b_simple(self) -> Any:
        trace, g2 = _value(self.trace_sigma_acc), _value(self.g2_acc)
        ratio = ops.divide_no_nan(trace, g2)
        ratio = ops.where(g2 > 0, ratio, float("inf"))
        return ops.where(_value(self.updates) > 0, ratio, float("nan"))

    def result(self) -> dict[str, Any]:
        """Dict with `noise_scale`, `trace_sigma`, `grad_sq_norm` tensors."""
        return {
            "noise_scale": self.b_simple,
            "trace_sigma": self.trace_sigma,
            "grad_sq_norm": self.g2,
        }
