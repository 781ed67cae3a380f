"""Benchmarks the keras_accum optimizers against Keras's own accumulation.

Full run (about 40 minutes on 2 cores; writes runs/bench/results.md, .json,
samples.csv and config.json):

    python scripts/bench.py --output=runs/bench

Smoke test (tiny sizes, numbers meaningless):

    python scripts/bench.py --quick --output=/tmp/bench_quick

What is measured and how: see the docstring of `keras_accum/experiments/bench/`.
"""

import json
import os
import shlex
import sys

from absl import app, flags

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


flags.DEFINE_bool("quick", False, "Tiny sizes, for a smoke test.")
flags.DEFINE_integer("repeats", None, "Timed rounds per (setting, model).")
flags.DEFINE_integer("steps", None, "N: micro-batches per window.")
flags.DEFINE_integer("micro_batch", None, "b: examples per micro-batch.")
flags.DEFINE_integer(
    "limit_micro_batch", None, "Also time at this micro-batch in --limit_settings (0: off)."
)
flags.DEFINE_list("limit_settings", None, "Settings timed at --limit_micro_batch.")
flags.DEFINE_integer("windows", None, "Windows per train-function call (K = steps x windows).")
flags.DEFINE_list("models", None, "Models to run (cnn, mlp, transformer).")
flags.DEFINE_list("contenders", None, "Contenders (see CONTENDERS).")
flags.DEFINE_list(
    "settings", None, "Settings: graph, xla, graph_spe1, xla_spe1, mirrored (see SETTINGS)."
)
flags.DEFINE_float(
    "min_sample_seconds", None, "A timed sample repeats calls until it lasts this long."
)
flags.DEFINE_bool("rss", None, "Measure peak RSS in one subprocess per (model, contender).")
flags.DEFINE_bool("timing", None, "Run the timed groups (default true).")
flags.DEFINE_bool(
    "xla_copies",
    None,
    "Count the elements XLA copies per step, per (model, contender), from the optimised HLO.",
)
flags.DEFINE_string(
    "output", None, "Directory for results.md, results.json, samples.csv and config.json."
)
flags.DEFINE_string(
    "splice",
    None,
    "FILE:SECTION, e.g. BENCHMARKS.md:main: "
    "put the Markdown report between <!-- bench:SECTION --> "
    "and <!-- /bench:SECTION --> in FILE.",
)

flags.DEFINE_string(
    "render",
    None,
    "results.json of earlier runs, comma-separated: print (and --splice) their report "
    "again without running; several are merged into one report (e.g. one run per setting).",
)

FLAGS = flags.FLAGS


def main(argv):
    del argv
    from keras_accum.experiments import bench  # Imports TensorFlow.

    overrides = {
        name: getattr(FLAGS, name)
        for name in (
            "repeats",
            "steps",
            "micro_batch",
            "limit_micro_batch",
            "windows",
            "min_sample_seconds",
            "rss",
            "timing",
            "xla_copies",
        )
        if getattr(FLAGS, name) is not None
    }
    for name in ("models", "contenders", "settings", "limit_settings"):
        if getattr(FLAGS, name):
            overrides[name] = tuple(getattr(FLAGS, name))
    if FLAGS.render:
        # Same numbers, same commands: only the presentation is redone.
        results = []
        for path in FLAGS.render.split(","):
            with open(path) as f:
                results.append(json.load(f))
        result = bench.merge_results(results)
        command = result["command"]
    else:
        config = bench.BenchConfig(quick=FLAGS.quick, **overrides)
        result = bench.run(config)
        command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    report = bench.markdown(result, command)
    print(report)
    if FLAGS.splice:
        path, section = FLAGS.splice.rsplit(":", 1)
        bench.splice_markdown(path, section, report)
    if FLAGS.output and not FLAGS.render:
        bench.write_outputs(result, FLAGS.output, command)
        print(
            f"Wrote {FLAGS.output}/results.md, results.json, samples.csv, config.json",
            file=sys.stderr,
        )


if __name__ == "__main__":
    app.run(main)
