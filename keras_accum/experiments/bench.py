"""Speed and memory of the keras_accum optimizers, measured side by side.

`run(BenchConfig())` measures, in one process, the time per micro-batch of
every contender (`CONTENDERS`) on every model (`MODELS`) in every setting
(`SETTINGS`: graph mode, XLA, MirroredStrategy on 2 logical CPUs), and
returns a dict that `write_outputs` turns into a Markdown table, JSON and
CSV. `scripts/bench.py` is the command-line entry point.

How a time is taken:

* Each contender gets its own copy of the model, compiled with
  `steps_per_execution = K = steps * windows`, so that one call of Keras's
  `model.train_function(iterator)` runs K micro-batches (N of them per window)
  in a `tf.while_loop` inside one `tf.function`: the per-call Python overhead
  of `model.fit` (callbacks, logs, a Python round trip per batch) is paid
  once per K micro-batches instead of once per micro-batch. This is the code
  `model.fit` runs; `model.fit` itself is used for the warm-up (it builds the
  optimizer and traces the step), and its per-epoch bookkeeping would only
  add noise. One *sample* is `calls` back-to-back calls (calibrated once so
  that a sample lasts about `min_sample_seconds`), divided by the number of
  micro-batches it ran.
* The contenders are sampled round-robin, the starting contender rotating
  each round, so that drift of the machine (other processes, thermal, the
  allocator) hits all of them alike. A ratio is the median over rounds of the
  per-round ratio of two contenders' samples taken seconds apart; its
  quartiles are reported as its spread.
* Data are random tensors of the model's input shape, `N` distinct
  micro-batches cached in memory, so the input pipeline costs nothing.
* The "big batch" contender is plain Adam on batches of N x b (one update per
  window, same examples). The "limit" of accumulation is N forward/backward
  passes whose gradients are computed, read once and dropped (the
  `gradients_only` contender, `GradientsOnly` below) plus one Adam update;
  per micro-batch, with all three measured in the same round:

      limit = t_gradients_only + (t_adam - t_gradients_only) / N

* Traces are counted with a Python counter around `model.train_step` (it
  only runs while TensorFlow traces) and with the tracing counts of the
  `tf.function`s inside `model.train_function`. After warm-up, the count
  must not move.
* Optimizer memory is the sum of the sizes of `optimizer.variables`, scalars
  excluded, divided by the number of trainable parameters. Peak resident
  memory is a high-water mark (VmHWM of /proc/self/status), so it is taken
  in a fresh subprocess per (model, contender) to isolate each
  configuration; the baseline is the RSS once TensorFlow, the model and the
  data are up, before compiling.
* MirroredStrategy needs 2 logical CPUs configured before TensorFlow
  initialises: that setting runs in a subprocess too (`_worker`).

To add a contender, register it; a custom training loop (e.g. one from
`keras_accum.training`) brings its own runner, a class with the interface
of `FitRunner` (constructor arguments, `call`, `trace_count`, ...):

    register(Contender(
        "loop_gradient_accumulation", "GradientAccumulation, custom loop",
        "ours",
        lambda steps: ka.GradientAccumulation(keras.optimizers.Adam(), steps),
        runner=LoopRunner))

and `--contenders=...,loop_gradient_accumulation` times it beside the rest.
"""

import dataclasses
import gc
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_accum as ka  # noqa: E402

# -- configuration -------------------------------------------------------------


@dataclasses.dataclass
class BenchConfig:
    """Everything a run depends on; written beside its results."""

    models: tuple = ("cnn", "mlp")
    contenders: tuple = (
        "adam",
        "keras_accumulation",
        "gradient_accumulation",
        "invariant_adam",
        "update_accumulation_adam",
        "big_batch",
        "gradients_only",
    )
    settings: tuple = ("graph", "xla", "mirrored")
    steps: int = 8  # N: micro-batches per window.
    micro_batch: int = 32  # b: examples per micro-batch (global).
    windows: int = 1  # windows per train_function call: K = steps * windows.
    repeats: int = 11  # timed rounds per (setting, model).
    warmup: int = 2  # untimed calls after the warm-up fit.
    min_sample_seconds: float = 0.2  # a sample repeats calls to last this.
    rss: bool = True  # peak RSS per (model, contender) in subprocesses.
    timing: bool = True  # the timed groups (off: only memory / copies).
    xla_copies: bool = False  # count XLA copies per (model, contender).
    quick: bool = False  # tiny sizes: a smoke test, not a measurement.
    seed: int = 0

    def resolved(self):
        """The config with `quick` applied: what actually runs."""
        if not self.quick:
            return self
        return dataclasses.replace(
            self,
            steps=min(self.steps, 2),
            micro_batch=min(self.micro_batch, 8),
            windows=1,
            repeats=min(self.repeats, 2),
            warmup=1,
            min_sample_seconds=0.0,
        )


