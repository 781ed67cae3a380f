"""Two JAX processes on 127.0.0.1 (one CPU device each, gloo collectives)
under `keras.distribution.DataParallel`: `GradientAccumulation(Adam, 4)`
equals one process fed the same global batches, and a run killed mid-window
(SIGKILL of one process) and restarted from its `BackupAndRestore`
checkpoint ends in the state of the uninterrupted run, bit for bit. The same
with `keras_accum.PerDeviceGradients` (also on two CPU devices a process),
whose window-end conditional holds the only parameter-sized all-reduce, and
`InvariantAdam` counting each device as a micro-batch (issue #49).

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
batch = args.get("batch", 16)  # the global batch
local = batch // n
def share(a):  # this process's rows of every global batch
    return a.reshape(-1, n, local, a.shape[-1])[:, pid].reshape(-1, a.shape[-1])
class Net(ka.PerDeviceGradients, keras.Sequential):
    pass
model = (Net if args.get("mixin") else keras.Sequential)(
    [keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
if args.get("optimizer", "ga") == "ga":
    optimizer = ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=args.get("steps", 4))
else:
    optimizer = ka.InvariantAdam(0.01, steps=args["steps"])
model.compile(optimizer=optimizer, loss="mse")
route = getattr(optimizer, "_device_route", None)
print("route", None if route is None else route.devices, flush=True)

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
# (every process at once: a per-device row held by another process is gathered)
state.update(zip((v.path for v in optimizer.variables), optimizer.get_weights()))
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

    def flags(i):  # devices=k: k CPU devices each; dump=True: the HLO in out/hlo_<i>
        flags = []
        if options.get("devices", 1) > 1:
            flags.append(f"--xla_force_host_platform_device_count={options['devices']}")
        if options.get("dump"):
            flags.append(f"--xla_dump_to={tmp / out / f'hlo_{i}'} --xla_dump_hlo_as_text")
        return dict(XLA_FLAGS=" ".join(flags)) if flags else {}

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
            env=dict(env, **flags(i)),
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
    """To the end: one process (no distribution, batches of 16); two
    processes (DataParallel, 8 each) with Keras's train step ("two") and
    with `PerDeviceGradients` ("two_mixin"), their compiled steps dumped;
    `InvariantAdam(steps=2)` on two processes ("ia_two", the mixin) and
    `InvariantAdam(steps=4)` on one process fed the same halves in order
    ("ia_one", batches of 8); the same on two processes of two CPU devices
    each ("four_mixin", "ia_four") and `InvariantAdam(steps=8)` on one
    process fed the same quarters ("ia_one_quarters", batches of 4)."""
    tmp = tmp_path_factory.mktemp("jax_processes")
    runs = [
        (1, "one", {}),
        (2, "two", dict(dump=True)),
        (2, "two_mixin", dict(mixin=True, dump=True)),
        (2, "ia_two", dict(mixin=True, optimizer="ia", steps=2, dump=True)),
        (1, "ia_one", dict(optimizer="ia", steps=4, batch=8)),
        (1, "ia_one_quarters", dict(optimizer="ia", steps=8, batch=4)),
        (2, "four_mixin", dict(mixin=True, devices=2)),
        (2, "ia_four", dict(mixin=True, optimizer="ia", steps=2, devices=2)),
    ]
    outputs = {}
    for group in (runs[:3], runs[3:6], runs[6:]):  # at most 5 processes at once
        procs = [proc for n, out, options in group for proc in _launch(tmp, n, out, **options)]
        try:
            names = [out for n, out, _ in group for _ in range(n)]
            # (a loaded machine: 8 CPU devices' collectives on few cores)
            for name, (code, output) in zip(names, _finish(procs, timeout=480)):
                assert code == 0, output[-3000:]
                outputs.setdefault(name, []).append(output)
        finally:
            _kill_leftovers(procs)
    return tmp, outputs


def _weights(state):
    return [state[key] for key in sorted(state) if key.startswith("weight_")]


def _max_difference(ours, theirs):
    return max(float(np.max(np.abs(a - b))) for a, b in zip(ours, theirs, strict=True))


@pytest.mark.parametrize("run", ["two", "two_mixin", "four_mixin"])
def test_two_processes_equal_one_process_with_the_same_global_batch(uninterrupted, run):
    tmp, outputs = uninterrupted
    one = _state(tmp, "one", 0)
    two = [_state(tmp, run, p) for p in (0, 1)]
    assert len(_weights(one)) == 4
    assert _max_difference(_weights(one), _weights(two[0])) < 1e-5
    # Both processes hold the same (replicated) weights and optimizer state
    # (the mixin's per-device sums gathered from both).
    assert two[0].keys() == two[1].keys()
    for key in two[0]:
        np.testing.assert_array_equal(two[0][key], two[1][key], err_msg=key)
    # The mixin's route takes every process's devices as its rows.
    routes = [line for output in outputs[run] for line in output.splitlines() if "route" in line]
    route = {"two": "route None", "two_mixin": "route 2", "four_mixin": "route 4"}[run]
    assert routes == [route] * 2, routes


def test_per_device_route_equals_keras_route_on_two_processes(uninterrupted):
    tmp, _ = uninterrupted
    for run, devices in (("two_mixin", 2), ("four_mixin", 4)):
        for process in (0, 1):
            plain, mixin = _state(tmp, "two", process), _state(tmp, run, process)
            assert _max_difference(_weights(plain), _weights(mixin)) < 1e-5
            # One accumulator row per device (every process's rows gathered);
            # a window in progress is checked where the killed run resumes.
            rows = [key for key in mixin if key.endswith("_accumulator")]
            assert len(rows) == 4, rows
            assert all(mixin[key].shape[0] == devices for key in rows), rows


def test_invariant_adam_counts_each_process_as_a_micro_batch(uninterrupted):
    # kappa = steps x devices = 2 x 2: as one process with steps=4 fed each
    # process's half of every global batch, in order.
    tmp, outputs = uninterrupted
    assert ["route 2"] * 2 == [
        line for output in outputs["ia_two"] for line in output.splitlines() if "route" in line
    ]
    one = _weights(_state(tmp, "ia_one", 0))
    for process in (0, 1):
        assert _max_difference(_weights(_state(tmp, "ia_two", process)), one) < 1e-6
    # Two devices a process: kappa = 2 x 4, each device's quarter in order.
    one = _weights(_state(tmp, "ia_one_quarters", 0))
    for process in (0, 1):
        assert _max_difference(_weights(_state(tmp, "ia_four", process)), one) < 1e-6


@pytest.mark.parametrize("run", ["two", "two_mixin", "ia_two"])
def test_where_the_compiled_step_all_reduces_on_two_processes(uninterrupted, run):
    # The HLO of process 0's compiled step: Keras's route all-reduces every
    # gradient on every call (the control); the mixin's GA only scalars
    # there, the parameters' sums only inside the window-end conditional;
    # InvariantAdam's parts of m and v there too (twice the parameters).
    from tests.backends.test_per_device import all_reduce_sizes, step_parts

    tmp, _ = uninterrupted
    parameters = sum(w.size for w in _weights(_state(tmp, run, 0)))
    files = sorted((tmp / run / "hlo_0").glob("*jit_train_step*after_optimizations.txt"))
    assert len(files) == 1, files
    blocks, every_call, in_branches = step_parts(files[0])

    def sizes(names):
        return [size for name in sorted(names) for size in all_reduce_sizes(blocks[name])]

    if run == "two":
        assert max(sizes(every_call)) >= parameters, (parameters, sizes(every_call))
    else:
        assert sizes(every_call) and max(sizes(every_call)) <= 8, sizes(every_call)
        moments = 2 if run == "ia_two" else 1
        assert sum(sizes(in_branches)) == moments * parameters, (parameters, sizes(in_branches))


@pytest.mark.parametrize(
    "expected_run, options",
    [("two", {}), ("two_mixin", dict(mixin=True)), ("four_mixin", dict(mixin=True, devices=2))],
)
def test_killed_run_resumes_from_backup_to_the_uninterrupted_state(
    uninterrupted, tmp_path, expected_run, options
):
    reference, _ = uninterrupted
    backup = str(tmp_path / "backup")
    # Process 1 kills itself (SIGKILL) after batch 2 of epoch 2 (0-based):
    # micro-batch 13, one into a window; the last checkpoints are epoch 1's
    # end, micro-batch 10, two into a window.
    procs = _launch(tmp_path, 2, "killed", backup=backup, kill=[1, 2, 2], **options)
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

    procs = _launch(tmp_path, 2, "resumed", backup=backup, **options)
    try:
        results = _finish(procs)
    finally:
        _kill_leftovers(procs)
    for code, output in results:
        assert code == 0, output[-3000:]
        assert "restored 10" in output, output[-3000:]  # epoch 1's end, mid-window
    for process in (0, 1):
        expected = _state(reference, expected_run, process)
        resumed = _state(tmp_path, "resumed", process)
        assert resumed.keys() == expected.keys()
        # Weights, accumulators (each process's rows under the mixin), Adam's
        # moments and every counter: bit for bit.
        for key in expected:
            np.testing.assert_array_equal(resumed[key], expected[key], err_msg=key)
