"""A group: every contender on one model in one setting at one micro-batch
size, timed side by side in one process.

The contenders are sampled round-robin, the starting contender rotating
each round, so that drift of the machine (other processes, thermal, the
allocator) hits all of them alike. A ratio is the median over rounds of the
per-round ratio of two contenders' samples taken seconds apart; its
quartiles are reported as its spread.
"""

import gc
import math
import statistics

import tensorflow as tf

from keras_accum.experiments.bench import runner as runner_lib
from keras_accum.experiments.bench.config import SETTINGS, log
from keras_accum.experiments.bench.contenders import CONTENDERS
from keras_accum.experiments.bench.workloads import WORKLOADS


def _strategy(setting):
    if setting.replicas == 1:
        return tf.distribute.get_strategy()
    devices = [f"/cpu:{i}" for i in range(setting.replicas)]
    return tf.distribute.MirroredStrategy(devices)


def _build(rows, model_name, setting, config, micro_batch, strategy):
    """The runners that could be built; a failure is recorded in its row
    (e.g. Keras's accumulation under MirroredStrategy, keras#20582)."""
    runners = {}
    tag = f"{setting.name}/{model_name}/b={micro_batch}"
    for name in config.contenders:
        contender = CONTENDERS[name]
        row = rows[name] = {
            "setting": setting.name,
            "model": model_name,
            "micro_batch": micro_batch,
            "contender": name,
            "label": contender.label,
            "role": contender.role,
        }
        log(f"{tag}: build + warm up {name}")
        try:
            runner_class = contender.runner or runner_lib.FitRunner
            runner = runner_class(
                WORKLOADS[model_name], contender, config, strategy, setting, micro_batch
            )
        except Exception as error:  # Recorded, not fatal.
            row["error"] = f"{type(error).__name__}: {error}".split("\n")[0][:300]
            log(f"{tag}: {name} failed: {row['error']}")
            continue
        runners[name] = runner
        row.update(
            params=runner.params,
            bytes_per_param=runner.bytes_per_param,
            warmup_traces=runner.warmup_traces,
        )
        if runner.reductions is not None:
            row["reductions"] = dict(runner.reductions)
    return runners


def _sample(runners, config, tag):
    """Round-robin timing; returns {name: [seconds per micro-batch]}, losses."""
    # A sample lasts about min_sample_seconds for plain Adam (or the first
    # contender that ran); the same number of calls for everyone.
    reference = runners.get("adam") or next(iter(runners.values()))
    one_call = min(reference.call(1)[0] for _ in range(2))
    calls = max(1, math.ceil(config.min_sample_seconds / one_call))
    log(f"{tag}: {calls} call(s) of {reference.micro_batches_per_call} micro-batches per sample")
    names = list(runners)
    for name in names:  # One untimed round: every contender warm.
        runners[name].call(calls)
    samples = {name: [] for name in names}
    losses = {}
    for round_index in range(config.repeats):
        gc.collect()
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            seconds, losses[name] = runners[name].call(calls)
            samples[name].append(seconds / (calls * runners[name].micro_batches_per_call))
        shown = ", ".join(f"{n} {1e3 * samples[n][-1]:.3f}" for n in names)
        log(f"{tag}: round {round_index + 1}/{config.repeats}: {shown} ms")
    return samples, losses, calls


def run_group(model_name, setting_name, config, micro_batch=None, strategy=None):
    """Times every contender of `config` on one model in one setting.

    `strategy`: the MirroredStrategy to use for a multi-replica setting
    (default: a new one; a process should hold only one, see
    tests/conftest.py).
    """
    setting = SETTINGS[setting_name]
    micro_batch = micro_batch or config.micro_batch
    strategy = strategy or _strategy(setting)
    tag = f"{setting_name}/{model_name}/b={micro_batch}"
    rows = {}
    runners = _build(rows, model_name, setting, config, micro_batch, strategy)
    if not runners:
        return list(rows.values())
    samples, losses, calls = _sample(runners, config, tag)
    for name, runner in runners.items():
        median = statistics.median(samples[name])
        rows[name].update(
            seconds_per_micro_batch=median,
            examples_per_second=micro_batch / median,
            samples=samples[name],
            calls_per_sample=calls,
            micro_batches_per_call=runner.micro_batches_per_call,
            final_loss=losses[name],
            retraces=runner.trace_count() - runner.warmup_traces,
        )
        for what in runner_lib.PROBES:  # After timing: probes call once more.
            rows[name][f"retraces_{what}"] = runner_lib.retraces_after_change(runner, what)
    _probe_steps_variable(rows, runners, model_name, setting, config, micro_batch, strategy)
    add_ratios(rows, samples, config.steps)
    return list(rows.values())


def _probe_steps_variable(rows, runners, model_name, setting, config, micro_batch, strategy):
    """Our optimizers time with a constant `steps` (what a user gets); the
    `steps` probe needs it in a variable, so each is built once more with
    `AdaptiveSteps` (untimed), warmed up, then probed."""
    for name in runners:
        contender = CONTENDERS[name]
        if contender.role != "ours" or rows[name].get("retraces_steps") is not None:
            continue
        runner_class = contender.runner or runner_lib.FitRunner
        probe = runner_class(
            WORKLOADS[model_name],
            runner_lib.with_steps_variable(contender, micro_batch),
            config,
            strategy,
            setting,
            micro_batch,
        )
        rows[name]["retraces_steps"] = runner_lib.retraces_after_change(probe, "steps")
        del probe
        gc.collect()


def quartiles(values):
    if len(values) == 1:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], statistics.median(values), q[2]


def add_ratios(rows, samples, steps):
    """Per-round ratios against the references, summarised by quartiles.

    The *limit* of accumulation is N forward/backward passes whose
    gradients are computed, read once and dropped (`gradients_only`) plus
    one Adam update; per micro-batch, from the same round:
    limit = t_gradients_only + (t_adam - t_gradients_only) / N.
    """

    def ratio(name, reference):
        if reference is None:
            return None
        pairs = [a / r for a, r in zip(samples[name], reference)]
        return dict(zip(("q25", "median", "q75"), quartiles(pairs)))

    by_role = {rows[n]["role"]: samples[n] for n in samples}
    keras_times, adam_times = by_role.get("keras"), by_role.get("adam")
    grads_times = by_role.get("gradients_only")
    limit = None
    if adam_times and grads_times:
        limit = [g + (a - g) / steps for g, a in zip(grads_times, adam_times)]
    for name in samples:
        rows[name]["ratios"] = {
            "vs_keras_accumulation": ratio(name, keras_times),
            "vs_adam": ratio(name, adam_times),
            "vs_big_batch": ratio(name, by_role.get("big_batch")),
            "vs_limit": ratio(name, limit),
        }