def _log(message):
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- models --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    build: object  # build(quick) -> uncompiled keras.Model returning logits
    input_shape: tuple
    num_classes: int


def mnist1d_cnn(quick=False):
    """The MNIST-1D CNN: 3 x Conv1D(25, 5, stride 2), Dense(10); 7,710 params."""
    del quick  # Already tiny.
    inputs = keras.Input((40,))
    x = keras.layers.Reshape((40, 1))(inputs)
    for _ in range(3):
        x = keras.layers.Conv1D(25, 5, strides=2, padding="same", activation="relu")(x)
    x = keras.layers.Flatten()(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x), name="cnn")


def wide_mlp(quick=False):
    """1024 -> 2048 -> 1024 -> 10 ReLU MLP: 4.21M params in 3 matmuls.

    Chosen so that the optimizer's passes over the parameters are not
    negligible: forward/backward costs about 6 x b x P flops, while an
    optimizer pass streams a few tens of bytes per parameter, the same order
    of time on a CPU at b = 32.
    """
    width = 64 if quick else 1024
    inputs = keras.Input((width,))
    x = keras.layers.Dense(2 * width, activation="relu")(inputs)
    x = keras.layers.Dense(width, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x), name="mlp")


MODELS = {
    "cnn": ModelSpec("cnn", "MNIST-1D CNN, 7,710 params", mnist1d_cnn, (40,), 10),
    "mlp": ModelSpec("mlp", "MLP 1024-2048-1024-10, 4.21M params", wide_mlp, (1024,), 10),
}


def _input_shape(spec, quick):
    if spec.name == "mlp" and quick:
        return (64,)
    return spec.input_shape


# -- contenders ----------------------------------------------------------------


class GradientsOnly(keras.optimizers.Optimizer):
    """Computes the gradients, reads each once and drops them: the
    forward/backward cost alone.

    The gradients must really be consumed. A mere control dependency on them
    is not enough: TensorFlow prunes the pure ops whose results nothing
    reads, and on the MLP (b = 32, graph mode) such a "gradients only" step
    ran in 3.3 ms against 10.4 ms for this one, i.e. most of the backward
    pass (the weight-gradient matmuls) was never run. Here every gradient
    is summed into a scalar variable: one read of each gradient (4 bytes per
    parameter), which any optimizer pays too.
    """

    def __init__(self, name="gradients_only"):
        super().__init__(learning_rate=0.0, name=name)

    def build(self, var_list):
        super().build(var_list)
        self._sink = self.add_variable((), name="sink")

    def apply(self, grads, trainable_variables=None):
        if not self.built:
            self.build(list(trainable_variables))
        self._sink.assign(
            tf.add_n([tf.reduce_sum(tf.cast(g, "float32")) for g in grads if g is not None])
        )
        self._iterations.assign_add(1)


@dataclasses.dataclass(frozen=True)
class Contender:
    """One way of training a model, timed per micro-batch of b examples.

    role: "ours" (a keras_accum optimizer), "keras" (Keras's built-in
    accumulation), "adam" (no accumulation), "big_batch" (Adam on N x b) or
    "gradients_only" (forward/backward alone).
    """

    name: str
    label: str
    role: str
    make_optimizer: object  # make_optimizer(steps) -> keras Optimizer
    batch_factor: str = "micro"  # "micro": b per step; "window": N x b.
    runner: object = None  # None: FitRunner.


CONTENDERS = {}


def register(contender):
    CONTENDERS[contender.name] = contender
    return contender


register(Contender("adam", "Adam (no accumulation)", "adam", lambda steps: keras.optimizers.Adam()))
register(
    Contender(
        "keras_accumulation",
        "Adam(gradient_accumulation_steps=N)",
        "keras",
        lambda steps: keras.optimizers.Adam(gradient_accumulation_steps=steps),
    )
)
register(
    Contender(
        "gradient_accumulation",
        "GradientAccumulation(Adam(), steps=N)",
        "ours",
        lambda steps: ka.GradientAccumulation(keras.optimizers.Adam(), steps=steps),
    )
)
register(
    Contender(
        "invariant_adam",
        "InvariantAdam(steps=N)",
        "ours",
        lambda steps: ka.InvariantAdam(steps=steps),
    )
)
register(
    Contender(
        "update_accumulation_adam",
        "UpdateAccumulationAdam(steps=N)",
        "ours",
        lambda steps: ka.UpdateAccumulationAdam(steps=steps),
    )
)
register(
    Contender(
        "big_batch",
        "Adam on one batch of N x b",
        "big_batch",
        lambda steps: keras.optimizers.Adam(),
        batch_factor="window",
    )
)
register(
    Contender(
        "gradients_only",
        "gradients computed then dropped",
        "gradients_only",
        lambda steps: GradientsOnly(),
    )
)
# Not run by default: the cost of the default non-finite check, by difference.
register(
    Contender(
        "gradient_accumulation_nocheck",
        "GradientAccumulation(Adam(), steps=N, nonfinite=None)",
        "ours",
        lambda steps: ka.GradientAccumulation(keras.optimizers.Adam(), steps=steps, nonfinite=None),
    )
)
register(
    Contender(
        "invariant_adam_nocheck",
        "InvariantAdam(steps=N, nonfinite=None)",
        "ours",
        lambda steps: ka.InvariantAdam(steps=steps, nonfinite=None),
    )
)

