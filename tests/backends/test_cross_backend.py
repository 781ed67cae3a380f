"""A `.keras` file saved mid-window on one backend loads with its state on
another and trains on as the saving backend does.

Run under each backend (`.ci/backends`), it saves on its own backend and
loads on the next one of the cycle TensorFlow -> JAX -> PyTorch ->
TensorFlow, in its own process: each backend's file is loaded once and
each backend loads once (all six directions took twice the CI time).
"""

import importlib.util
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from conftest import ends_mid_window

import keras_accum as ka

BACKEND = keras.backend.backend()
MODULES = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}
CYCLE = list(MODULES)
OTHERS = [CYCLE[(CYCLE.index(BACKEND) + 1) % len(CYCLE)]]

OPTIMIZERS = {
    "ga": lambda: ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=4),
    "ua": lambda: ka.UpdateAccumulationAdam(0.01, steps=4),
    "ia": lambda: ka.InvariantAdam(
        0.01, steps=ka.PiecewiseSteps([4], [4, 2]), scaling_rule="fixed_beta_1"
    ),
}

CONTINUE = """
import sys, numpy as np, keras, keras_accum
x, y = np.load(sys.argv[2])["x"], np.load(sys.argv[2])["y"]
model = keras.saving.load_model(sys.argv[1])
assert model.optimizer.pending_micro_batches() == 2, model.optimizer.pending_micro_batches()
model.fit(x[16:], y[16:], batch_size=8, epochs=1, shuffle=False, verbose=0)
model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
np.savez(sys.argv[3], *model.get_weights(), iterations=int(model.optimizer.iterations))
"""


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 5)).astype("float32")
    return x, (x @ rng.normal(size=(5, 1))).astype("float32")


def model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]
    )


@ends_mid_window  # saved 2 micro-batches into a window, on purpose
@pytest.mark.parametrize("other", OTHERS)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_saved_mid_window_loads_on_another_backend(name, other, tmp_path):
    if importlib.util.find_spec(MODULES[other]) is None:
        pytest.skip(f"{other} is not installed (.ci/backends installs it)")
    x, y = data()
    net = model()
    net.compile(optimizer=OPTIMIZERS[name](), loss="mse")
    net.fit(x[:16], y[:16], batch_size=8, epochs=1, shuffle=False, verbose=0)  # mid-window
    path, arrays, out = tmp_path / "mid.keras", tmp_path / "data.npz", tmp_path / "out.npz"
    net.save(path)
    np.savez(arrays, x=x, y=y)
    env = dict(os.environ, KERAS_BACKEND=other, TF_CPP_MIN_LOG_LEVEL="2")
    run = subprocess.run(
        [sys.executable, "-c", CONTINUE, str(path), str(arrays), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # The same continuation here, on the saving backend.
    net.fit(x[16:], y[16:], batch_size=8, epochs=1, shuffle=False, verbose=0)
    net.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    theirs = np.load(out)
    assert int(theirs["iterations"]) == int(net.optimizer.iterations)
    for i, ours in enumerate(net.get_weights()):
        np.testing.assert_allclose(theirs[f"arr_{i}"], ours, rtol=1e-5, atol=1e-6)


BATCH_NORM_CONTINUE = """
import sys, numpy as np, keras, keras_accum
x, y = np.load(sys.argv[2])["x"], np.load(sys.argv[2])["y"]
model = keras.saving.load_model(sys.argv[1])
model.fit(x[28:], y[28:], batch_size=4, epochs=1, shuffle=False, verbose=0)
np.savez(sys.argv[3], *[keras.ops.convert_to_numpy(v) for v in model.weights])
"""


@pytest.mark.parametrize("other", OTHERS)
def test_batch_norm_saved_mid_window_goes_on_on_another_backend(other, tmp_path):
    # Saved 3 micro-batches into a window: every backend's file holds the
    # layer's count of its windows, so the other backend ends that window
    # where this one does. The continuation ends inside one (its sums and
    # counters compared too).
    if importlib.util.find_spec(MODULES[other]) is None:
        pytest.skip(f"{other} is not installed (.ci/backends installs it)")
    rng = np.random.default_rng(0)
    x = rng.normal(1.0, 2.0, size=(56, 6, 2)).astype("float32")
    y = rng.normal(size=(56, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    net = keras.Sequential(
        [
            keras.Input((6, 2)),
            # No bias before the normalization: its gradient is rounding
            # noise, which Adam would scale up differently on each backend.
            keras.layers.Conv1D(3, 3, use_bias=False),
            ka.layers.BatchNormalization(momentum=0.5),
            keras.layers.Flatten(),
            keras.layers.Dense(1),
        ]
    )
    net.compile(optimizer=ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=4), loss="mse")
    net.fit(x[:28], y[:28], batch_size=4, epochs=1, shuffle=False, verbose=0)  # 1 window and 3
    path, arrays, out = tmp_path / "bn.keras", tmp_path / "data.npz", tmp_path / "out.npz"
    net.save(path)
    np.savez(arrays, x=x, y=y)
    env = dict(os.environ, KERAS_BACKEND=other, TF_CPP_MIN_LOG_LEVEL="2")
    run = subprocess.run(
        [sys.executable, "-c", BATCH_NORM_CONTINUE, str(path), str(arrays), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    net.fit(x[28:], y[28:], batch_size=4, epochs=1, shuffle=False, verbose=0)  # 7 more: 10 + 4
    ours = [keras.ops.convert_to_numpy(v) for v in net.weights]
    theirs = np.load(out)
    assert len(theirs.files) == len(ours)
    names = [v.name for v in net.weights]
    assert np.any(ours[names.index("window_count")] > 0)  # in a window
    assert ours[names.index("window_end")] == 16 and ours[names.index("micro_step")] == 14
    for i, mine in enumerate(ours):
        np.testing.assert_allclose(theirs[f"arr_{i}"], mine, rtol=1e-5, atol=1e-5)
