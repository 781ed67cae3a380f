"""Kill drill: SIGKILL scripts/train.py at random times and in the middle of
checkpoint writes, resume it to completion, compare with an uninterrupted run.

    python scripts/kill_drill.py                      # fit, loop, mirrored
    python scripts/kill_drill.py --paths loop --random_kills 2 --write_kills 1

Paths: `fit` (model.fit, one device), `loop` (the custom loop of
keras_accum.training: --strategy multi_worker without TF_CONFIG, one
process) and `mirrored` (model.fit under MirroredStrategy on 2 logical
CPUs). Each trial starts a run, kills it (a random moment, or the hook
`KERAS_ACCUM_CHECKPOINT_HOOK=kill:<n>` that truncates the n-th checkpoint's
temporary file and SIGKILLs the process inside the write), then runs
`--resume` until it finishes. It then compares, bit for bit, the final
checkpoint (weights and optimizer state), metrics.csv, the TensorBoard
scalars and (loop) log.jsonl with the uninterrupted run's, and prints a table.
Op determinism is on in every run.
"""

import glob
import io
import json
import os
import pathlib
import random
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

from absl import app, flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
FLAGS = flags.FLAGS
flags.DEFINE_list("paths", ["fit", "loop", "mirrored"], "Which paths to drill.")
flags.DEFINE_integer("random_kills", 2, "Trials per path killed at a random moment.")
flags.DEFINE_integer("write_kills", 2, "Trials per path killed inside a checkpoint write.")
flags.DEFINE_integer("epochs", 3, "Epochs per run.")
flags.DEFINE_string("config", "saved_configs/mnist1d_cnn_invariant.py", "Run config.")
flags.DEFINE_string("workdir", None, "Drill folder (default: a new temporary one).")
flags.DEFINE_string("data_dir", None, "TFDS data_dir (default: <workdir>/data).")
flags.DEFINE_integer("seed", 0, "Seed of the kill times.")
flags.DEFINE_float("timeout", 600, "Seconds allowed per launch.")