# Settings: name -> (jit_compile, replicas). "mirrored" runs in a subprocess.
SETTINGS = {
    "graph": (False, 1),
    "xla": (True, 1),
    "mirrored": (False, 2),
}


# -- one contender on one model --------------------------------------------------


def _tf_functions(fn, depth=0, seen=None):
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
            found += _tf_functions(value, depth + 1, seen)
    return found


def _bytes_per_parameter(optimizer, model):
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

    Interface a runner must offer: `micro_batches_per_call`, `call(calls)`
    -> (seconds, loss), `trace_count()` -> dict, `warmup_traces`,
    `bytes_per_param`, `params`.
    """

    def __init__(self, spec, contender, config, strategy, jit_compile):
        self.contender = contender
        self.config = config
        self.strategy = strategy
        self.traces = 0
        n, b = config.steps, config.micro_batch
        big = contender.batch_factor == "window"
        input_shape = _input_shape(spec, config.quick)
        rng = np.random.default_rng(config.seed)
        x = rng.standard_normal((n * b,) + input_shape).astype("float32")
        y = rng.integers(0, spec.num_classes, n * b).astype("int32")
        dataset = (
            tf.data.Dataset.from_tensor_slices((x, y))
            .batch(n * b if big else b, drop_remainder=True)
            .repeat()
        )
        # One `call` = K micro-batches (K / N big batches), counted in units
        # of b examples.
        self.micro_batches_per_call = n * config.windows
        steps_per_call = config.windows if big else n * config.windows
        if strategy.num_replicas_in_sync > 1:
            # Keras 3.15 fails under MirroredStrategy with
            # steps_per_execution > 1 ("You must feed a value for placeholder
            # tensor ... while/cond", even with plain SGD): one step per
            # execution, `steps_per_call` executions per call.
            steps_per_execution = 1
        else:
            steps_per_execution = steps_per_call
        self.executions_per_call = steps_per_call // steps_per_execution
        keras.utils.set_random_seed(config.seed)
        with strategy.scope():
            self.model = spec.build(config.quick)
            original = self.model.train_step

            def counted_train_step(data):
                self.traces += 1  # Python runs only while tracing.
                return original(data)

            self.model.train_step = counted_train_step
            self.model.compile(
                optimizer=contender.make_optimizer(n),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                jit_compile=jit_compile,
                steps_per_execution=steps_per_execution,
            )
        # Warm-up through the real `fit`: builds the optimizer, traces.
        self.model.fit(dataset, epochs=1, steps_per_epoch=steps_per_call, shuffle=False, verbose=0)
        self.iterator = iter(strategy.experimental_distribute_dataset(dataset))
        for _ in range(config.warmup):
            self.call(1)
        self.warmup_traces = self.trace_count()
        self.bytes_per_param, self.params = _bytes_per_parameter(self.model.optimizer, self.model)

    def call(self, calls):
        """Runs `calls` train-function calls; returns seconds and loss."""
        function = self.model.train_function
        start = time.perf_counter()
        for _ in range(calls * self.executions_per_call):
            logs = function(self.iterator)
        loss = float(logs["loss"])  # Waits for the last call to finish.
        return time.perf_counter() - start, loss

    def trace_count(self):
        functions = _tf_functions(self.model.train_function)
        return {
            "train_step": self.traces,
            "tf_functions": sum(f.experimental_get_tracing_count() for f in functions),
        }


# -- a group: every contender on one model in one setting ------------------------


def _quartiles(values):
    if len(values) == 1:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], statistics.median(values), q[2]


def run_group(model_name, setting, config):
    """Times every contender on one model in one setting, round-robin."""
    jit_compile, replicas = SETTINGS[setting]
    if replicas > 1:
        devices = [f"/cpu:{i}" for i in range(replicas)]
        strategy = tf.distribute.MirroredStrategy(devices)
    else:
        strategy = tf.distribute.get_strategy()
    spec = MODELS[model_name]
    runners, rows = {}, {}
    for name in config.contenders:
        contender = CONTENDERS[name]
        row = rows[name] = {
            "setting": setting,
            "model": model_name,
            "contender": name,
            "label": contender.label,
            "role": contender.role,
        }
        _log(f"{setting}/{model_name}: build + warm up {name}")
        try:
            runner_class = contender.runner or FitRunner
            runner = runner_class(spec, contender, config, strategy, jit_compile)
        except Exception as error:  # Recorded, not fatal: e.g. keras#20582.
            row["error"] = f"{type(error).__name__}: {error}".split("\n")[0][:300]
            _log(f"{setting}/{model_name}: {name} failed: {row['error']}")
            continue
        runners[name] = runner
        row.update(
            params=runner.params,
            bytes_per_param=runner.bytes_per_param,
            warmup_traces=runner.warmup_traces,
        )
    if not runners:
        return list(rows.values())
    # Calibrate: a sample lasts about min_sample_seconds for plain Adam (or
    # the first contender that ran); the same number of calls for everyone.
    reference = runners.get("adam") or next(iter(runners.values()))
    one_call = min(reference.call(1)[0] for _ in range(2))
    calls = max(1, math.ceil(config.min_sample_seconds / one_call))
    _log(
        f"{setting}/{model_name}: {calls} call(s) of "
        f"{reference.micro_batches_per_call} micro-batches per sample"
    )
    names = list(runners)
    for name in names:  # One untimed round: every contender warm.
        runners[name].call(calls)
    samples = {name: [] for name in runners}
    losses = {}
    for round_index in range(config.repeats):
        gc.collect()
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            runner = runners[name]
            seconds, loss = runner.call(calls)
            samples[name].append(seconds / (calls * runner.micro_batches_per_call))
            losses[name] = loss
        _log(
            f"{setting}/{model_name}: round {round_index + 1}/"
            f"{config.repeats}: "
            + ", ".join(f"{n} {1e3 * samples[n][-1]:.3f}" for n in names)
            + " ms"
        )
    for name, runner in runners.items():
        traces = runner.trace_count()
        rows[name].update(
            seconds_per_micro_batch=statistics.median(samples[name]),
            examples_per_second=config.micro_batch / statistics.median(samples[name]),
            samples=samples[name],
            calls_per_sample=calls,
            micro_batches_per_call=runner.micro_batches_per_call,
            final_loss=losses[name],
            traces=traces,
            retraces=traces["train_step"]
            - runner.warmup_traces["train_step"]
            + traces["tf_functions"]
            - runner.warmup_traces["tf_functions"],
        )
    _add_ratios(rows, samples, config.steps)
    return list(rows.values())


def _add_ratios(rows, samples, steps):
    """Per-round ratios against the references, summarised by quartiles."""

    def ratio(name, reference):
        if reference is None:
            return None
        pairs = [a / r for a, r in zip(samples[name], reference)]
        return dict(zip(("q25", "median", "q75"), _quartiles(pairs)))

    by_role = {rows[n]["role"]: n for n in samples}
    keras_times = samples.get(by_role.get("keras"))
    adam_times = samples.get(by_role.get("adam"))
    big_times = samples.get(by_role.get("big_batch"))
    grads_times = samples.get(by_role.get("gradients_only"))
    limit = None
    if adam_times and grads_times:
        # N forward/backward passes plus one Adam update, per micro-batch.
        limit = [g + (a - g) / steps for g, a in zip(grads_times, adam_times)]
    for name in samples:
        rows[name]["ratios"] = {
            "vs_keras_accumulation": ratio(name, keras_times),
            "vs_adam": ratio(name, adam_times),
            "vs_big_batch": ratio(name, big_times),
            "vs_limit": ratio(name, limit),
        }


# -- peak memory, one subprocess per configuration -------------------------------


def _memory_mb():
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


def measure_rss(model_name, contender_name, config):
    """In a fresh process: RSS once TensorFlow, the model and the data are
    up (baseline), and the peak after warm-up and a few training calls."""
    spec = MODELS[model_name]
    keras.utils.set_random_seed(config.seed)
    spec.build(config.quick)(np.zeros((1,) + _input_shape(spec, config.quick), "float32"))
    baseline, _ = _memory_mb()
    runner = FitRunner(
        spec, CONTENDERS[contender_name], config, tf.distribute.get_strategy(), jit_compile=False
    )
    runner.call(2)
    _, peak = _memory_mb()
    return {"baseline_mb": baseline, "peak_mb": peak, "bytes_per_param": runner.bytes_per_param}


def measure_xla_copies(model_name, contender_name, config, dump_dir):
    """Compiles one contender's step with XLA (in a child whose XLA_FLAGS
    dump the optimised HLO to `dump_dir`) and counts the elements its `copy`
    instructions move, per trainable parameter.

    Copies in the entry computation run every micro-step; those inside a
    conditional's branches run when the branch is taken (a window's end, or
    every step for a non-finite check that passes); "other" are copies in
    fusions and loop bodies (layout changes of activations, mostly). A fused
    in-place update needs none; each parameter-sized copy reads and writes 8
    bytes per parameter.
    """
    import glob
    import re

    spec = MODELS[model_name]
    runner = FitRunner(
        spec, CONTENDERS[contender_name], config, tf.distribute.get_strategy(), jit_compile=True
    )
    files = sorted(
        f for f in glob.glob(os.path.join(dump_dir, "*one_step_on_data*after_optimizations.txt"))
    )
    if not files:
        raise RuntimeError(f"No optimised HLO dumped under {dump_dir}.")
    counts = {"entry": 0, "branches": 0, "other": 0}
    where = None
    shape = re.compile(r"= f32\[([\d,]*)\]\S* copy\(")
    with open(files[-1]) as f:
        for line in f:
            if line.endswith("{\n") and not line.startswith(" "):
                name = line.split(" ", 1)[0]
                if line.startswith("ENTRY"):
                    where = "entry"
                elif "_cond" in name or "cond_" in name:
                    where = "branches"  # tf.cond branches keep their names.
                else:
                    where = "other"  # fusions, loop bodies, ...
            match = shape.search(line)
            if match and where:
                dims = [int(d) for d in match.group(1).split(",") if d]
                counts[where] += int(np.prod(dims)) if dims else 1
    return {key: value / runner.params for key, value in counts.items()}


def _run_worker(task, config, timeout=3600, env_extra=None):
    """Runs `_worker` in a fresh Python; returns its JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        task = dict(task, tmp=tmp)
        payload = json.dumps({"task": task, "config": dataclasses.asdict(config), "out": out})
        env = dict(os.environ)
        if task["kind"] == "xla_copies":
            # Read by XLA when it first compiles, in the child.
            env["XLA_FLAGS"] = f"--xla_dump_to={tmp}/hlo --xla_dump_hlo_as_text"
        env.update(env_extra or {})
        package_root = os.path.dirname(os.path.dirname(ka.__file__))
        env["PYTHONPATH"] = os.pathsep.join(
            [package_root] + [p for p in [env.get("PYTHONPATH")] if p]
        )
        proc = subprocess.run(
            [sys.executable, "-m", "keras_accum.experiments.bench", payload],
            env=env,
            timeout=timeout,
            stdout=subprocess.PIPE,
            text=True,
        )
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"bench worker {task} failed with code {proc.returncode}")
        with open(out) as f:
            return json.load(f)


