"""Does one micro-batch fit? Peak tensor memory of measured training steps.

Every number here comes from a measured step, not a formula: a fresh
process (TensorFlow's BFC allocator on the CPU, `TF_CPU_ALLOCATOR_USE_BFC`,
chosen before TensorFlow starts; with a GPU its own allocator) builds the
run's model and optimizer from a run config, with the config's `remat`
replaced, trains a few `model.fit` steps at one micro-batch size on the
run's data, and reports the allocator's peak: weights, optimizer state,
the batch and every transient buffer of the step, all counted.

* `measure(config, micro_batch, remat)`: the peak of one such process.
* `plan(config, budget_mb, batch)`: for each remat mode, whether
  micro-batch 1 fits the budget, and the largest micro-batch that divides
  `batch` and fits, with `steps = batch / micro_batch` (a doubling search
  over the divisors of `batch`, one process per size tried).
* `peak_tensor_mb()` / `reset_peak()`: the allocator's peak in this
  process (None where the allocator does not report it), for a run's
  final.json.

`scripts/fit_memory.py` prints the plan:

    python scripts/fit_memory.py --config saved_configs/mnist1d_cnn_invariant.py \\
        --budget_mb 512 --batch 256
"""

import json
import os
import pathlib
import subprocess
import sys

BFC = {"TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPP_MIN_LOG_LEVEL": "3"}
MEASURED_STEPS = 3  # The first traces; the peak is reached by the second.
# The child imports this checkout's package, whatever else is installed.
ROOT = str(pathlib.Path(__file__).resolve().parents[2])


def _allocator():
    import tensorflow as tf

    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def reset_peak():
    """Starts the allocator's peak afresh (no-op where it keeps none)."""
    import tensorflow as tf

    try:
        tf.config.experimental.reset_memory_stats(_allocator())
    except (ValueError, tf.errors.InvalidArgumentError):
        pass


def peak_tensor_mb():
    """The allocator's peak bytes in use since `reset_peak` (or the start),
    in MB; None where it reports none (the default CPU allocator: set
    TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow starts)."""
    import tensorflow as tf

    try:
        peak = tf.config.experimental.get_memory_info(_allocator())["peak"]
    except (ValueError, tf.errors.InvalidArgumentError):
        return None
    return round(peak / 2**20, 2) if peak else None


def measure(config, micro_batch, remat, timeout=600):
    """Peak tensor memory (MB) of `config`'s training step at `micro_batch`
    items and `remat`, measured in a fresh process; returns a dict with
    `peak_mb`, `micro_batch`, `remat`, `device`."""
    request = json.dumps({"config": config, "micro_batch": micro_batch, "remat": remat})
    result = subprocess.run(
        [sys.executable, "-m", "keras_accum.experiments.fit_memory", request],
        env={
            **os.environ,
            **BFC,
            "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
        },
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode or not lines:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"Measuring micro_batch={micro_batch}, remat={remat!r} failed: {tail}")
    return json.loads(lines[-1])


def plan(config, budget_mb, batch, modes=("none", "full"), report=print):
    """For each mode in `modes`: {"micro_batch_1_mb", "fits", "micro_batch",
    "steps", "peak_mb", "tried"} where `micro_batch` is the largest divisor
    of `batch` (tried 1, 2, 4, ... and `batch`) whose measured peak fits
    `budget_mb` (None if even 1 does not) and `steps = batch // micro_batch`.
    `tried` maps each measured micro-batch to its peak; `report` gets one
    line per measurement."""
    sizes = sorted({b for b in [2**k for k in range(batch.bit_length())] + [batch] if b <= batch})
    sizes = [b for b in sizes if batch % b == 0]
    results = {}
    for mode in modes:
        tried, best = {}, None
        for size in sizes:
            peak = measure(config, size, mode)["peak_mb"]
            tried[size] = peak
            report(f"remat={mode} micro_batch={size}: peak {peak:.1f} MB")
            if peak > budget_mb:
                break
            best = size
        results[mode] = {
            "micro_batch_1_mb": tried[1],
            "fits": tried[1] <= budget_mb,
            "micro_batch": best,
            "steps": batch // best if best else None,
            "peak_mb": tried[best] if best else None,
            "tried": tried,
        }
    return results


def _measure_here(config, micro_batch, remat):
    """In this (fresh, BFC) process: the run's model and optimizer, a few
    `model.fit` steps at `micro_batch`, the allocator's peak."""
    import keras

    from keras_accum.experiments import data, experiment

    config = experiment.resolve_config({**config, "remat": remat, "micro_batch_size": micro_batch})
    keras.utils.set_random_seed(config["seed"])
    keras.mixed_precision.set_global_policy(
        "mixed_float16" if config["mixed_precision"] else "float32"
    )
    info = data.dataset_info(config["dataset"], config["data_dir"])
    stream = data.load(
        config["dataset"],
        "train",
        data_dir=config["data_dir"],
        batch_size=micro_batch,
        drop_remainder=True,
    ).repeat()
    reset_peak()
    model = experiment._build_model(config, info, config["steps"], total_updates=1)
    model.fit(stream, steps_per_epoch=MEASURED_STEPS, epochs=1, verbose=0)
    return {
        "peak_mb": peak_tensor_mb(),
        "micro_batch": micro_batch,
        "remat": remat,
        "device": _allocator(),
    }


if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    print(json.dumps(_measure_here(request["config"], request["micro_batch"], request["remat"])))
