"""Two JAX processes on 127.0.0.1 (one CPU device each, gloo collectives)
under `keras.distribution.DataParallel`: `GradientAccumulation(Adam, 4)`
equals one process fed the same global batches, and a run killed mid-window
(SIGKILL of one process) and restarted from its `BackupAndRestore`
checkpoint ends in the state of the uninterrupted run, bit for bit.

Each process feeds its share of every global batch of 16 (numpy input,
`auto_shard_dataset=False`): process p the rows [16 i + 8 p, 16 i + 8 p + 8)
of batch i. 80 examples, 5 global batches an epoch, 4 epochs: 20
micro-batches, 5 updates; every epoch ends mid-window (after micro-batch 5,
10, 15).

Why each process has its own backup folder and `double_checkpoint=True`:
Keras's callbacks know nothing of processes (no `process_index` in
keras/src/callbacks, Keras 3.15), so in one shared folder both processes
would write one `latest.weights.h5`. When one process dies, the other's
next all-reduce fails ("Gloo all-reduce failed ... Connection reset by
peer"), and where that happens inside its epoch-end `save_weights` (which
opens the file for writing before it reads the values) it leaves a
truncated `latest.weights.h5`; `double_checkpoint` then restores the
previous epoch's copy, as the killed process restores its own latest one.
Each restarted process says which epoch it restored, and the processes
compare them before training (an unequal pair fails here, instead of
hanging in the first all-reduce): a process killed after the last
all-reduce of an epoch but before its own save would leave them one epoch
apart, which `BackupAndRestore` cannot reconcile.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="JAX processes (keras.distribution.initialize)"
)
ROOT = str(pathlib.Path(__file__).resolve().parents[2])

WORKER = r"""
import json, os, signal, sys
os.environ["KERAS_BACKEND"] = "jax"
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
import keras, numpy as np
import keras_accum as ka

args = json.loads(sys.argv[1])
pid, n = args["process_id"], args["processes"]
keras.utils.set_random_seed(0)  # before initialize: every process the same seed
if n > 1:
    keras.distribution.initialize(
        job_addresses=f"127.0.0.1:{args['port']}", num_processes=n, process_id=pid)
    keras.distribution.set_distribution(keras.distribution.DataParallel(
        devices=keras.distribution.list_devices(), auto_shard_dataset=False))
rng = np.random.default_rng(0)
x = rng.normal(size=(80, 5)).astype("float32"); y = rng.normal(size=(80, 1)).astype("float32")
local = 16 // n
def share(a):  # this process's rows of every global batch of 16
    return a.reshape(-1, n, local, a.shape[-1])[:, pid].reshape(-1, a.shape[-1])
model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
                          keras.layers.Dense(1)])
optimizer = ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=4)
model.compile(optimizer=optimizer, loss="mse")

