"""Preconditioned sharpness along the invariance study's kappa = 1 runs
against each scaling rule's stability threshold at kappa = 8
(keras_accum/experiments/invariance/sharpness.py).

    python scripts/sharpness.py --config saved_configs/invariance.py \
        --variant frontier --out runs/sharpness

Writes sharpness.csv, sharpness.md and sharpness.png into --out.
"""

import os
import pathlib
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The harness is TensorFlow: this script sets the backend itself (an explicit
# KERAS_BACKEND is kept, and then refused in one line if it is another).
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# Use the package of this checkout, whatever else is installed.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "saved_configs/invariance.py", "Invariance study config file.")
flags.DEFINE_string("variant", "frontier", "Which get_config(variant) of a .py config.")
flags.DEFINE_string("out", "runs/sharpness", "Output folder.")
flags.DEFINE_list("learning_rates", ["1e-4", "1e-3", "1e-2"], "Base learning rates.")
flags.DEFINE_integer("seed", 0, "Seed (initial weights and micro-batch stream).")
flags.DEFINE_integer("points", 8, "Probes per run, evenly spaced in examples.")
flags.DEFINE_integer("iterations", 30, "Power iterations per eigenvalue.")
flags.DEFINE_enum(
    "method", "invariant", ["invariant", "power", "fixed_beta_1"], "Rule of the probed run."
)
flags.DEFINE_integer("kappa", 1, "Micro-batches per update of the probed run.")


def main(argv):
    if len(argv) > 1:
        sys.exit(f"Unexpected arguments {argv[1:]}; flags are --name=value.")
    logging.set_verbosity(logging.WARNING)
    from keras_accum.experiments import invariance
    from keras_accum.experiments.invariance import report, sharpness

    started, cpu = time.time(), time.process_time()
    config = invariance.resolve_config(invariance.load_config_file(FLAGS.config, FLAGS.variant))
    lrs = [float(lr) for lr in FLAGS.learning_rates]
    rows = sharpness.measure(
        config, lrs, FLAGS.seed, FLAGS.points, FLAGS.iterations, FLAGS.method, FLAGS.kappa
    )
    run = f"kappa={FLAGS.kappa} ({'Adam' if FLAGS.kappa == 1 else FLAGS.method}), seed {FLAGS.seed}"
    out = pathlib.Path(FLAGS.out)
    out.mkdir(parents=True, exist_ok=True)
    report.write_csv(out / "sharpness.csv", rows)
    timing = f"Run time {time.time() - started:.0f} s wall, {time.process_time() - cpu:.0f} s CPU."
    (out / "sharpness.md").write_text(sharpness.markdown(rows, config, run) + "\n" + timing + "\n")
    sharpness.plot(rows, config, out / "sharpness.png", run)
    print(f"{timing} Table: {out}/sharpness.md")


if __name__ == "__main__":
    app.run(main)
