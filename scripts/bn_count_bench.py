"""What `layers.BatchNormalization`'s window count costs on TensorFlow.

A CNN with two of the layers under `GradientAccumulation(steps=4)`: the
ops of the traced train step (`scripts/op_counts.py`'s counter, branches
included) and the time per micro-batch of 5 epochs of 32 micro-batches of
16 images. Run it on one core, once per checkout, arms alternating:

    PYTHONPATH=../before taskset -c 0 python scripts/bn_count_bench.py
    PYTHONPATH=. taskset -c 0 python scripts/bn_count_bench.py

Prints {"ops": N, "ms_per_micro_batch": [5 epochs, sorted]}.
"""

import collections
import gc
import json
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_accum as ka  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from op_counts import graph_ops  # noqa: E402


def build():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(16, 3),
            ka.layers.BatchNormalization(),
            keras.layers.ReLU(),
            keras.layers.Conv2D(16, 3),
            ka.layers.BatchNormalization(),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=ka.GradientAccumulation(keras.optimizers.Adam(1e-3), steps=4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, 512)
    model = build()
    model.fit(x[:64], y[:64], batch_size=16, verbose=0)  # traces the step
    seen, counts = set(), collections.Counter()
    for obj in gc.get_objects():  # the traced step's ConcreteFunction(s)
        if type(obj).__name__ != "ConcreteFunction":
            continue  # (reading `name` off any object may load a library)
        if "one_step_on_data" in str(obj.name):
            counts += graph_ops(obj.graph, seen)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        model.fit(x, y, batch_size=16, verbose=0)
        times.append((time.perf_counter() - start) / 32 * 1000)
    print(json.dumps({"ops": sum(counts.values()), "ms_per_micro_batch": sorted(times)}))


if __name__ == "__main__":
    main()