def _worker(payload):
    """Subprocess entry: configures devices first, then runs one task."""
    payload = json.loads(payload)
    task = payload["task"]
    known = {field.name for field in dataclasses.fields(BenchConfig)}
    config = BenchConfig(
        **{
            k: tuple(v) if isinstance(v, list) else v
            for k, v in payload["config"].items()
            if k in known
        }
    )
    if task["kind"] == "group":
        replicas = SETTINGS[task["setting"]][1]
        # Logical CPUs must be configured before TensorFlow initialises.
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * replicas
        )
        result = run_group(task["model"], task["setting"], config)
    elif task["kind"] == "xla_copies":
        result = measure_xla_copies(
            task["model"], task["contender"], config, os.path.join(task["tmp"], "hlo")
        )
    else:
        result = measure_rss(task["model"], task["contender"], config)
    with open(payload["out"], "w") as f:
        json.dump(result, f)


# -- cost model ----------------------------------------------------------------

# Bytes moved per parameter (float32) per micro-step, read off the code in
# graph mode with N = steps, one replica, the default non-finite check.
# Each entry: (first micro-step of a window, other micro-steps, extra at the
# window's last micro-step). "fused": each tensor read or written once per
# micro-step (what an ideal kernel, or XLA without copies, would move).
# "ops": every TensorFlow op reads its inputs and writes its output in full
# (graph mode, no fusion): add/sub/mul/div of two tensors 12, of a tensor and
# a scalar 8, square/sqrt 8, assign 8, assign_add/assign_sub 12, the
# finiteness check (is_finite + reduce_all) 4 + 1 + 1 = 6. BENCHMARKS.md
# derives each line.
COST_MODEL = {
    # m += (g-m)(1-b1); v += (g^2-v)(1-b2); theta -= m alpha/(sqrt v + eps)
    "adam": {"fused": (28, 28, 0), "ops": (120, 120, 0)},
    # acc = g + acc; boundary: (g + acc)/N, Adam, acc = zeros.
    "keras_accumulation": {"fused": (12, 12, 24), "ops": (20, 20, 152 - 20)},
    # check; acc = g (first) or acc += g; boundary: acc / W, inner Adam.
    "gradient_accumulation": {"fused": (8, 12, 28), "ops": (14, 18, 128)},
    "gradient_accumulation_nocheck": {"fused": (8, 12, 28), "ops": (8, 12, 128)},
    # check; g/N, g^2, g^2/N; m, v folded (first: Keras form, else +=);
    # boundary: theta -= alpha m / (sqrt v + eps).
    "invariant_adam": {"fused": (20, 20, 16), "ops": (94, 70, 48)},
    "invariant_adam_nocheck": {"fused": (20, 20, 16), "ops": (88, 64, 48)},
    # check; Adam moments; step = alpha m/(sqrt v + eps); A = step or
    # A += step; boundary: theta -= A.
    "update_accumulation_adam": {"fused": (24, 28, 12), "ops": (122, 126, 12)},
    # One Adam update per N micro-batches' worth of examples.
    "big_batch": {"fused": (0, 0, 28), "ops": (0, 0, 120)},
    # sum(g) into a scalar: one read of g.
    "gradients_only": {"fused": (4, 4, 0), "ops": (4, 4, 0)},
}


