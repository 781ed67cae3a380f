"""Why GradientAccumulation routes its inner optimizer's writes under XLA:
time per micro-step of GradientAccumulation(Adam, 4) under XLA on one
replica, today's routed select against a plain `tf.cond` around the inner
update (BENCHMARKS_HISTORY.md, "The inner update under XLA"). Both variants in one
process, timed in turns. About 3 minutes; pin it for steadier numbers:

    TF_NUM_INTRAOP_THREADS=1 TF_NUM_INTEROP_THREADS=1 taskset -c 1 \
        python scripts/xla_routing_bench.py
"""

import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The harness is TensorFlow: this script sets the backend itself (an explicit
# KERAS_BACKEND is kept, and then refused in one line if it is another).
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# Use the package of this checkout, whatever else is installed.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import statistics
import time

import keras
import numpy as np
import tensorflow as tf

import keras_accum as ka
from keras_accum.drivers.tensorflow import _execution

ROUTED = _execution.at_window_end


def branch(boundary, end, every_step):
    """The window's update in a plain `tf.cond`, also under XLA."""
    if every_step:
        end(None)
    else:
        tf.cond(boundary, lambda: end(None), lambda: None)


def build(width, depth, variant):
    """A compiled step of an MLP with GradientAccumulation(Adam, 4), its
    window end traced as today (`routed`) or as a `cond`."""
    keras.utils.set_random_seed(0)
    hidden = [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
    model = keras.Sequential([keras.Input((256,)), *hidden, keras.layers.Dense(10)])
    optimizer = ka.GradientAccumulation(keras.optimizers.Adam(1e-3), 4)
    variables = model.trainable_variables
    optimizer.build(variables)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(jit_compile=True)
    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        optimizer.apply(tape.gradient(value, variables), variables)

    x, y = tf.random.normal((32, 256)), tf.zeros((32,), "int32")
    _execution.at_window_end = branch if variant == "cond" else ROUTED
    try:
        for _ in range(4):  # traced and compiled here, under the variant
            step(x, y)
    finally:
        _execution.at_window_end = ROUTED
    return lambda: step(x, y), sum(int(np.prod(v.shape)) for v in variables)


def main():
    for width, depth in [(512, 2), (1024, 4)]:
        steps = {variant: build(width, depth, variant) for variant in ("routed", "cond")}
        times = {variant: [] for variant in steps}
        for _ in range(7):
            for variant, (step, _) in steps.items():
                start = time.perf_counter()
                for _ in range(40):
                    step()
                times[variant].append((time.perf_counter() - start) / 40)
        ratios = [c / r for c, r in zip(times["cond"], times["routed"])]
        ms = {variant: statistics.median(t) * 1e3 for variant, t in times.items()}
        print(
            f"mlp {depth}x{width} ({steps['routed'][1]:,} parameters): routed "
            f"{ms['routed']:.3f} ms, cond {ms['cond']:.3f} ms per micro-step; cond/routed "
            f"per round {' '.join(f'{x:.3f}' for x in ratios)}, "
            f"median {statistics.median(ratios):.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
