"""Batch-size schedules study: kappa switched during a run, and adaptive
kappa from the gradient noise scale (see
keras_accum/experiments/schedules_study.py and docs/BATCH_SIZE_SCHEDULES.md).

    python scripts/schedules_study.py --config saved_configs/batch_size_schedules.py \
        --variant full --workdir runs/schedules-full

Writes runs.csv, decisions.csv, summary.md, switch_lr_*.png,
adaptive_lr_*.png, config.json and summary.json into --workdir.
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

from absl import (
    app,  # noqa: E402
    flags,  # noqa: E402
    logging,  # noqa: E402
)

FLAGS = flags.FLAGS
flags.DEFINE_string(
    "config",
    "saved_configs/batch_size_schedules.py",
    "saved_configs/*.py file or a run folder's config.json.",
)
flags.DEFINE_string("variant", "full", "Which get_config(variant) (the config file checks it).")
flags.DEFINE_string("set", None, "JSON object of config overrides, e.g. '{\"seeds\": [2]}'.")
flags.DEFINE_list("merge", None, "Workdirs of finished studies: one report of them all.")
flags.DEFINE_string("workdir", None, "Output folder (default runs/schedules-<variant>-<time>).")
flags.DEFINE_string("data_dir", None, "TFDS data_dir (mnist1d is built there).")


def main(argv):
    if len(argv) > 1:
        sys.exit(f"Unexpected arguments {argv[1:]}; flags are --name=value.")
    logging.set_verbosity(logging.WARNING)
    import json

    from keras_accum.experiments import experiment, schedules_report, schedules_study

    try:
        if FLAGS.merge:
            schedules_report.merge(FLAGS.merge, FLAGS.workdir)
            return print(f"Table: {FLAGS.workdir}/summary.md")
        config = experiment.load_config_file(FLAGS.config, FLAGS.variant)
        if FLAGS.data_dir:
            config["data_dir"] = FLAGS.data_dir
        config.update(json.loads(FLAGS.set or "{}"))
        workdir = FLAGS.workdir or os.path.join(
            "runs", f"schedules-{FLAGS.variant}-{time.strftime('%Y%m%d-%H%M%S')}"
        )
        schedules_study.run_study(config, workdir)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    print(f"Table: {workdir}/summary.md")


if __name__ == "__main__":
    app.run(main)