def modelled_bytes(contender, steps, kind):
    """Bytes per parameter per micro-step, averaged over a window."""
    entry = COST_MODEL.get(contender)
    if entry is None:
        return None
    first, other, boundary = entry[kind]
    if steps == 1:
        return first + boundary
    return (first + other * (steps - 1) + boundary) / steps


# -- targets and outputs ---------------------------------------------------------

LIMIT_TOLERANCE = 1.05


def evaluate_targets(result):
    """The targets of BENCHMARKS.md, each met (True), missed (False) or not
    measurable (None, with the reason)."""
    rows = result["rows"]
    targets = []

    def ratio(row, key):
        value = (row.get("ratios") or {}).get(key)
        return None if value is None else value["median"]

    def add(name, row, value, threshold, met, note=""):
        targets.append(
            {
                "target": name,
                "setting": row["setting"],
                "model": row["model"],
                "contender": row["contender"],
                "value": value,
                "threshold": threshold,
                "met": met,
                "note": note,
            }
        )

    for row in rows:
        name = row["contender"]
        keras_row = next(
            (
                r
                for r in rows
                if r["role"] == "keras"
                and r["setting"] == row["setting"]
                and r["model"] == row["model"]
            ),
            None,
        )
        keras_error = (keras_row or {}).get("error", "not run")
        if name in ("gradient_accumulation", "invariant_adam"):
            value = ratio(row, "vs_keras_accumulation")
            add(
                f"{name} / Keras accumulation <= 1.00",
                row,
                value,
                1.0,
                None if value is None else value <= 1.0,
                ""
                if value is not None
                else row.get("error") or f"Keras accumulation: {keras_error}",
            )
        if name == "invariant_adam" and "bytes_per_param" in row:
            value = row["bytes_per_param"]
            add(
                "invariant_adam optimizer bytes / param == 8 (2 float32 slots)",
                row,
                value,
                8.0,
                value == 8.0,
            )
        if row["role"] == "ours":
            value = ratio(row, "vs_limit")
            add(
                f"{name} / limit <= {LIMIT_TOLERANCE:.2f}",
                row,
                value,
                LIMIT_TOLERANCE,
                None if value is None else value <= LIMIT_TOLERANCE,
                row.get("error", ""),
            )
    groups = {}
    for row in rows:
        if "retraces" in row:
            groups.setdefault((row["setting"], row["model"]), []).append(row)
    for group in groups.values():
        value = sum(row["retraces"] for row in group)
        add(
            "no retracing after warm-up (all contenders)",
            dict(group[0], contender="all"),
            value,
            0,
            value == 0,
        )
    return targets


