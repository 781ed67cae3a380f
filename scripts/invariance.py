"""Batch-size invariance study: curves versus examples seen for kappa
micro-batches per update, four ways of rescaling Adam (see
keras_accum/experiments/invariance/ and docs/INVARIANCE.md).

    python scripts/invariance.py --config saved_configs/invariance.py \
        --variant quick --workdir runs/invariance-quick

Writes runs.csv, spread.md, spread_vs_lr.png, curves_lr_*.png,
noise_scale.csv, config.json and summary.json into --workdir.
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

from keras_accum.experiments.invariance import config as study_config

FLAGS = flags.FLAGS
flags.DEFINE_string(
    "config",
    "saved_configs/invariance.py",
    "saved_configs/*.py file or a run folder's config.json.",
)
flags.DEFINE_string(
    "variant", "full", "Which get_config(variant) of a .py config (the config file checks it)."
)
flags.DEFINE_string("workdir", None, "Output folder (default runs/invariance-<variant>-<time>).")
# One flag per study config key (unset: keep the config's value).
study_config.SCHEMA.define_flags(FLAGS)


def main(argv):
    if len(argv) > 1:
        sys.exit(f"Unexpected arguments {argv[1:]}; flags are --name=value.")
    logging.set_verbosity(logging.WARNING)  # TFDS's INFO lines drown progress
    from keras_accum.experiments import invariance

    try:
        config = invariance.load_config_file(FLAGS.config, FLAGS.variant)
        config.update(study_config.SCHEMA.flag_overrides(FLAGS))
        config = invariance.resolve_config(config)  # Checked before any write.
        workdir = FLAGS.workdir or os.path.join(
            "runs", f"invariance-{FLAGS.variant}-{time.strftime('%Y%m%d-%H%M%S')}"
        )
        invariance.run_study(config, workdir)
    except (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError) as e:
        sys.exit(f"error: {e}")
    print(f"Table: {workdir}/spread.md")


if __name__ == "__main__":
    app.run(main)
