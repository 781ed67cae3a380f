"""The sharpness probe's pieces against numpy: power iteration on a known
quadratic, the stability constants, the log-log crossing (report's, which
the frontier table uses too)."""

import math

import numpy as np
import pytest
import tensorflow as tf

from keras_accum.experiments.invariance import report, sharpness


def test_power_iteration_matches_numpy_on_a_quadratic():
    """loss = w.H w / 2 has Hessian H; with P = diag(p), D = P^-1/2, the top
    eigenvalue of D H D is that of P^-1 H (numpy's, non-symmetric)."""
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.normal(size=(6, 6)))
    h = (q * [10.0, 4.0, 2.0, 1.0, 0.5, -0.3]) @ q.T  # one negative direction
    p = rng.uniform(0.2, 3.0, size=6)
    w = tf.Variable(rng.normal(size=6).astype("float32"))
    h_tf = tf.constant(h, "float32")
    loss = lambda: 0.5 * tf.reduce_sum(w * tf.linalg.matvec(h_tf, w))
    expected = max(np.linalg.eigvals(np.diag(1 / p) @ h).real)
    scale = [tf.constant(1 / np.sqrt(p), "float32")]
    top = sharpness.preconditioned_sharpness(loss, [w], scale, iterations=200)
    assert float(top) == pytest.approx(expected, rel=1e-4)
    plain = sharpness.preconditioned_sharpness(loss, [w], [tf.ones(6)], iterations=200)
    assert float(plain) == pytest.approx(10.0, rel=1e-4)


@pytest.mark.parametrize(
    "kappa,rule,expected",
    [
        (1, "invariant", 3.8 / 0.1),  # (2 + 2 x 0.9) / (1 - 0.9)
        (8, "invariant", 2.4 / 0.8 / 8),  # beta_1 = 1 - 8 x 0.1 = 0.2
        (8, "power", (2 + 2 * 0.9**8) / (1 - 0.9**8) / 8),
        (8, "fixed_beta_1", 38 / 8),
    ],
)
def test_threshold_times_lr(kappa, rule, expected):
    assert sharpness.threshold_times_lr(kappa, rule) == pytest.approx(expected, rel=1e-12)


def test_crossing_lr_interpolates_in_log_log():
    lrs, values = [1e-4, 1e-3, 1e-2], [0.01, 0.1, 10.0]
    # Between 1e-3 (0.1) and 1e-2 (10): 1.0 is half way in log value.
    assert report.crossing_lr(lrs, values, 1.0) == pytest.approx(math.sqrt(1e-3 * 1e-2))
    assert report.crossing_lr(lrs, values, 0.001) == 0.0
    assert report.crossing_lr(lrs, values, 100.0) == math.inf