def _fmt_ratio(value):
    if value is None:
        return "-"
    return f"{value['median']:.2f} ({value['q25']:.2f}-{value['q75']:.2f})"


RATIO_COLUMNS = (
    "setting",
    "model",
    "optimizer",
    "ms / micro-batch",
    "examples/s",
    "vs Keras accumulation",
    "vs Adam",
    "vs big batch",
    "vs limit",
    "retraces",
)
MEMORY_COLUMNS = (
    "model",
    "optimizer",
    "optimizer bytes / param",
    "float32 slots",
    "peak RSS MB",
    "RSS over baseline MB",
)
COST_COLUMNS = (
    "optimizer",
    "modelled bytes/param/micro-step, fused",
    "modelled bytes/param/micro-step, TF ops",
    "measured ns/param/micro-step beyond gradients_only",
    "implied GB/s (TF ops beyond gradients_only)",
)
TARGET_COLUMNS = ("target", "setting", "model", "measured", "met")
COPY_COLUMNS = (
    "model",
    "optimizer",
    "copied elements / params: every step (entry)",
    "in conditional branches",
    "elsewhere (fusions, loops)",
)


def _table(columns, lines):
    out = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    out += ["| " + " | ".join(str(c) for c in line) + " |" for line in lines]
    return "\n".join(out)


