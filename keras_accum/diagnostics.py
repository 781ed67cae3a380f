r"""Gradient noise scale B_simple (McCandlish et al. 2018, arXiv:1812.06162).

:math:`B_\text{simple} = \operatorname{tr}(\Sigma) / |G|^2`, G the full-data
gradient and Sigma the per-example gradient covariance, estimated from
squared gradient norms at two batch sizes: b (a micro-batch) and
B = kappa * b (a window of kappa micro-batches with mean gradients g_j):

.. math::

    |g_b|^2 &= \operatorname{mean}_j |g_j|^2, \quad
        |g_B|^2 = |\operatorname{mean}_j g_j|^2 \\
    \widehat{|G|^2} &= (B |g_B|^2 - b |g_b|^2) / (B - b) \\
    \operatorname{tr}(\Sigma) &= (|g_b|^2 - |g_B|^2) / (1/b - 1/B) \\
    B_\text{simple} &= \operatorname{EMA}(\operatorname{tr}(\Sigma))
        / \operatorname{EMA}(\widehat{|G|^2})

Example::

    tracker = GradientNoiseScale(ema=0.95)
    tracker.update_from_micro_grads([grads_1, grads_2, grads_3], 32)
    print(float(tracker.b_simple))

With `model.fit`: `NoiseScaleCallback((x_probe, y_probe), micro_batch_size=32,
kappa=8)`. How to read B_simple, the callback's cost and what each backend
runs: docs/guides/diagnostics.md. Import from here; the code is in
`keras_accum._noise_scale` and `keras_accum._noise_callback`.
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
