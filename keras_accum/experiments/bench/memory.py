"""Peak memory and XLA copies, each measured in a fresh process per
(model, contender) (see `worker`)."""

import glob
import os
import resource

import keras
import numpy as np
import tensorflow as tf

from keras_accum.experiments import child
from keras_accum.experiments.bench.config import SETTINGS, run_device
from keras_accum.experiments.bench.contenders import CONTENDERS
from keras_accum.experiments.bench.runner import FitRunner
from keras_accum.experiments.bench.workloads import WORKLOADS
from keras_accum.experiments.probes import count_copies


def memory_mb():
    """(current RSS, peak RSS) of this process in MB.

    From /proc/self/status (VmRSS, VmHWM): the high-water mark of this
    process's own address space. `resource.getrusage().ru_maxrss` is not
    usable in a child: Linux carries the parent's peak across fork + exec
    into it (a 2 GB parent gives every worker a 2 GB "peak").
    """
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return (int(fields["VmRSS"].split()[0]) / 1024.0, int(fields["VmHWM"].split()[0]) / 1024.0)
    except (OSError, KeyError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        return peak, peak


def _model_and_data_up(model_name, config):
    """TensorFlow, a model and a batch of data up (the memory baseline);
    returns `memory_mb()` then."""
    workload = WORKLOADS[model_name]
    keras.utils.set_random_seed(config.seed)
    x, _ = workload.data(1, config.quick, np.random.default_rng(config.seed))
    workload.build(config.quick)(x)
    return memory_mb()


def _trained(model_name, contender_name, setting_name, config, calls=2):
    """A `FitRunner` (warmed up by its `fit`) after `calls` more calls."""
    runner = FitRunner(
        WORKLOADS[model_name],
        CONTENDERS[contender_name],
        config,
        tf.distribute.get_strategy(),
        SETTINGS[setting_name],
        config.micro_batch,
    )
    if calls:
        runner.call(calls)
    return runner


def measure_rss(model_name, contender_name, config):
    """In a fresh process: RSS once TensorFlow, the model and the data are
    up (baseline), and the peak after warm-up and a few training calls, in
    graph mode at micro-batch `config.micro_batch`."""
    baseline, _ = _model_and_data_up(model_name, config)
    runner = _trained(model_name, contender_name, "graph", config)
    _, peak = memory_mb()
    return {
        "device": run_device("graph"),
        "baseline_mb": baseline,
        "peak_mb": peak,
        "bytes_per_param": runner.bytes_per_param,
    }


def measure_tensor_memory(model_name, contender_name, setting_name, config):
    """In a fresh process started with TF_CPU_ALLOCATOR_USE_BFC=true (see
    `worker`): the peak of the memory TensorFlow's allocator hands out,
    above what the model and the data hold, over the warm-up and a few
    training calls: the optimizer's state plus every transient buffer of
    the step, without the process's code and allocator slack. Fresh
    processes agree to about 2% on the 4.2M-parameter MLP (the order in
    which TensorFlow runs independent ops moves the peak; the RSS varies by
    tens of MB); on a tiny model one unrelated buffer alive at the peak or
    not can double it. With a GPU, the step's tensors live there and its
    allocator is read instead."""
    _model_and_data_up(model_name, config)
    baseline = child.memory_info()["current"]
    child.reset_peak()
    runner = _trained(model_name, contender_name, setting_name, config)
    peak = child.memory_info()["peak"] - baseline
    return {
        "device": run_device(setting_name),
        "setting": setting_name,
        "peak_mb": peak / 2**20,
        "per_param": peak / runner.params,
    }


def measure_xla_copies(model_name, contender_name, config, dump_dir):
    """Compiles one contender's step with XLA (in a child whose XLA_FLAGS
    dump the optimised HLO to `dump_dir`) and counts the elements its `copy`
    instructions move, per trainable parameter.

    A fused in-place update needs no copy; each parameter-sized copy reads
    and writes 8 bytes per parameter.
    """
    runner = _trained(model_name, contender_name, "xla", config, calls=0)
    pattern = os.path.join(dump_dir, "*one_step_on_data*after_optimizations.txt")
    files = sorted(glob.glob(pattern))
    if not files:
        raise RuntimeError(f"No optimised HLO dumped under {dump_dir}.")
    with open(files[-1]) as f:
        counts = count_copies(f)
    return dict(
        {key: value / runner.params for key, value in counts.items()}, device=run_device("xla")
    )