def cost_rows(result, setting="graph"):
    """Modelled bytes beside the measured optimizer time, per model in
    `setting`: optimizer time = t(contender) - t(gradients_only)."""
    steps = result["config"]["steps"]
    lines = []
    for model in result["config"]["models"]:
        rows = {
            r["contender"]: r
            for r in result["rows"]
            if r["setting"] == setting and r["model"] == model and "seconds_per_micro_batch" in r
        }
        base = rows.get("gradients_only")
        base_ops = modelled_bytes("gradients_only", steps, "ops")
        for name, row in rows.items():
            if row["role"] in ("big_batch", "gradients_only"):
                continue  # Not an optimizer pass per micro-batch.
            fused = modelled_bytes(name, steps, "fused")
            ops = modelled_bytes(name, steps, "ops")
            measured = implied = None
            if base is not None:
                pairs = [a - g for a, g in zip(row["samples"], base["samples"])]
                seconds = statistics.median(pairs)
                measured = 1e9 * seconds / row["params"]
                if ops and seconds > 0:
                    # gradients_only already reads g once: compare the rest.
                    implied = (ops - base_ops) * row["params"] / seconds / 1e9
            lines.append(
                {
                    "model": model,
                    "contender": name,
                    "fused": fused,
                    "ops": ops,
                    "ns_per_param": measured,
                    "implied_gb_s": implied,
                }
            )
    return lines


def markdown(result, command=None):
    """The Markdown report of a run: machine, command, tables."""
    machine = result["machine"]
    config = result["config"]
    parts = [
        "### Machine",
        "",
        f"* `nproc`: {machine['nproc']}; CPU: {machine['cpu']}",
        f"* TensorFlow {machine['tensorflow']}, Keras {machine['keras']}, "
        f"Python {machine['python']}, keras_accum {machine['keras_accum']}",
        f"* {machine['platform']}",
        f"* wall time of the run: {result['seconds']:.0f} s",
        "",
    ]
    if command:
        parts += ["### Command", "", "```", command, "```", ""]
    if not result["rows"]:
        parts += _copies_section(result)
        return "\n".join(parts)
    parts += [
        f"N = {config['steps']} micro-batches per window, b = "
        f"{config['micro_batch']} examples per micro-batch, "
        f"{config['repeats']} rounds; ratios are medians of per-round "
        "ratios (quartiles in brackets); < 1 means faster.",
        "",
        "### Time per micro-batch and ratios",
        "",
    ]
    lines = []
    for row in result["rows"]:
        if "error" in row:
            lines.append(
                [
                    row["setting"],
                    row["model"],
                    row["contender"],
                    "failed: " + row["error"].replace("|", "/")[:120],
                ]
                + ["-"] * (len(RATIO_COLUMNS) - 4)
            )
            continue
        r = row["ratios"]
        lines.append(
            [
                row["setting"],
                row["model"],
                row["contender"],
                f"{1e3 * row['seconds_per_micro_batch']:.3f}",
                f"{row['examples_per_second']:.0f}",
                _fmt_ratio(r["vs_keras_accumulation"]),
                _fmt_ratio(r["vs_adam"]),
                _fmt_ratio(r["vs_big_batch"]),
                _fmt_ratio(r["vs_limit"]),
                row["retraces"],
            ]
        )
    parts += [_table(RATIO_COLUMNS, lines), "", "### Targets", ""]
    lines = []
    for t in result["targets"]:
        value = t["value"]
        shown = (
            "-" if value is None else (f"{value:.3f}" if isinstance(value, float) else str(value))
        )
        met = {True: "met", False: "**missed**", None: "n/a"}[t["met"]]
        if t["note"]:
            met += " (" + t["note"].replace("|", "/")[:80] + ")"
        lines.append([t["target"].replace("|", "/"), t["setting"], t["model"], shown, met])
    parts += [_table(TARGET_COLUMNS, lines), "", "### Memory", ""]
    lines = []
    for row in result["rows"]:
        if row["setting"] != "graph" or "bytes_per_param" not in row:
            continue
        rss = row.get("rss") or {}
        peak = rss.get("peak_mb")
        lines.append(
            [
                row["model"],
                row["contender"],
                f"{row['bytes_per_param']:.2f}",
                f"{row['bytes_per_param'] / 4:.2f}",
                "-" if peak is None else f"{peak:.0f}",
                "-" if peak is None else f"{peak - rss['baseline_mb']:.0f}",
            ]
        )
    parts += [
        _table(MEMORY_COLUMNS, lines),
        "",
        "### Cost model beside the measurement (graph mode)",
        "",
    ]
    lines = []
    for c in cost_rows(result):

        def num(v, fmt):
            return "-" if v is None else format(v, fmt)

        lines.append(
            [
                f"{c['model']}: {c['contender']}",
                num(c["fused"], ".1f"),
                num(c["ops"], ".1f"),
                num(c["ns_per_param"], ".2f"),
                num(c["implied_gb_s"], ".1f"),
            ]
        )
    parts += [_table(COST_COLUMNS, lines), ""]
    parts += _copies_section(result)
    return "\n".join(parts)


