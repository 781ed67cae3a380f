"""What a refactor did to the traced train step: one line per optimizer,
mode and model size with a digest of the step's operations (the multiset
of TensorFlow op types in graph mode, function library included; of the
optimized HLO opcodes under XLA) and their count. Two checkouts that print
the same lines run the same operations, so their speed cannot differ by
the code (BENCHMARKS_HISTORY.md, "Same step, op for op"). About a minute:

    python scripts/step_digest.py > after.txt   # in each checkout, then diff
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


def main(argv):
    if len(argv) > 1:
        sys.exit(f"Unexpected arguments {argv[1:]}; flags are --name=value.")
    for name in OPTIMIZERS:
        for xla in (False, True):
            for size in FLAGS.sizes:
                print(name, "xla" if xla else "graph", size, *digest(name, xla, int(size)))


if __name__ == "__main__":
    app.run(main)
