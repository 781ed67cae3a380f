"""What a refactor did to the train step: one line per optimizer, mode and
model size with a digest of the step's operations and their count. Two
checkouts that print the same lines run the same operations, so their
speed cannot differ by the code (BENCHMARKS_HISTORY.md, "Same step, op
for op"). The backend is `KERAS_BACKEND`'s (TensorFlow when unset):

* TensorFlow: the multiset of op types of the traced step in graph mode
  (function library included), and of the optimized HLO opcodes under XLA.
* JAX: the optimized HLO opcodes of a jitted step (`stateless_call`, the
  gradient, `stateless_apply`).
* PyTorch (eager): the `aten::` operators dispatched over 8 micro-steps
  (two windows) of `apply`, counted by `torch.profiler`; the last column
  is the host syncs among them (`aten::_local_scalar_dense`, a tensor read
  as a Python number).

About a minute:

    python scripts/step_digest.py > after.txt   # in each checkout, then diff
    KERAS_BACKEND=torch python scripts/step_digest.py
"""

import collections
import hashlib
import os
import pathlib
import re
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The harness is TensorFlow: this script sets the backend itself (an explicit
# KERAS_BACKEND is kept, and then refused in one line if it is another).
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# Use the package of this checkout, whatever else is installed.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes", ["64", "4096"], "Hidden widths: below and above the compiled folds.")

OPTIMIZERS = {
    "gradient_accumulation": lambda ka, keras: ka.GradientAccumulation(
        keras.optimizers.Adam(1e-3), 4
    ),
    "invariant_adam": lambda ka, keras: ka.InvariantAdam(1e-3, steps=4),
    "update_accumulation_adam": lambda ka, keras: ka.UpdateAccumulationAdam(1e-3, steps=4),
    "invariant_adam_steps_1": lambda ka, keras: ka.InvariantAdam(1e-3, steps=1),
    "update_accumulation_adam_steps_1": lambda ka, keras: ka.UpdateAccumulationAdam(1e-3, steps=1),
}


def digest(name, xla, size):
    import keras
    import tensorflow as tf

    import keras_accum as ka

    keras.utils.set_random_seed(0)
    layers = [keras.Input((32,)), keras.layers.Dense(size, activation="relu")]
    model = keras.Sequential(layers + [keras.layers.Dense(10)])
    optimizer, variables = OPTIMIZERS[name](ka, keras), model.trainable_variables
    optimizer.build(variables)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(jit_compile=xla)
    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        optimizer.apply(tape.gradient(value, variables), variables)

    x, y = tf.zeros((8, 32)), tf.zeros((8,), "int32")
    ops = collections.Counter()
    if xla:
        hlo = step.experimental_get_compiler_ir(x, y)(stage="optimized_hlo")
        ops.update(m.group(1) for m in re.finditer(r"= \S+ (\w[\w-]*)\(", hlo))
    else:
        graph = step.get_concrete_function(x, y).graph.as_graph_def()
        ops.update(node.op for node in graph.node)
        ops.update(node.op for f in graph.library.function for node in f.node_def)
    text = ";".join(f"{op}:{count}" for op, count in sorted(ops.items()))
    return hashlib.sha1(text.encode()).hexdigest()[:12], sum(ops.values())


def _model(size):
    import keras

    keras.utils.set_random_seed(0)
    layers = [keras.Input((32,)), keras.layers.Dense(size, activation="relu")]
    return keras.Sequential(layers + [keras.layers.Dense(10)])


def _hlo_opcodes(hlo):
    return collections.Counter(m.group(1) for m in re.finditer(r"= \S+ (\w[\w-]*)\(", hlo))


def _hashed(ops):
    text = ";".join(f"{op}:{count}" for op, count in sorted(ops.items()))
    return hashlib.sha1(text.encode()).hexdigest()[:12], sum(ops.values())


def digest_jax(name, size):
    import jax
    import keras
    import numpy as np

    import keras_accum as ka

    model = _model(size)
    optimizer = OPTIMIZERS[name](ka, keras)
    optimizer.build(model.trainable_variables)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def loss_of(trainable, non_trainable, x, y):
        out, _ = model.stateless_call(trainable, non_trainable, x, training=True)
        return loss(y, out)

    @jax.jit
    def step(trainable, non_trainable, optimizer_variables, x, y):
        grads = jax.grad(loss_of)(trainable, non_trainable, x, y)
        return optimizer.stateless_apply(optimizer_variables, grads, trainable)

    values = lambda variables: [v.value for v in variables]
    args = (
        values(model.trainable_variables),
        values(model.non_trainable_variables),
        values(optimizer.variables),
        np.zeros((8, 32), "float32"),
        np.zeros((8,), "int32"),
    )
    return _hashed(_hlo_opcodes(step.lower(*args).compile().as_text()))


def digest_torch(name, size):
    import keras
    import torch
    from keras import ops

    import keras_accum as ka

    model = _model(size)
    optimizer = OPTIMIZERS[name](ka, keras)
    variables = model.trainable_variables
    optimizer.build(variables)
    grads = [ops.ones_like(v) * 0.01 for v in variables]
    optimizer.apply(grads, variables)  # first call: anything lazy happens here
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(8):
            optimizer.apply(grads, variables)
    counts = collections.Counter()
    for event in profile.key_averages():
        if event.key.startswith("aten::"):
            counts[event.key] += event.count
    return (*_hashed(counts), counts["aten::_local_scalar_dense"])


def main(argv):
    if len(argv) > 1:
        sys.exit(f"Unexpected arguments {argv[1:]}; flags are --name=value.")
    backend = os.environ["KERAS_BACKEND"]
    for name in OPTIMIZERS:
        for size in FLAGS.sizes:
            if backend == "jax":
                print(name, "jax", size, *digest_jax(name, int(size)))
            elif backend == "torch":
                print(name, "torch", size, *digest_torch(name, int(size)))
            else:
                for xla in (False, True):
                    print(name, "xla" if xla else "graph", size, *digest(name, xla, int(size)))


if __name__ == "__main__":
    app.run(main)
