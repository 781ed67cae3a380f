"""Batch normalization under accumulation on MNIST-1D: Keras's layer,
`keras_accum.layers.BatchNormalization` (with and without renorm) and the
big batch without accumulation. The table of docs/BATCH_NORM.md came from:

    python scripts/batch_norm_study.py --output=/tmp/batch_norm.json

What is measured and how: keras_accum/experiments/batch_norm_study.py.
"""

import json
import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The harness is TensorFlow: this script sets the backend itself (an explicit
# KERAS_BACKEND is kept, and then refused in one line if it is another).
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# Use the package of this checkout, whatever else is installed.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("micro_batches", ["4", "8"], "Items per micro-batch (b).")
flags.DEFINE_list("kappas", ["8", "16"], "Micro-batches per update.")
flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds.")
flags.DEFINE_list("arms", None, "Arms (batch_norm_study.ARMS); default all.")
flags.DEFINE_integer("epochs", 6, "Epochs over the 4000 training examples.", lower_bound=1)
flags.DEFINE_float("learning_rate", 3e-3, "Adam's learning rate (every arm).")
flags.DEFINE_string("output", None, "Write the rows here as JSON.")
flags.DEFINE_string("plot", None, "Write the figure of docs/BATCH_NORM.md here (PNG).")
flags.DEFINE_string("rows", None, "Rows saved by --output: table and figure, no runs.")


def main(argv):
    if len(argv) > 1:
        sys.exit(f"Unexpected arguments {argv[1:]}; flags are --name=value.")
    from keras_accum.experiments import batch_norm_study

    arms = FLAGS.arms or batch_norm_study.ARMS
    bad = [arm for arm in arms if arm not in batch_norm_study.ARMS]
    if bad:
        sys.exit(f"error: `arms` must be among {batch_norm_study.ARMS}. Received: arms={arms!r}")
    if FLAGS.rows:
        rows = json.loads(pathlib.Path(FLAGS.rows).read_text())
    else:
        rows = batch_norm_study.run(
            [int(v) for v in FLAGS.micro_batches],
            [int(v) for v in FLAGS.kappas],
            [int(v) for v in FLAGS.seeds],
            arms=arms,
            epochs=FLAGS.epochs,
            learning_rate=FLAGS.learning_rate,
            log=lambda row: print(json.dumps(row), flush=True),
        )
    if FLAGS.output:
        pathlib.Path(FLAGS.output).write_text(json.dumps(rows, indent=1))
    if FLAGS.plot:
        batch_norm_study.plot(rows, FLAGS.plot, epochs=FLAGS.epochs)
    print(batch_norm_study.table(rows))


if __name__ == "__main__":
    app.run(main)
