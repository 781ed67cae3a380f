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
`scripts/fit_memory.py` prints the plan:

    python scripts/fit_memory.py --config saved_configs/mnist1d_cnn_invariant.py \\
        --budget_mb 512 --batch 256
"""

import json
import sys

from keras_accum.experiments import child

MEASURED_STEPS = 3  # The first traces; the peak is reached by the second.


def measure(config, micro_batch, remat, timeout=600):
    """Peak tensor memory (MB) of `config`'s training step at `micro_batch`
    items and `remat`, measured in a fresh process; returns a dict with
    `peak_mb`, `micro_batch`, `remat`, `device`."""
    request = json.dumps({"config": config, "micro_batch": micro_batch, "remat": remat})
    module = "keras_accum.experiments.fit_memory"
    return child.run(module, request, env=child.BFC, timeout=timeout)


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
    child.reset_peak()
    model = experiment._build_model(config, info, config["steps"], total_updates=1)
    model.fit(stream, steps_per_epoch=MEASURED_STEPS, epochs=1, verbose=0)
    return {
        "peak_mb": child.peak_mb(),
        "micro_batch": micro_batch,
        "remat": remat,
        "device": child.allocator(),
    }


if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    print(json.dumps(_measure_here(request["config"], request["micro_batch"], request["remat"])))
