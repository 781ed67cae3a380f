"""Controls for the char-LM batch-size warmup (issue #35; see
keras_accum/experiments/schedules_controls.py and saved_configs/schedule_controls.py).

    taskset -c 1 python3 scripts/schedule_controls.py --variant controls --workdir runs/controls

Writes runs.csv, decisions.csv, timings.csv, config.json (after every run),
then summary.md, table.json and summary.json into --workdir.
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
flags.DEFINE_string("config", "saved_configs/schedule_controls.py", "Config file.")
flags.DEFINE_string("variant", "controls", "Which get_config(variant).")
flags.DEFINE_string("set", None, "JSON object of config overrides, e.g. '{\"seeds\": [2]}'.")
flags.DEFINE_string("workdir", None, "Output folder (default runs/controls-<variant>-<time>).")
flags.DEFINE_string("data_dir", None, "TFDS data_dir.")


def main(argv):
    if len(argv) > 1:
        sys.exit(f"Unexpected arguments {argv[1:]}; flags are --name=value.")
    logging.set_verbosity(logging.WARNING)
    import json

    from keras_accum.experiments import experiment, schedules_controls

    try:
        config = experiment.load_config_file(FLAGS.config, FLAGS.variant)
        if FLAGS.data_dir:
            config["data_dir"] = FLAGS.data_dir
        config.update(json.loads(FLAGS.set or "{}"))
        workdir = FLAGS.workdir or os.path.join(
            "runs", f"controls-{FLAGS.variant}-{time.strftime('%Y%m%d-%H%M%S')}"
        )
        schedules_controls.run_study(config, workdir)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    print(f"Table: {workdir}/summary.md")


if __name__ == "__main__":
    app.run(main)
