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
from keras_accum.experiments.bench.config import SETTINGS, device_of, log, run_device
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
    device = run_device(setting.name)
    for name in config.contenders:
        contender = CONTENDERS[name]
        row = rows[name] = {
            "device": device,
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


def ratio_pairs(rows, samples, steps):
    """Per-round ratios of each contender against the references:
    {name: {"vs_...": [ratio per round] or None where a reference is
    missing}}.

    The *limit* of accumulation is N forward/backward passes whose
    gradients are computed, read once and dropped (`gradients_only`) plus
    one Adam update; per micro-batch, from the same round:
    limit = t_gradients_only + (t_adam - t_gradients_only) / N.
    """
    by_role = {rows[n]["role"]: samples[n] for n in samples}
    keras_times, adam_times = by_role.get("keras"), by_role.get("adam")
    grads_times = by_role.get("gradients_only")
    limit = None
    if adam_times and grads_times:
        limit = [g + (a - g) / steps for g, a in zip(grads_times, adam_times)]
    references = {
        "vs_keras_accumulation": keras_times,
        "vs_adam": adam_times,
        "vs_big_batch": by_role.get("big_batch"),
        "vs_limit": limit,
    }
    return {
        name: {
            key: None if ref is None else [a / r for a, r in zip(samples[name], ref)]
            for key, ref in references.items()
        }
        for name in samples
    }


def _summary(pairs):
    return None if pairs is None else dict(zip(("q25", "median", "q75"), quartiles(pairs)))


def add_ratios(rows, samples, steps):
    """Per-round ratios against the references (`ratio_pairs`), summarised
    by quartiles."""
    for name, pairs in ratio_pairs(rows, samples, steps).items():
        rows[name]["ratios"] = {key: _summary(p) for key, p in pairs.items()}


def pool_runs(runs, steps):
    """The rows of several runs, one list per run, with each group timed in
    more than one run (one process each) pooled into one row per contender.

    Ratios move by a few percent between processes on a noisy machine, more
    than between the rounds of one process; pooling counts each process's
    rounds alike. A pooled row holds every run's samples (in run order),
    its time is their median, and each ratio is the median of the per-round
    ratios of every run, each taken within its own run; `processes` says
    how many runs it pools, and a retrace in any run counts. A group must
    time the same contenders in every run that has it (else ValueError).
    A group is one device, setting, model and micro-batch size: the same
    group timed on a GPU and on the CPU stays two groups.
    """
    groups, order = {}, []
    for rows in runs:
        seen = {}
        for row in rows:
            key = (device_of(row), row["setting"], row["model"], row.get("micro_batch"))
            seen.setdefault(key, {})[row["contender"]] = row
            if (key, row["contender"]) not in order:
                order.append((key, row["contender"]))
        for key, group in seen.items():
            groups.setdefault(key, []).append(group)
    pooled = {}
    for key, runs_of_group in groups.items():
        if len(runs_of_group) == 1:
            pooled.update({(key, n): row for n, row in runs_of_group[0].items()})
            continue
        names = [sorted(group) for group in runs_of_group]
        if any(n != names[0] for n in names):
            raise ValueError(
                f"Cannot pool group {key}: its runs time different contenders. Received: {names}"
            )
        pooled.update({(key, n): _pooled_row(runs_of_group, n, steps) for n in names[0]})
    return [pooled[item] for item in order]


def _pooled_row(runs_of_group, name, steps):
    timed = [g for g in runs_of_group if "samples" in g[name]]
    if not timed:  # failed in every run: the first failure
        return runs_of_group[0][name]
    row = dict(timed[0][name])
    samples = [s for g in timed for s in g[name]["samples"]]
    pairs = {}
    for g in timed:
        rows = {n: r for n, r in g.items() if "samples" in r}  # failed ones left out
        per_run = ratio_pairs(rows, {n: r["samples"] for n, r in rows.items()}, steps)[name]
        for ratio, values in per_run.items():
            if values is not None:
                pairs.setdefault(ratio, []).extend(values)
    median = statistics.median(samples)
    row.update(
        samples=samples,
        seconds_per_micro_batch=median,
        examples_per_second=row["micro_batch"] / median,
        processes=len(timed),
        ratios={r: _summary(pairs.get(r)) for r in timed[0][name]["ratios"]},
    )
    for field in [f for f in row if f.startswith("retraces")]:
        counts = [g[name].get(field) for g in timed if g[name].get(field) is not None]
        row[field] = max(counts) if counts else None
    return row
