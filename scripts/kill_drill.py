"""Kill drill: SIGKILL scripts/train.py at random times, in the middle of
checkpoint writes and inside and between a new run folder's first writes,
recover it to completion, compare with an uninterrupted run.

    python scripts/kill_drill.py                      # fit, loop, mirrored
    python scripts/kill_drill.py --paths loop --random_kills 2 --write_kills 1

Paths: `fit` (model.fit, one device), `loop` (the custom loop of
keras_accum.training: --strategy multi_worker without TF_CONFIG, one
process), `mirrored` (model.fit under MirroredStrategy on 2 logical
CPUs) and `peer` (--strategy multi_worker as 2 local workers; workers 0
and 1 take turns as the one killed, at a random moment after the cluster
formed, `--early_kills` of them within 2 s of it, or in a checkpoint
write; the drill times the other worker's lost-peer error line and
checks it names the resume command, exit status 3).

Each trial starts a run, kills it (a random moment, or the hook
`KERAS_ACCUM_CHECKPOINT_HOOK=kill:<n>` that truncates the n-th atomic
write's temporary file and SIGKILLs the process inside the write), then runs
`--resume` until it finishes. It then compares, bit for bit, the final
checkpoint (weights and optimizer state), metrics.csv, the TensorBoard
scalars and (loop) log.jsonl with the uninterrupted run's, and prints a table.
Op determinism is on in every run.

New-folder kills (`--new_folder_kills`, fit, loop and mirrored): a new run
writes checkpoints/config.json (write 1), config.json (2), on the loop
loop/config.json (3), then a checkpoint per epoch and at the end final.json.
The hook kills it inside write 1 and 2 (`kill:<n>`) and just after them
(`after:<n>`, between two writes); each such folder is recovered once with
the same command plus `--resume` and once with the plain command, in the
same folder, never deleted by the drill. `--resume` of a folder killed
inside write 1 has no config to start: it must refuse in one line naming the
plain command, which then runs. A last trial kills inside the final.json
write and resumes.
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

# The harness is TensorFlow: this script sets the backend itself (an explicit
# KERAS_BACKEND is kept, and then refused in one line if it is another).
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
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
flags.DEFINE_integer("early_kills", 2, "peer: trials killed within 2 s of the cluster forming.")
flags.DEFINE_bool(
    "new_folder_kills", True, "Kill new runs inside and between their first writes (not peer)."
)

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
    "peer": (["--strategy", "multi_worker"], 1),
}
# TF's log line (worker 1) when the cluster has formed.
FORMED = "Coordination agent has successfully connected"
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


def launch_peer(args, log_dir, hook=None, victim=None):
    """The 2 workers of a `peer` run (TF's INFO log on, to see the cluster
    form); `hook` goes to worker `victim` only. Returns the started cluster."""
    from keras_accum.training import multiworker

    env = dict(PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="0", KILL_DRILL_CPUS="1")
    command = [sys.executable, "-c", BOOT, str(ROOT / "scripts" / "train.py"), *args]
    worker_env = {victim: {"KERAS_ACCUM_CHECKPOINT_HOOK": hook}} if hook else None
    os.environ.pop("KERAS_ACCUM_CHECKPOINT_HOOK", None)
    cluster = multiworker.LocalCluster(
        2, command, env=env, worker_env=worker_env, log_dir=str(log_dir), grace_seconds=120
    )
    return cluster.start()


def finish_peer(cluster, timeout):
    """(0 or the first failing exit code, the chief's log) of a cluster."""
    from keras_accum.training import multiworker

    try:
        cluster.wait(timeout)
        code = 0
    except multiworker.WorkerFailedError:
        code = next(p.returncode for p in cluster.processes if p.returncode)
    cluster._kill_all()
    return code, cluster.log(0)


def run_args(path, workdir, data_dir, epochs, config):
    strategy, _ = PATHS[path]
    return ["--config", config, "--epochs", str(epochs), "--data_dir", data_dir,
            "--workdir", str(workdir), *strategy]  # fmt: skip


def finish(process, timeout):
    out, _ = process.communicate(timeout=timeout)
    return process.returncode, out


# The atomic writes of a new run before its first checkpoint (see the
# module docstring): the first checkpoint is write FIRST[path] + 1.
FIRST = {"fit": 2, "mirrored": 2, "loop": 3, "peer": 3}
REFUSED = "error: --resume: no run folder"


def complete(path, workdir, args, timeout, first=None):
    """Runs `first` ("resume": the same command with --resume; "plain": the
    plain command; None: --resume when the folder holds a config, else the
    plain command) and then --resume until the run exits 0, in the same
    folder; returns the resume messages seen. A --resume of a folder with
    no config must refuse in one line naming the plain command."""
    messages = []
    for attempt in range(5):
        has_config = any((workdir / n).exists() for n in ("config.json", "checkpoints/config.json"))
        use = first if attempt == 0 and first else ("resume" if has_config else "plain")
        argv = ["--workdir", str(workdir), "--resume"] if use == "resume" else args
        if path == "peer":
            logs = workdir.parent / f"{workdir.name}_logs" / f"resume_{attempt}"
            code, out = finish_peer(launch_peer(argv, logs), timeout)
        else:
            code, out = finish(launch(path, argv), timeout)
        messages += [line for line in out.splitlines() if "Resuming from" in line]
        messages += [line for line in out.splitlines() if "Skipped" in line]
        if code == 0:
            return messages
        if use == "resume" and not has_config and REFUSED in out and "--config" in out:
            messages.append("refused: no config")  # as it must; the plain command follows
            first = "plain"
            continue
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
    extra = {}
    if path == "peer":
        what, extra = peer_trial(kind, index, workdir, args, rng, duration, epochs, timeout)
    elif isinstance(kind, tuple):  # ("new", hook, first command)
        _, hook, first = kind
        code, _ = finish(launch(path, args, hook), timeout)
        what = f"{hook} (exit {code}) then {first}"
        messages = complete(path, workdir, args, timeout, first)
        return what, messages, {**compare(root / path / "reference", workdir), **extra}
    elif kind == "write" or isinstance(kind, int):
        # The hook kills the process inside its n-th atomic write (n random
        # among the checkpoint writes unless given; see FIRST).
        number = kind if isinstance(kind, int) else FIRST[path] + rng.randint(1, epochs)
        hook = f"kill:{number}"
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
    return what, messages, {**compare(root / path / "reference", workdir), **extra}


def wait_for(cluster, index, text, timeout):
    """Seconds until `text` is in worker `index`'s log, polled every 20 ms
    (None when the worker exits first or `timeout` passes)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if text in cluster.log(index):
            return time.monotonic() - start
        if cluster.processes[index].poll() is not None:
            return None
        time.sleep(0.02)
    return None


def error_line(log):
    lines = [line for line in log.replace("\r", "\n").splitlines() if line.startswith("error:")]
    return lines[0] if lines else None


def peer_kill(cluster, victim, kind, hook, rng, span, timeout):
    """Kills worker `victim` (or lets the hook do it); returns a description
    of the kill, and the survivor's time to its error line (None: none)."""
    survivor = 1 - victim
    wait_for(cluster, 1, FORMED, timeout)
    if hook:
        while cluster.processes[victim].poll() is None:
            if cluster.processes[survivor].poll() is not None:
                return f"{hook} on worker {victim} (did not fire)", None
            time.sleep(0.02)
        what = f"{hook} on worker {victim}"
    else:
        delay = rng.uniform(0, 2) if kind == "early" else rng.uniform(0, 0.9 * span)
        time.sleep(delay)
        if cluster.processes[victim].poll() is not None:
            return f"worker {victim} ended before its kill", None
        cluster.kill(victim)
        what = f"worker {victim} SIGKILL {delay:.1f} s after the cluster formed"
    killed = time.monotonic()
    while error_line(cluster.log(survivor)) is None and time.monotonic() - killed < 120:
        if (
            cluster.processes[survivor].poll() is not None
            and error_line(cluster.log(survivor)) is None
        ):
            break
        time.sleep(0.02)
    seconds = time.monotonic() - killed if error_line(cluster.log(survivor)) else None
    return what, seconds


def peer_trial(kind, index, workdir, args, rng, span, epochs, timeout):
    """A `peer` trial: returns (kill description, its lost-peer result)."""
    victim = index % 2
    hook = f"kill:{rng.randint(1, epochs + 1)}" if kind == "write" else None
    log_dir = workdir.parent / f"{workdir.name}_logs" / "killed"
    cluster = launch_peer(args, log_dir, hook=hook, victim=victim)
    try:
        what, seconds = peer_kill(cluster, victim, kind, hook, rng, span, timeout)
        survivor = cluster.processes[1 - victim]
        code = survivor.wait(timeout=120) if seconds is not None else survivor.poll()
        line = error_line(cluster.log(1 - victim)) or ""
    finally:
        cluster._kill_all()
    hint = f"To resume: python scripts/train.py --workdir {workdir} --resume"
    if seconds is None:
        return what, {"error_seconds": None, "lost_peer": False}
    # scripts/train.py prints WorkerLostError as this one line, exit 3.
    ours = line.startswith("error: A collective failed: another worker") and hint in line
    return f"{what}; worker {1 - victim}: error after {seconds:.1f} s, exit {code}", {
        "error_seconds": seconds,
        "lost_peer": ours and code == 3,
    }


def new_folder_kinds(path, epochs):
    """The new-folder trials of `path`: kills inside and after each config
    write, each recovered by --resume and by the plain command, then a kill
    inside the final.json write (after the checkpoints) resumed."""
    hooks = [f"{how}:{n}" for n in range(1, FIRST[path] + 1) for how in ("kill", "after")]
    kinds = [("new", hook, first) for hook in hooks for first in ("resume", "plain")]
    # Writes after the config: the checkpoints, the loop's metrics.csv, final.json.
    final = FIRST[path] + epochs + (path == "loop") + 1
    return kinds + [("new", f"kill:{final}", "resume")]


def drill(
    paths,
    random_kills,
    write_kills,
    epochs,
    config,
    root,
    data_dir,
    seed,
    timeout,
    early_kills=0,
    new_folder_kills=False,
):
    """Runs the drill; returns the table rows (dicts). `write_kills` is a
    count of random write kills or a list of write numbers to kill in;
    `new_folder_kills` adds the trials of `new_folder_kinds`."""
    rng = random.Random(seed)
    rows = []
    prepare(config, data_dir)
    for path in paths:
        reference = root / path / "reference"
        shutil.rmtree(reference, ignore_errors=True)
        start = time.monotonic()
        args = run_args(path, reference, data_dir, epochs, config)
        if path == "peer":
            cluster = launch_peer(args, root / path / "reference_logs")
            formed = wait_for(cluster, 1, FORMED, timeout) or 0.0
            code, out = finish_peer(cluster, timeout)
            # Kill times are drawn from the part after the cluster formed.
            duration = time.monotonic() - start - formed
        else:
            code, out = finish(launch(path, args), timeout)
            duration = time.monotonic() - start
        if code:
            raise RuntimeError(f"{path}: the reference run failed:\n{out[-3000:]}")
        kinds = ["early"] * early_kills * (path == "peer") + ["random"] * random_kills
        kinds += list(write_kills) if isinstance(write_kills, list) else ["write"] * write_kills
        if new_folder_kills and path != "peer":
            kinds += new_folder_kinds(path, epochs)
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
    if "lost_peer" in row:
        marks += f"  lost-peer error={'ok' if row['lost_peer'] else 'WRONG'}"
    return f"{row['path']:9s} {row['kill']:34s} resumes={row['resumed']}  {marks}"


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
        FLAGS.early_kills,
        FLAGS.new_folder_kills,
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
    timed = [r for r in rows if "lost_peer" in r]
    if timed:
        seconds = sorted(r["error_seconds"] for r in timed if r["error_seconds"] is not None)
        good = sum(r["lost_peer"] for r in timed)
        times = ", ".join(f"{t:.1f}" for t in seconds)
        print(f"peer: lost-peer error line {good}/{len(timed)}, seconds after the kill: {times}")
    if not all(r.get("lost_peer", True) for r in rows):
        sys.exit(1)
    if not all(all(r[k] for k in ("weights+optimizer", "metrics.csv")) for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
