r"""Gradient noise scale B_simple (McCandlish et al. 2018, arXiv:1812.06162).

:math:`B_\text{simple} = \operatorname{tr}(\Sigma) / |G|^2`, where G is the
true (full-data) gradient and Sigma the per-example gradient covariance. It
is estimated from squared gradient norms at two batch sizes, b (a
micro-batch) and B = kappa * b (the whole window of kappa micro-batches with
mean gradients g_1..g_kappa):

.. math::

    |g_b|^2 &= \operatorname{mean}_j |g_j|^2
        \quad \text{(small batch, averaged over the window)} \\
    |g_B|^2 &= |\operatorname{mean}_j g_j|^2 \quad \text{(big batch)} \\
    \widehat{|G|^2} &= (B |g_B|^2 - b |g_b|^2) / (B - b) \\
    \operatorname{tr}(\Sigma) &= (|g_b|^2 - |g_B|^2) / (1/b - 1/B) \\
    B_\text{simple} &= \operatorname{EMA}(\operatorname{tr}(\Sigma))
        / \operatorname{EMA}(\widehat{|G|^2})
        \quad \text{(smooth each, then divide)}

Both estimates are unbiased since
:math:`E|g_b|^2 = |G|^2 + \operatorname{tr}(\Sigma)/b`, but noisy: one
window's ``|G|^2`` estimate can be negative, hence the smoothing before the
division.

How to read it: B_simple is the batch size at which the gradient noise equals
the signal. Batch sizes well below B_simple waste steps (each step is mostly
noise, so doubling the batch nearly halves the steps needed); batch sizes well
above it waste examples (the extra examples barely improve the step). The
critical batch size is typically of the order of B_simple.

Example::

    tracker = GradientNoiseScale(ema=0.95)
    tracker.update_from_micro_grads([grads_1, grads_2, grads_3], 32)
    print(float(tracker.b_simple))

or, with `model.fit`, `NoiseScaleCallback((x_probe, y_probe),
micro_batch_size=32, kappa=8)`, which logs `noise_scale`, `trace_sigma` and
`grad_sq_norm`.

Every backend runs it (`keras.ops`; the probe's gradients come from
`keras_accum._gradients`). TensorFlow alone adds sparse `IndexedSlices`
gradients, a `tf.data.Dataset` as the callback's data, and a
`GradientNoiseScale` that is a `tf.Module` (`tf.train.Checkpoint`); under
JAX and PyTorch its state is `keras.Variable` objects.

Import from here: the estimator is written in `keras_accum._noise_scale`,
the callback in `keras_accum._noise_callback`.
"""

from keras_accum._noise_callback import NoiseScaleCallback
from keras_accum._noise_scale import (
    NOISE_ESTIMATES,  # noqa: F401 (the noise estimates by name, for AdaptiveSteps)
    GradientNoiseScale,
    adam_preconditioned_noise_norm,
    euclidean_noise_norm,
    noise_estimate_norm,
    noise_scale_estimates,
    squared_norm,
)

__all__ = [
    "GradientNoiseScale",
    "NoiseScaleCallback",
    "adam_preconditioned_noise_norm",
    "euclidean_noise_norm",
    "noise_estimate_norm",
    "noise_scale_estimates",
    "squared_norm",
]
