"""Two PyTorch processes (`torch.distributed`, gloo on 127.0.0.1), each
running `model.fit` on its half of every global micro-batch, no DDP
(issue #49): `GradientAccumulation` and `UpdateAccumulationAdam` end where
one process fed the global micro-batches ends, `InvariantAdam` at steps 3
on two processes where one process ends at steps 6 on the halves (kappa =
steps x processes); the processes agree exactly. `GradientAccumulation`
and `InvariantAdam` all-reduce once per window (counted at
`torch.distributed.all_reduce`), `UpdateAccumulationAdam` once per
micro-batch; Keras's own Adam, which reduces nothing, lets the processes
drift apart (the control)."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch.distributed")
ROOT = str(pathlib.Path(__file__).resolve().parents[2])

SCRIPT = r"""
import json, os, sys
rank, world, port, out, kind = sys.argv[1:]
rank, world = int(rank), int(world)
import numpy as np, torch.distributed as dist
calls = [0]
if world > 1:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    reduce = dist.all_reduce
    def counted(*args, **kwargs):
        calls[0] += 1
        return reduce(*args, **kwargs)
    dist.all_reduce = counted
import keras, keras_accum as ka
rng = np.random.default_rng(0)
x = rng.normal(size=(96, 5)).astype("float32"); y = rng.normal(size=(96, 1)).astype("float32")
batch = 8  # global micro-batches of 8
if world > 1:  # process p: rows [8 i + 4 p, 8 i + 4 p + 4) of micro-batch i
    rows = np.concatenate([np.arange(8 * i + 4 * rank, 8 * i + 4 * rank + 4) for i in range(12)])
    x, y, batch = x[rows], y[rows], 4
elif kind == "ia":
    batch = 4  # one process: the same halves, each a micro-batch, in order
make = {
    "ga": lambda: ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=3),
    "ua": lambda: ka.UpdateAccumulationAdam(0.01, steps=3),
    "ia": lambda: ka.InvariantAdam(0.01, steps=3 if world > 1 else 6),
    "keras": lambda: keras.optimizers.Adam(0.01),
}[kind]
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, "tanh"), keras.layers.Dense(1)])
model.compile(optimizer=make(), loss="mse")
model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
np.savez(out, *[np.asarray(w) for w in model.get_weights()])
with open(out + ".json", "w") as f:
    json.dump({"all_reduce": calls[0], "iterations": int(model.optimizer.iterations.value)}, f)
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path, kind, world):
    env = dict(
        os.environ,
        KERAS_BACKEND="torch",
        PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
    )
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    port = str(_free_port())
    outs = [str(tmp_path / f"{kind}_{world}_{rank}.npz") for rank in range(world)]
    children = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(world), port, outs[rank], kind],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    for child in children:
        _, err = child.communicate(timeout=600)
        assert child.returncode == 0, err[-3000:]
    weights = [[w for _, w in sorted(np.load(o).items())] for o in outs]
    counts = [json.loads(pathlib.Path(o + ".json").read_text()) for o in outs]
    return weights, counts


def _max_difference(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


@pytest.mark.parametrize(
    "kind, reduces",
    # 24 micro-batches, windows of 3: 8 windows (one all-reduce each), or
    # one all-reduce of the gradients per micro-batch.
    [("ga", 8), ("ia", 8), ("ua", 24)],
)
def test_two_processes_are_one_process_fed_the_global_batches(tmp_path, kind, reduces):
    (one,), _ = _run(tmp_path, kind, 1)
    (first, second), counts = _run(tmp_path, kind, 2)
    assert _max_difference(first, second) == 0.0  # the processes agree exactly
    assert _max_difference(first, one) < 1e-6
    assert [c["all_reduce"] for c in counts] == [reduces, reduces]
    assert [c["iterations"] for c in counts] == [8, 8]


def test_keras_adam_alone_lets_the_processes_drift_apart(tmp_path):
    # The control: nothing reduces the gradients, each process trains on
    # its own halves.
    (first, second), counts = _run(tmp_path, "keras", 2)
    assert _max_difference(first, second) > 1e-3
    assert [c["all_reduce"] for c in counts] == [0, 0]