class Report(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):  # after BackupAndRestore's restore
        restored = int(np.asarray(optimizer.micro_step))
        print("restored", restored, flush=True)
        if n > 1:
            from jax.experimental import multihost_utils
            seen = multihost_utils.process_allgather(np.int32(restored))
            if len(set(seen.tolist())) != 1:
                raise SystemExit(f"processes restored different micro-steps: {seen.tolist()}")
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
    def on_train_batch_end(self, batch, logs=None):
        if args.get("kill") == [pid, self.epoch, batch]:
            # (the variables are the trainer's inside fit: count, not read)
            print("killed_at", 5 * self.epoch + batch + 1, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

callbacks = [Report()]
if args.get("backup"):
    callbacks.insert(0, keras.callbacks.BackupAndRestore(
        os.path.join(args["backup"], f"process_{pid}"), double_checkpoint=True))
try:
    model.fit(share(x), share(y), batch_size=local, epochs=4, shuffle=False, verbose=0,
              callbacks=callbacks)
except BaseException:
    # Out at once: jax.distributed's shutdown at exit waits for a dead peer.
    import traceback
    traceback.print_exc()
    sys.stdout.flush()
    os._exit(1)
state = {f"weight_{i}": w for i, w in enumerate(model.get_weights())}
state.update({v.path: np.asarray(v.value) for v in optimizer.variables})
np.savez(os.path.join(args["out"], f"process_{pid}.npz"), **state)
print("done", flush=True)
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp, processes, out, **options):
    """Starts `processes` workers (a fresh port each launch); returns them."""
    worker = tmp / "worker.py"
    worker.write_text(WORKER)
    (tmp / out).mkdir(exist_ok=True)
    env = dict(
        os.environ,
        KERAS_BACKEND="jax",
        PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
    )
    env.pop("XLA_FLAGS", None)  # one CPU device per process
    port = _free_port()
    return [
        subprocess.Popen(
            [
                sys.executable,
                str(worker),
                json.dumps(
                    dict(
                        process_id=i, processes=processes, port=port, out=str(tmp / out), **options
                    )
                ),
            ],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(processes)
    ]


def _finish(procs, timeout=240):
    """Each worker's (return code, output); a worker still running after
    `timeout` seconds is killed and the test fails."""
    results = []
    for proc in procs:
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
            pytest.fail(f"a worker ran past {timeout} s:\n{output[-3000:]}")
        results.append((proc.returncode, output))
    return results


def _kill_leftovers(procs):
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _state(tmp, out, process):
    with np.load(tmp / out / f"process_{process}.npz") as f:
        return {key: f[key] for key in f.files}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One process (no distribution, batches of 16) and two processes
    (DataParallel, 8 each), both to the end."""
    tmp = tmp_path_factory.mktemp("jax_processes")
    procs = _launch(tmp, 1, "one") + _launch(tmp, 2, "two")
    try:
        for code, output in _finish(procs):
            assert code == 0, output[-3000:]
    finally:
        _kill_leftovers(procs)
    return tmp


def test_two_processes_equal_one_process_with_the_same_global_batch(uninterrupted):
    one = _state(uninterrupted, "one", 0)
    two = [_state(uninterrupted, "two", p) for p in (0, 1)]
    weights = [key for key in one if key.startswith("weight_")]
    assert len(weights) == 4
    difference = max(float(np.max(np.abs(one[k] - two[0][k]))) for k in weights)
    assert difference < 1e-5, difference
    # Both processes hold the same (replicated) weights and optimizer state.
    assert two[0].keys() == two[1].keys()
    for key in two[0]:
        np.testing.assert_array_equal(two[0][key], two[1][key], err_msg=key)


def test_killed_run_resumes_from_backup_to_the_uninterrupted_state(uninterrupted, tmp_path):
    backup = str(tmp_path / "backup")
    # Process 1 kills itself (SIGKILL) after batch 2 of epoch 2 (0-based):
    # micro-batch 13, one into a window; the last checkpoints are epoch 1's
    # end, micro-batch 10, two into a window.
    procs = _launch(tmp_path, 2, "killed", backup=backup, kill=[1, 2, 2])
    try:
        code, output = _finish(procs[1:])[0]
        assert code == -signal.SIGKILL, output[-3000:]
        assert "killed_at 13" in output, output[-3000:]
        # The survivor fails in its next all-reduce, or hangs there (or in
        # jax.distributed's shutdown): 60 s, then SIGKILL.
        try:
            procs[0].communicate(timeout=60)
        except subprocess.TimeoutExpired:
            procs[0].kill()
            procs[0].communicate()
        assert procs[0].returncode != 0
    finally:
        _kill_leftovers(procs)

    procs = _launch(tmp_path, 2, "resumed", backup=backup)
    try:
        results = _finish(procs)
    finally:
        _kill_leftovers(procs)
    for code, output in results:
        assert code == 0, output[-3000:]
        assert "restored 10" in output, output[-3000:]  # epoch 1's end, mid-window
    for process in (0, 1):
        expected = _state(uninterrupted, "two", process)
        resumed = _state(tmp_path, "resumed", process)
        assert resumed.keys() == expected.keys()
        # Weights, accumulators, Adam's moments and every counter: bit for bit.
        for key in expected:
            np.testing.assert_array_equal(resumed[key], expected[key], err_msg=key)
