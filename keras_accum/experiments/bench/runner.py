"""One contender on one model: `FitRunner` trains through `model.fit`'s
own train function and counts what a run must not do (retrace, reduce
across replicas more than once per window)."""

import contextlib
import dataclasses
import time

import keras
import numpy as np
import tensorflow as tf

import keras_accum as ka
from keras_accum import schedules
from keras_accum.experiments.probes import count_reductions


def tf_functions(fn, depth=0, seen=None):
    """The `tf.function`s reachable from `fn`'s closure (Keras wraps its
    step functions in a few layers of plain closures)."""
    seen = set() if seen is None else seen
    found = []
    if id(fn) in seen or depth > 4:
        return found
    seen.add(id(fn))
    if hasattr(fn, "experimental_get_tracing_count"):
        found.append(fn)
        fn = getattr(fn, "_python_function", None)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if callable(value):
            found += tf_functions(value, depth + 1, seen)
    return found


def bytes_per_parameter(optimizer, model):
    """Bytes of non-scalar optimizer variables per trainable parameter."""
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    total = sum(
        int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
        for v in optimizer.variables
        if len(v.shape) > 0
    )
    return total / params, params


class FitRunner:
    """Trains through Keras's `model.train_function` (what `fit` runs).

    One `call` runs K = steps x windows micro-batches of b examples (K / N
    big batches for the big-batch contender): one train-function call with
    `steps_per_execution = K`, or K calls with 1. `model.fit` does the
    warm-up (it builds the optimizer and traces).

    Interface a runner must offer: `micro_batches_per_call`, `call(calls)`
    -> (seconds, loss), `trace_count()` -> int, `warmup_traces`,
    `bytes_per_param`, `params`, `reductions` (dict, or None on one
    replica), `optimizer`.
    """

    def __init__(self, workload, contender, config, strategy, setting, micro_batch):
        self.traces = 0
        n, b = config.steps, micro_batch
        big = contender.batch_factor == "window"
        x, y = workload.data(n * b, config.quick, np.random.default_rng(config.seed))
        dataset = (
            tf.data.Dataset.from_tensor_slices((x, y))
            .batch(n * b if big else b, drop_remainder=True)
            .repeat()
        )
        self.micro_batches_per_call = n * config.windows
        steps_per_call = config.windows if big else n * config.windows
        spe = min(setting.steps_per_execution or steps_per_call, steps_per_call)
        self.executions_per_call = steps_per_call // spe
        keras.utils.set_random_seed(config.seed)
        with strategy.scope():
            self.model = workload.build(config.quick)
            self._count_traces(self.model)
            self.model.compile(
                optimizer=contender.make_optimizer(n),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                jit_compile=setting.jit_compile,
                steps_per_execution=spe,
            )
        self.optimizer = self.model.optimizer
        self.reductions = {} if strategy.num_replicas_in_sync > 1 else None
        counting = (
            count_reductions(strategy, self.optimizer, self.reductions)
            if self.reductions is not None
            else contextlib.nullcontext()
        )
        with counting:  # The warm-up fit traces the step.
            self.model.fit(
                dataset, epochs=1, steps_per_epoch=steps_per_call, shuffle=False, verbose=0
            )
        self.iterator = iter(strategy.experimental_distribute_dataset(dataset))
        for _ in range(config.warmup):
            self.call(1)
        self.warmup_traces = self.trace_count()
        self.bytes_per_param, self.params = bytes_per_parameter(self.optimizer, self.model)

    def _count_traces(self, model):
        original = model.train_step

        def counted_train_step(data):
            self.traces += 1  # Python runs only while tracing.
            return original(data)

        model.train_step = counted_train_step

    def call(self, calls):
        """Runs `calls` x K micro-batches; returns seconds and loss."""
        function = self.model.train_function
        start = time.perf_counter()
        for _ in range(calls * self.executions_per_call):
            logs = function(self.iterator)
        loss = float(logs["loss"])  # Waits for the last call to finish.
        return time.perf_counter() - start, loss

    def trace_count(self):
        """Python traces of `train_step` plus the tracing counts of the
        `tf.function`s in `model.train_function`."""
        functions = tf_functions(self.model.train_function)
        return self.traces + sum(f.experimental_get_tracing_count() for f in functions)


def _change_learning_rate(optimizer):
    old = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
    optimizer.learning_rate = 0.5 * old + 1e-4
    return lambda: setattr(optimizer, "learning_rate", old)


def _change_steps(optimizer):
    schedule = getattr(optimizer, "steps", None)
    # `AdaptiveSteps` holds the next window's size in a variable; a
    # Python-int `steps` has none (changing it means a new optimizer).
    steps = None
    if isinstance(schedule, schedules.StepsSchedule):
        steps = getattr(schedule, "steps", None)
    if not hasattr(steps, "assign"):
        return None
    old = int(keras.ops.convert_to_numpy(steps))
    steps.assign(2 * old)
    return lambda: steps.assign(old)


def with_steps_variable(contender, micro_batch):
    """`contender` with `steps` held in a variable: `AdaptiveSteps` from N
    to 2N (no noise-scale feed, so it stays where the probe sets it)."""
    make = contender.make_optimizer
    return dataclasses.replace(
        contender,
        make_optimizer=lambda n: make(ka.AdaptiveSteps(n, 2 * n, micro_batch)),
    )


PROBES = {"learning_rate": _change_learning_rate, "steps": _change_steps}


def retraces_after_change(runner, what):
    """Traces caused by changing `what` ("learning_rate" or "steps")
    through its variable between two calls; None when it is not a
    variable."""
    undo = PROBES[what](runner.optimizer)
    if undo is None:
        return None
    before = runner.trace_count()
    try:
        runner.call(1)
    finally:
        undo()
    return runner.trace_count() - before