def _copies_section(result):
    if not result.get("xla_copies"):
        return []
    lines = []
    for c in result["xla_copies"]:
        if "error" in c:
            lines.append([c["model"], c["contender"], "failed", "-", "-"])
            continue
        lines.append(
            [
                c["model"],
                c["contender"],
                f"{c['entry']:.2f}",
                f"{c['branches']:.2f}",
                f"{c.get('other', 0):.2f}",
            ]
        )
    return [
        "### XLA copies in the compiled step (elements / parameters)",
        "",
        _table(COPY_COLUMNS, lines),
        "",
    ]


def write_outputs(result, directory, command=None):
    """Writes results.md, results.json, samples.csv and config.json."""
    import csv

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "results.md"), "w") as f:
        f.write(markdown(result, command))
    with open(os.path.join(directory, "results.json"), "w") as f:
        json.dump(dict(result, command=command), f, indent=1)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"command": command, "config": result["config"]}, f, indent=1)
    with open(os.path.join(directory, "samples.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["setting", "model", "contender", "round", "seconds_per_micro_batch"])
        for row in result["rows"]:
            for i, value in enumerate(row.get("samples", ())):
                writer.writerow([row["setting"], row["model"], row["contender"], i, value])


def splice_markdown(path, section, text):
    """Replaces the text between `<!-- bench:SECTION -->` and
    `<!-- /bench:SECTION -->` in `path` (BENCHMARKS.md) with `text`, so that
    the numbers there are the script's output, never edited by hand."""
    begin, end = f"<!-- bench:{section} -->", f"<!-- /bench:{section} -->"
    with open(path) as f:
        content = f.read()
    if begin not in content or end not in content:
        raise ValueError(f"{path} has no {begin} ... {end} section.")
    head, rest = content.split(begin, 1)
    _, tail = rest.split(end, 1)
    with open(path, "w") as f:
        f.write(f"{head}{begin}\n{text.strip()}\n{end}{tail}")


# -- the whole run -----------------------------------------------------------------


def machine_info():
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "keras_accum": ka.__version__,
        "platform": platform.platform(),
    }


def run(config=None):
    """Runs the benchmark; returns {"config", "machine", "rows", ...}."""
    config = (config or BenchConfig()).resolved()
    for name in config.contenders:
        if name not in CONTENDERS:
            raise ValueError(f"Unknown contender {name!r}. Known: {', '.join(CONTENDERS)}")
    for name in config.models:
        if name not in MODELS:
            raise ValueError(f"Unknown model {name!r}. Known: {', '.join(MODELS)}")
    for name in config.settings:
        if name not in SETTINGS:
            raise ValueError(f"Unknown setting {name!r}. Known: {', '.join(SETTINGS)}")
    started = time.time()
    rows = []
    for setting in config.settings if config.timing else ():
        for model_name in config.models:
            _log(f"== {setting} / {model_name}")
            if SETTINGS[setting][1] > 1:
                task = {"kind": "group", "setting": setting, "model": model_name}
                rows += _run_worker(task, config)
            else:
                rows += run_group(model_name, setting, config)
    rss = {}
    if config.rss:
        for found in _per_contender("rss", "peak RSS", config):
            rss[f"{found['model']}/{found['contender']}"] = found["result"]
    for row in rows:
        if row["setting"] == "graph":
            row["rss"] = rss.get(f"{row['model']}/{row['contender']}")
    copies = []
    if config.xla_copies:
        copies = [
            dict(found["result"], model=found["model"], contender=found["contender"])
            for found in _per_contender("xla_copies", "XLA copies", config)
        ]
    result = {
        "config": dataclasses.asdict(config),
        "machine": machine_info(),
        "rows": rows,
        "xla_copies": copies,
        "seconds": time.time() - started,
    }
    result["targets"] = evaluate_targets(result)
    return result


def _per_contender(kind, label, config):
    """Runs task `kind` in a fresh subprocess per (model, contender); a
    failure is recorded as {"error": ...} instead of stopping the run."""
    for model_name in config.models:
        for name in config.contenders:
            _log(f"{label}: {model_name} / {name} (subprocess)")
            task = {"kind": kind, "model": model_name, "contender": name}
            try:
                result = _run_worker(task, config)
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                result = {"error": str(error)}
            yield {"model": model_name, "contender": name, "result": result}


if __name__ == "__main__":
    _worker(sys.argv[1])
