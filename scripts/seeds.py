"""Runs a config's main command for N seeds and reports mean +- std.

    python scripts/seeds.py --config saved_configs/mnist1d_cnn_invariant.py \
        --seeds 5 --workdir runs/seeds --data_dir runs/seeds/tfds \
        --splice docs/guides/main_job.md:main

Each seed is `scripts/train.py --config CONFIG --seed K` in its own process
(exactly the README's command, TensorFlow start-up and, on a fresh
--data_dir, data preparation included), one after the other. The report is
a markdown table of the test accuracy (the test split, evaluated once after
training), the validation accuracy when the config holds out part of train,
wall and CPU seconds per seed, and mean +- sample std over the seeds. It is
written to WORKDIR/seeds.md (and .json) and, with --splice FILE:SECTION,
between `<!-- seeds:SECTION -->` and `<!-- /seeds:SECTION -->` in FILE.
"""

import json
import os
import pathlib
import platform
import resource
import statistics
import subprocess
import sys
import time

from absl import app, flags

# The harness is TensorFlow: this script sets the backend itself (an explicit
# KERAS_BACKEND is kept, and then refused in one line if it is another).
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the package of this checkout

from keras_accum.training import atomic  # noqa: E402

FLAGS = flags.FLAGS


def define_flags():
    """The script's flags, defined when it runs (not when a test imports
    its functions beside other scripts' flags)."""
    flags.DEFINE_string("config", None, "saved_configs/*.py file.", required=True)
    flags.DEFINE_integer("seeds", 5, "Seeds 0 .. N-1.", lower_bound=1)
    flags.DEFINE_string("workdir", None, "Folder for the runs (seed_K/ each).", required=True)
    flags.DEFINE_string("data_dir", None, "TFDS data_dir passed to every run (default: config's).")
    flags.DEFINE_string("splice", None, "FILE:SECTION to write the table into.")


def run_seed(seed, workdir):
    """One seed's run in its own process: (final.json dict, wall s, CPU s)."""
    command = [sys.executable, str(ROOT / "scripts/train.py"), f"--config={FLAGS.config}"]
    command += [f"--seed={seed}", f"--workdir={workdir}", "--verbose=2"]
    if FLAGS.data_dir:
        command.append(f"--data_dir={FLAGS.data_dir}")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        sys.exit(f"error: seed {seed} failed:\n{result.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    final = json.loads((pathlib.Path(workdir) / "final.json").read_text())
    return final, wall, cpu


def percent(values):
    if len(values) == 1:
        return f"{100 * values[0]:.1f}%"
    return f"{100 * statistics.mean(values):.1f}% +- {100 * statistics.stdev(values):.1f}"


def report(rows, config_path, loads):
    """The markdown table of `rows` (one per seed) with a mean +- std line."""
    has_val = all("validation_accuracy" in r for r in rows)
    head = "| seed | test accuracy |" + (" validation accuracy |" if has_val else "")
    lines = [head + " wall | CPU |", "|---" * (head.count("|") + 1) + "|"]
    for r in rows:
        val = f" {100 * r['validation_accuracy']:.1f}% |" if has_val else ""
        lines.append(
            f"| {r['seed']} | {100 * r['test_accuracy']:.1f}% |{val} "
            f"{r['wall']:.0f} s | {r['cpu']:.0f} s |"
        )
    test = [r["test_accuracy"] for r in rows]
    val = f" {percent([r['validation_accuracy'] for r in rows])} |" if has_val else ""
    walls = [r["wall"] for r in rows]
    lines.append(
        f"| **mean +- std** | **{percent(test)}** |{val} "
        f"{statistics.mean(walls):.0f} s (max {max(walls):.0f}) | "
        f"{statistics.mean(r['cpu'] for r in rows):.0f} s |"
    )
    return "\n".join(
        [
            f"`{config_path}`, seeds 0-{len(rows) - 1}, each run as "
            f"`python3 scripts/train.py --config {config_path} --seed K`. Test accuracy: "
            "the test split (1000 examples), evaluated once after training and never used "
            "to choose anything; validation: the held-out start of train. Wall and CPU "
            f"seconds per run (TensorFlow start-up included) on {os.cpu_count()} cores "
            f"({platform.processor() or platform.machine()}), load average "
            f"{min(loads):.1f}-{max(loads):.1f} during the runs (shared machine).",
            "",
            *lines,
        ]
    )


def splice_markdown(path, section, text):
    """Replaces the text between the `seeds:SECTION` markers of `path`."""
    begin, end = f"<!-- seeds:{section} -->", f"<!-- /seeds:{section} -->"
    content = pathlib.Path(path).read_text()
    if begin not in content or end not in content:
        sys.exit(f"error: {path} has no {begin} ... {end} section.")
    head, rest = content.split(begin, 1)
    _, tail = rest.split(end, 1)
    atomic.atomic_write_text(path, f"{head}{begin}\n{text.strip()}\n{end}{tail}")


def main(argv):
    if len(argv) > 1:
        sys.exit(f"error: unexpected arguments {argv[1:]}")
    workdir = pathlib.Path(FLAGS.workdir)
    rows, loads = [], []
    for seed in range(FLAGS.seeds):
        loads.append(os.getloadavg()[0])
        final, wall, cpu = run_seed(seed, workdir / f"seed_{seed}")
        rows.append({"seed": seed, **final, "wall": wall, "cpu": cpu})
        loads.append(os.getloadavg()[0])
        print(f"seed {seed}: test accuracy {final['test_accuracy']:.4f} ({wall:.0f} s)")
    text = report(rows, FLAGS.config, loads)
    atomic.atomic_write_text(workdir / "seeds.md", text + "\n")
    atomic.atomic_write_text(
        workdir / "seeds.json", json.dumps({"rows": rows, "loads": loads}, indent=2)
    )
    print(text)
    if FLAGS.splice:
        path, section = FLAGS.splice.rsplit(":", 1)
        splice_markdown(path, section, text)


if __name__ == "__main__":
    define_flags()
    app.run(main)
