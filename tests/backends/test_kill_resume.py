"""SIGKILL in the middle of `model.fit`, resumed by Keras's
`BackupAndRestore`, on whichever backend Keras runs (TensorFlow in the
suite, JAX and PyTorch through `.ci/backends`).

5 micro-batches an epoch and `steps=4`: every epoch ends inside a window,
so the backup at each epoch's end holds a half-full window (accumulators,
moments, counters). The child kills itself (SIGKILL, no clean-up) in the
middle of epoch 3; the same command run again restores the backup of
epoch 2 and trains to the end. The weights and every optimizer variable
then equal an uninterrupted run's, bit for bit.
"""

import os
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest

BACKEND = keras.backend.backend()
ROOT = pathlib.Path(__file__).resolve().parents[2]

CHILD = r"""
import os, signal, sys
import numpy as np
import keras
import keras_accum as ka

backup, out, name, kill = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "kill"
rng = np.random.default_rng(0)
x = rng.normal(size=(40, 5)).astype("float32")
y = rng.normal(size=(40, 1)).astype("float32")
keras.utils.set_random_seed(0)
model = keras.Sequential(
    [keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]
)
optimizer = {
    "ga": lambda: ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=4),
    "ua": lambda: ka.UpdateAccumulationAdam(0.01, steps=4),
    "ia": lambda: ka.InvariantAdam(0.01, steps=4),
}[name]()
model.compile(optimizer=optimizer, loss="mse")


class Kill(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if kill and self.epoch == 2 and batch == 2:
            os.kill(os.getpid(), signal.SIGKILL)


model.fit(
    x, y, batch_size=8, epochs=4, shuffle=False, verbose=0,
    callbacks=[keras.callbacks.BackupAndRestore(backup), Kill()],
)
state = [keras.ops.convert_to_numpy(v) for v in model.weights + optimizer.variables]
np.savez(out, *state)
print("micro_step", int(keras.ops.convert_to_numpy(optimizer.micro_step)))
"""


def run_child(tmp_path, backup, out, name, kill):
    env = dict(os.environ, KERAS_BACKEND=BACKEND, TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    command = [sys.executable, str(script), str(backup), str(out), name, kill]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ga", "ua", "ia"])
def test_sigkill_mid_fit_resumes_to_the_uninterrupted_run(tmp_path, name):
    killed = run_child(tmp_path, tmp_path / "backup", tmp_path / "resumed.npz", name, "kill")
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert (tmp_path / "backup").exists()  # epoch 2's backup, mid-window
    resumed = run_child(tmp_path, tmp_path / "backup", tmp_path / "resumed.npz", name, "no")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    # 4 epochs of 5 micro-batches: epoch 3 was redone from the backup, not counted twice.
    assert resumed.stdout.split()[-2:] == ["micro_step", "20"]
    plain = run_child(tmp_path, tmp_path / "backup2", tmp_path / "plain.npz", name, "no")
    assert plain.returncode == 0, plain.stderr[-2000:]
    with np.load(tmp_path / "resumed.npz") as a, np.load(tmp_path / "plain.npz") as b:
        assert len(a.files) == len(b.files) > 4
        for key in a.files:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
