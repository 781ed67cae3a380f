"""Benchmarks the keras_accum optimizers against Keras's own accumulation.

Full run (about 40 minutes on 2 quiet cores, more on a busy machine;
writes runs/bench/results.md, .json, samples.csv and config.json):

    python scripts/bench.py --output=runs/bench

Smoke test (tiny sizes, numbers meaningless):

    python scripts/bench.py --quick --output=/tmp/bench_quick

A run in pieces (e.g. one setting at a time), reported as one:

    python scripts/bench.py --settings=graph --limit_micro_batch=0 --output=runs/b1
    python scripts/bench.py --settings=xla ... --output=runs/b2
    python scripts/bench.py --render=runs/b1/results.json,runs/b2/results.json \\
        --splice=BENCHMARKS.md:main

The same groups run again in another process (e.g. `--norss
--noxla_copies`, timing only) and rendered with the first run pool their
rounds: a ratio then stands for both processes.

On a machine with a GPU the one-replica groups run on it (rows "graph on
GPU"); rendered with CPU runs, they stand beside the CPU rows, never pooled
with them.

Every key of the benchmark's config is a flag (`--models=cnn,mlp`,
`--repeats=5`, `--norss`, ...; see `--help`). What is measured and how: the
docstring of `keras_accum/experiments/bench/`.
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

from keras_accum.experiments.bench import config as bench_config

FLAGS = flags.FLAGS
# One flag per config key (unset: keep the default).
bench_config.SCHEMA.define_flags(FLAGS)
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
    "again without running; several are merged into one report (e.g. one run per setting; "
    "a group timed in several runs pools their rounds).",
)


def _splice_target(bench, value):
    """(FILE, SECTION) of --splice, the file checked before anything runs."""
    path, colon, section = value.rpartition(":")
    if not colon or not path or not section:
        raise ValueError(f"`--splice` must be FILE:SECTION. Received: --splice={value!r}")
    bench.check_splice(path, section)
    return path, section


def _load_results(path):
    """A results.json of an earlier run, for --render."""
    try:
        with open(path) as f:
            result = json.load(f)
    except OSError as e:
        raise ValueError(f"`--render`: cannot read {path!r}: {e.strerror}") from None
    except ValueError as e:
        raise ValueError(f"`--render`: {path!r} is not JSON ({e})") from None
    needed = {"config", "machine", "rows", "seconds"}
    if not isinstance(result, dict) or not needed <= set(result):
        raise ValueError(
            f"`--render`: {path!r} is not a benchmark's results.json (it needs the keys "
            f"{sorted(needed)})."
        )
    return result


def main(argv):
    if len(argv) > 1:
        sys.exit(f"Unexpected arguments {argv[1:]}; flags are --name=value.")
    from keras_accum.experiments import bench

    # Every input is checked before anything is measured or written.
    try:
        overrides = bench_config.SCHEMA.flag_overrides(FLAGS)
        config = None if FLAGS.render else bench.BenchConfig(**overrides)
        splice = _splice_target(bench, FLAGS.splice) if FLAGS.splice else None
        if FLAGS.render:
            # Same numbers, same commands: only the presentation is redone.
            result = bench.merge_results([_load_results(p) for p in FLAGS.render.split(",")])
    except ValueError as e:
        sys.exit(f"error: {e}")
    if FLAGS.render:
        command = result["command"]
    else:
        result = bench.run(config)
        command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    report = bench.markdown(result, command)
    print(report)
    if FLAGS.output and not FLAGS.render:  # the measurements first
        bench.write_outputs(result, FLAGS.output, command)
        print(
            f"Wrote {FLAGS.output}/results.md, results.json, samples.csv, config.json",
            file=sys.stderr,
        )
    if splice:
        bench.splice_markdown(*splice, report)


if __name__ == "__main__":
    app.run(main)
