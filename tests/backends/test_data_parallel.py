"""`keras.distribution.DataParallel` on two JAX CPU devices: the optimizers
see the global gradient, so `GradientAccumulation` equals the big batch;
`InvariantAdam` then counts a window as `steps` micro-batches (one per
step, not one per device) and says so; `layers.BatchNormalization`'s moving
statistics are Keras's layer's at the global big batch."""

import os
import subprocess
import sys

import keras
import pytest

pytestmark = pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX's DataParallel")

SCRIPT = """
import warnings, numpy as np, keras, keras_accum as ka
assert len(keras.distribution.list_devices()) == 2
keras.distribution.set_distribution(keras.distribution.DataParallel())
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 5)).astype("float32"); y = rng.normal(size=(64, 1)).astype("float32")
def fitted(optimizer, batch_size):
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
                          keras.layers.Dense(1)])
    m.compile(optimizer=optimizer, loss="mse")
    m.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    return m.get_weights()
ours = fitted(ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=4), 16)
big = fitted(keras.optimizers.Adam(0.01), 64)
print("max_difference", max(float(np.max(np.abs(a - b))) for a, b in zip(ours, big)))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fitted(ka.InvariantAdam(0.01, steps=4), 16)
print("warned", any("kappa = steps" in str(w.message) for w in caught))
"""


def test_data_parallel_two_devices():
    env = dict(
        os.environ,
        KERAS_BACKEND="jax",
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
    )
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert float(lines["max_difference"]) < 1e-5, out.stdout
    assert lines["warned"] == "True", out.stdout


BATCH_NORM = """
import numpy as np, keras, keras_accum as ka
assert len(keras.distribution.list_devices()) == 2
keras.distribution.set_distribution(keras.distribution.DataParallel())
rng = np.random.default_rng(0)
x = rng.normal(1.0, 2.0, size=(48, 6, 2)).astype("float32")
y = rng.normal(size=(48, 1)).astype("float32")
def fitted(layer, optimizer, batch_size):
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((6, 2)), keras.layers.Conv1D(3, 3), layer,
                          keras.layers.Flatten(), keras.layers.Dense(1)])
    m.compile(optimizer=optimizer, loss="mse")
    m.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return m
# Global micro-batches of 8 (4 per device), windows of 3: batches of 24.
ours = fitted(ka.layers.BatchNormalization(momentum=0.5, momentum_unit="update"),
              ka.GradientAccumulation(keras.optimizers.SGD(0.0), steps=3), 8)
big = fitted(keras.layers.BatchNormalization(momentum=0.5), keras.optimizers.SGD(0.0), 24)
a, b = ours.layers[1], big.layers[1]
print("relative_difference", max(
    float(np.max(np.abs(np.asarray(getattr(a, n).value) - np.asarray(getattr(b, n).value))
                 / np.abs(np.asarray(getattr(b, n).value))))
    for n in ("moving_mean", "moving_variance")))
print("micro_steps", int(a.micro_step.value), int(ours.optimizer.micro_step.value))
"""


def test_batch_norm_two_devices_is_keras_at_the_global_big_batch():
    env = dict(
        os.environ,
        KERAS_BACKEND="jax",
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
    )
    out = subprocess.run(
        [sys.executable, "-c", BATCH_NORM], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert float(lines["relative_difference"]) < 1e-5, out.stdout
    assert lines["micro_steps"] == "6 6", out.stdout