# Run scripts/train.py with op determinism on and, for `mirrored`, 2
# logical CPUs (set before TensorFlow starts, hence this bootstrap).
BOOT = """
import os, runpy, sys
import tensorflow as tf
cpus = int(os.environ.get("KILL_DRILL_CPUS", "1"))
if cpus > 1:
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * cpus)
tf.config.experimental.enable_op_determinism()
sys.argv = [sys.argv[1]] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
PATHS = {
    "fit": (["--strategy", "default"], 1),
    "loop": (["--strategy", "multi_worker"], 1),
    "mirrored": (["--strategy", "mirrored"], 2),
}
NOT_COMPARED = ("time", "examples_per_second")


def launch(path, args, hook=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3")
    env["KILL_DRILL_CPUS"] = str(PATHS[path][1])
    env.pop("KERAS_ACCUM_CHECKPOINT_HOOK", None)
    if hook:
        env["KERAS_ACCUM_CHECKPOINT_HOOK"] = hook
    command = [sys.executable, "-c", BOOT, str(ROOT / "scripts" / "train.py"), *args]
    return subprocess.Popen(
        command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def run_args(path, workdir, data_dir, epochs, config):
    strategy, _ = PATHS[path]
    return ["--config", config, "--epochs", str(epochs), "--data_dir", data_dir,
            "--workdir", str(workdir), *strategy]  # fmt: skip


def finish(process, timeout):
    out, _ = process.communicate(timeout=timeout)
    return process.returncode, out


def complete(path, workdir, args, timeout):
    """Resumes (or restarts, when killed before config.json) until the run
    exits 0; returns the resume messages seen."""
    messages = []
    for _ in range(5):
        if (workdir / "config.json").exists():
            code, out = finish(launch(path, ["--workdir", str(workdir), "--resume"]), timeout)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
            code, out = finish(launch(path, args), timeout)
        messages += [line for line in out.splitlines() if "Resuming from" in line]
        messages += [line for line in out.splitlines() if "Skipped" in line]
        if code == 0:
            return messages
    raise RuntimeError(f"{path}: {workdir} did not complete; last output:\n{out[-3000:]}")


# -- what is compared -------------------------------------------------------------


def checkpoint_tensors(workdir):
    """name -> array of the final checkpoint (weights and optimizer state)."""
    import h5py
    import numpy as np

    files = sorted(glob.glob(str(workdir / "checkpoints" / "epoch_*.keras")))
    if files:
        tensors = {}
        with zipfile.ZipFile(files[-1]) as archive:
            with h5py.File(io.BytesIO(archive.read("model.weights.h5")), "r") as h5:
                h5.visititems(
                    lambda name, obj: (
                        tensors.__setitem__(name, np.asarray(obj))
                        if isinstance(obj, h5py.Dataset)
                        else None
                    )
                )
        return pathlib.Path(files[-1]).name, tensors
    import tensorflow as tf

    from keras_accum.training import checkpoints

    prefix = checkpoints.tf_checkpoints(workdir / "loop" / "checkpoints")[0]
    reader = tf.train.load_checkpoint(prefix)
    names = [n for n in reader.get_variable_to_shape_map() if "save_counter" not in n]
    return pathlib.Path(prefix).name, {n: reader.get_tensor(n) for n in names}


def scalars(workdir):
    import tensorflow as tf

    from keras_accum.training import logs

    found = []
    for path in sorted(glob.glob(str(workdir / "**" / "*tfevents*"), recursive=True)):
        folder = os.path.relpath(os.path.dirname(path), workdir)
        for event in logs._events(path):
            for value in event.summary.value:
                if any(skip in value.tag for skip in NOT_COMPARED):
                    continue
                number = value.simple_value
                if value.HasField("tensor"):
                    array = tf.make_ndarray(value.tensor)
                    if array.size != 1 or array.dtype.kind not in "fiub":
                        continue  # not a scalar (e.g. the model's config as text)
                    number = float(array)
                found.append((folder, value.tag, event.step, number))
    return sorted(found)


def jsonl(workdir):
    path = workdir / "loop" / "log.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in NOT_COMPARED} for r in lines]


def compare(reference, trial):
    import numpy as np

    name_a, a = checkpoint_tensors(reference)
    name_b, b = checkpoint_tensors(trial)
    weights = name_a == name_b and a.keys() == b.keys()
    weights = weights and all(np.array_equal(a[k], b[k]) for k in a)
    metrics = (reference / "metrics.csv").read_text() == (trial / "metrics.csv").read_text()
    return {
        "weights+optimizer": weights,
        "metrics.csv": metrics,
        "tensorboard": scalars(reference) == scalars(trial),
        "log.jsonl": jsonl(reference) == jsonl(trial),
    }


# -- the drill ----------------------------------------------------------------------


def prepare(config, data_dir):
    """Prepares the dataset first, so that the reference run is not the one
    run that also prepares data (data preparation is not part of the drill)."""
    sys.path.insert(0, str(ROOT))
    from keras_accum.experiments import data, experiment

    name = experiment.load_config_file(str(ROOT / config)).get("dataset", "mnist1d")
    data.load(name, "train", data_dir=data_dir)


def trial(path, kind, index, root, data_dir, epochs, config, rng, duration, timeout):
    workdir = root / path / f"{kind}_{index}"
    args = run_args(path, workdir, data_dir, epochs, config)
    if kind == "write" or isinstance(kind, int):
        # The hook kills the process inside its n-th atomic write (n random
        # unless given): the loop writes config.json then a checkpoint per
        # epoch, the fit paths a checkpoint per epoch.
        writes = epochs + 1 if path == "loop" else epochs
        hook = f"kill:{kind if isinstance(kind, int) else rng.randint(1, writes)}"
        code, _ = finish(launch(path, args, hook), timeout)
        what = f"{hook} (exit {code})"
    else:
        process = launch(path, args)
        delay = rng.uniform(0.3, 0.95) * duration
        try:
            process.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            process.kill()
        process.communicate()
        what = f"SIGKILL at {delay:.1f} s"
    messages = complete(path, workdir, args, timeout)
    return what, messages, compare(root / path / "reference", workdir)


def drill(paths, random_kills, write_kills, epochs, config, root, data_dir, seed, timeout):
    """Runs the drill; returns the table rows (dicts). `write_kills` is a
    count of random write kills or a list of write numbers to kill in."""
    rng = random.Random(seed)
    rows = []
    prepare(config, data_dir)
    for path in paths:
        reference = root / path / "reference"
        shutil.rmtree(reference, ignore_errors=True)
        start = time.monotonic()
        code, out = finish(
            launch(path, run_args(path, reference, data_dir, epochs, config)), timeout
        )
        if code:
            raise RuntimeError(f"{path}: the reference run failed:\n{out[-3000:]}")
        duration = time.monotonic() - start
        kinds = ["random"] * random_kills
        kinds += list(write_kills) if isinstance(write_kills, list) else ["write"] * write_kills
        for index, kind in enumerate(kinds):
            what, messages, result = trial(
                path, kind, index, root, data_dir, epochs, config, rng, duration, timeout
            )
            rows.append(dict(path=path, kill=what, resumed=len(messages), **result))
            print(format_row(rows[-1]), flush=True)
    return rows


def format_row(row):
    marks = "  ".join(
        f"{k}={'exact' if row[k] else 'DIFFERS'}"
        for k in ("weights+optimizer", "metrics.csv", "tensorboard", "log.jsonl")
    )
    return f"{row['path']:9s} {row['kill']:28s} resumes={row['resumed']}  {marks}"


def main(argv):
    del argv
    unknown = set(FLAGS.paths) - set(PATHS)
    if unknown:
        sys.exit(f"--paths must be among {sorted(PATHS)}. Received: {sorted(unknown)}")
    root = pathlib.Path(FLAGS.workdir or tempfile.mkdtemp(prefix="kill_drill"))
    data_dir = FLAGS.data_dir or str(root / "data")
    print(f"Drill folder: {root}")
    rows = drill(
        FLAGS.paths,
        FLAGS.random_kills,
        FLAGS.write_kills,
        FLAGS.epochs,
        FLAGS.config,
        root,
        data_dir,
        FLAGS.seed,
        FLAGS.timeout,
    )
    print("\npath      trials  weights+optimizer  metrics.csv  tensorboard  log.jsonl")
    for path in FLAGS.paths:
        mine = [r for r in rows if r["path"] == path]
        counts = [
            f"{sum(r[k] for r in mine)}/{len(mine)}"
            for k in ("weights+optimizer", "metrics.csv", "tensorboard", "log.jsonl")
        ]
        print(f"{path:9s} {len(mine):6d}  {counts[0]:17s}  {counts[1]:11s}  "
              f"{counts[2]:11s}  {counts[3]}")  # fmt: skip
    if not all(all(r[k] for k in ("weights+optimizer", "metrics.csv")) for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
