"""What rematerialization saves and costs on the character-level transformer
at long sequences, micro-batch 1, graph mode and XLA (one process per memory
number; the modes timed in turns in one process). About 10 minutes on 2
busy cores:

    python scripts/remat_bench.py --splice=BENCHMARKS.md:remat

What is measured and how: keras_accum/experiments/remat_bench.py.
"""

import json
import os
import pathlib
import shlex
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The harness is TensorFlow: this script sets the backend itself (an explicit
# KERAS_BACKEND is kept, and then refused in one line if it is another).
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# Use the package of this checkout, whatever else is installed.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes", ["lm", "lm_4x64"], "Model sizes (remat_bench.SIZES).")
flags.DEFINE_list("seq_lens", ["1024", "2048"], "Sequence lengths (characters).")
flags.DEFINE_list("settings", ["graph", "xla"], "graph and/or xla.")
flags.DEFINE_list("modes", ["none", "full", "larger_than"], "remat modes; none first.")
flags.DEFINE_integer("rounds", 5, "Timing rounds.", lower_bound=1)
flags.DEFINE_integer("calls", 5, "Calls (micro-batches) per mode per round.", lower_bound=1)
flags.DEFINE_string("output", None, "Write the raw results here as JSON.")
flags.DEFINE_string("splice", None, "FILE:SECTION, e.g. BENCHMARKS.md:remat.")


def main(argv):
    if len(argv) > 1:
        sys.exit(f"Unexpected arguments {argv[1:]}; flags are --name=value.")
    from keras_accum.experiments import remat_bench
    from keras_accum.experiments.bench import report

    try:
        for name, values, valid in (
            ("sizes", FLAGS.sizes, remat_bench.SIZES),
            ("settings", FLAGS.settings, remat_bench.SETTINGS),
            ("modes", FLAGS.modes, remat_bench.MODES),
        ):
            if not values or any(v not in valid for v in values):
                raise ValueError(
                    f"`{name}` must be a list of {', '.join(valid)}. Received: {name}={values!r}"
                )
        if FLAGS.modes[0] != "none":
            raise ValueError(f"`modes` must start with none. Received: modes={FLAGS.modes!r}")
        seq_lens = [int(v) for v in FLAGS.seq_lens]
        splice = FLAGS.splice.rsplit(":", 1) if FLAGS.splice else None
        if splice:
            report.check_splice(*splice)
    except ValueError as e:
        sys.exit(f"error: {e}")
    results = remat_bench.run(
        FLAGS.sizes,
        seq_lens,
        FLAGS.settings,
        FLAGS.modes,
        FLAGS.rounds,
        FLAGS.calls,
        report=lambda line: print(line, file=sys.stderr, flush=True),
    )
    if FLAGS.output:
        pathlib.Path(FLAGS.output).write_text(json.dumps(results, indent=1))
    text = remat_bench.markdown(results, "python " + " ".join(shlex.quote(a) for a in sys.argv))
    print(text)
    if splice:
        report.splice_markdown(*splice, text)


if __name__ == "__main__":
    app.run(main)
