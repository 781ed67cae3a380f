"""Times and sizes the accumulating optimizers on any Keras backend, in `model.fit`.

Five arms, each `model.compile(optimizer=...)` + `model.fit` as Keras runs
it on the backend (same inner `Adam(1e-3)`, 4 micro-batches a window,
micro-batch size B):

    keras_gas    keras.optimizers.Adam(1e-3, gradient_accumulation_steps=4)
    grad_accum   keras_accum.GradientAccumulation(Adam(1e-3), steps=4)
    update_adam  keras_accum.UpdateAccumulationAdam(1e-3, steps=4)
    invariant    keras_accum.InvariantAdam(1e-3, steps=4)
    plain_adam   keras.optimizers.Adam(1e-3)  (reference, no accumulation)

The backend is Keras's own choice: set `KERAS_BACKEND` (jax, torch or
tensorflow; unset, Keras reads ~/.keras/keras.json, else TensorFlow). Every
model (mlp, cnn, transformer, lm) runs on all three. The device is the
backend's default one: a GPU where the backend sees one, else the CPU.

    KERAS_BACKEND=torch python scripts/backend_bench.py --rounds=3 \\
        --models=mlp,cnn --output=runs/backend_bench_torch

Smoke test (tiny sizes, numbers meaningless; about a minute a model on a
busy 2-core machine, most of it the memory probes' imports: `--nomemory`
skips them):

    KERAS_BACKEND=jax python scripts/backend_bench.py --quick --models=mlp \\
        --output=/tmp/backend_bench_quick

On a shared CPU machine pin it to a quiet core (`taskset -c 0 python ...`)
and keep the other cores quiet: ratios taken moments apart stand a busy
neighbour, absolute times don't.

Time: one untimed `fit` per arm (compiles on JAX and TensorFlow), then per
round every arm runs one `fit` over the same fixed numpy data
(`--micro_batches` micro-batches of B, no shuffling), the arms' order
rotated by one each round. A timer stops once the device is done: JAX
blocks until the weights are ready, PyTorch calls `torch.cuda.synchronize()`
where CUDA is available, TensorFlow `tf.test.experimental.sync_devices()`
where it sees a GPU (on the CPU `fit` returns when the work is done).
Reported per arm: the median over rounds of its ms per micro-batch, and the
median (min-max) over rounds of its time over `keras_gas`'s (Keras's own
accumulation) and over `plain_adam`'s, each taken within the round (the
pooled side-by-side method: a ratio compares arms timed moments apart).

Memory, every backend: the parameter bytes and the optimizer-state bytes
(`optimizer.variables`), and, with `--memory` (the default), each arm in a
fresh process of its own, compiled and fitted twice (the first `fit`
compiles the step on JAX and TensorFlow and allocates the optimizer's
state): the process's peak RSS (`resource.getrusage`: the backend's import
and compiling included), the fit RSS growth (the RSS high-water mark over
the second `fit` less the RSS before it, the high-water mark reset through
/proc/self/clear_refs; Linux only, else n/a; Linux's RSS counters lag by up
to 64 pages a thread, so differences of a MiB or less are noise) and, on a
GPU, the backend's own peak device bytes (`torch.cuda.max_memory_allocated`
and TensorFlow's `get_memory_info` peak over the second `fit`, JAX's
`peak_bytes_in_use` since the process started). On the CPU neither PyTorch
nor TensorFlow accounts its allocations, so RSS stands alone there. JAX
also keeps XLA's `memory_analysis()` of Keras's own jitted train step (the
`jax.jit(train_step, donate_argnums=0)` inside `model.train_function`;
re-jitted the same way where it cannot be found) lowered with the trainer's
state tuple and one micro-batch: temp, argument, output and alias bytes, so
that a temp size holding parameter-sized copies beyond the optimizer's own
state shows. The script sets XLA_PYTHON_CLIENT_PREALLOCATE=false and
TF_FORCE_GPU_ALLOW_GROWTH=true (unless set) so that on a GPU the probes
find the device free beside the timing process.

Output: the markdown table on stdout and, with `--output=DIR`, DIR/results.md
and DIR/results.json (raw per-round numbers, the device's name and the
library versions).
"""

import json
import os
import pathlib
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# On a GPU the memory probes run beside this process: neither JAX nor
# TensorFlow may take the whole device up front (each allocates as it needs).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
# Use the package of this checkout, whatever else is installed.
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mlp", "cnn", "transformer", "lm"], "Models to run, in order.")
flags.DEFINE_integer("rounds", 5, "Timed rounds; each runs every arm once.")
flags.DEFINE_integer(
    "micro_batches", None, "Micro-batches per timed fit (default 64; 8 with --quick)."
)
flags.DEFINE_integer("batch_size", None, "Micro-batch size B (default: the model's own).")
flags.DEFINE_integer("steps", 4, "Micro-batches per accumulation window.")
flags.DEFINE_bool("quick", False, "Tiny models and data: a smoke test, numbers meaningless.")
flags.DEFINE_bool(
    "memory",
    True,
    "Measure memory: a fresh process per arm (peak RSS, GPU peak) and, on JAX, "
    "XLA's memory_analysis() of the compiled step.",
)
flags.DEFINE_string("output", None, "Directory for results.md and results.json.")
flags.DEFINE_integer("seed", 0, "Seed of the data and the shared initial weights.")
flags.DEFINE_string("probe", None, "Internal: MODEL:ARM, print one arm's memory as JSON.")

ARMS = ("keras_gas", "grad_accum", "update_adam", "invariant", "plain_adam")
BASE_ARMS = ("keras_gas", "plain_adam")  # the ratios' denominators
BACKENDS = ("jax", "torch", "tensorflow")
LR = 1e-3
PROBE_PREFIX = "PROBE_JSON="


def make_optimizer(arm, steps):
    import keras

    import keras_accum as ka

    if arm == "keras_gas":
        return keras.optimizers.Adam(LR, gradient_accumulation_steps=steps)
    if arm == "grad_accum":
        return ka.GradientAccumulation(keras.optimizers.Adam(LR), steps=steps)
    if arm == "update_adam":
        return ka.UpdateAccumulationAdam(LR, steps=steps)
    if arm == "invariant":
        return ka.InvariantAdam(LR, steps=steps)
    if arm == "plain_adam":
        return keras.optimizers.Adam(LR)
    raise ValueError(f"`arm` must be one of {ARMS}. Received: arm={arm!r}")


# -- models --------------------------------------------------------------------


def _sizes(name, quick):
    """Hyper-parameters of each model (full and --quick)."""
    full = {
        "mlp": dict(batch=32, hidden=1024, inputs=784, classes=10),
        "cnn": dict(batch=32, filters=(16, 32), dense=64, classes=10),
        "transformer": dict(batch=16, vocab=1000, seq=64, d=128, heads=4, ffn=256, blocks=2),
        "lm": dict(batch=16, vocab=256, seq=64, d=128, heads=4, ffn=256, blocks=2),
    }
    tiny = {
        "mlp": dict(batch=8, hidden=32, inputs=784, classes=10),
        "cnn": dict(batch=8, filters=(4, 8), dense=16, classes=10),
        "transformer": dict(batch=4, vocab=50, seq=8, d=16, heads=2, ffn=32, blocks=1),
        "lm": dict(batch=4, vocab=32, seq=8, d=16, heads=2, ffn=32, blocks=1),
    }
    table = tiny if quick else full
    if name not in table:
        raise ValueError(f"`models` must name models of {sorted(table)}. Received: {name!r}")
    return dict(table[name])


def _position_embedding_layer():
    import keras

    class PositionEmbedding(keras.layers.Layer):
        """Adds a learned (seq, d) position embedding."""

        def build(self, input_shape):
            self.table = self.add_weight(
                shape=tuple(input_shape[1:]), initializer="glorot_uniform", name="table"
            )

        def call(self, x):
            return x + self.table

    return PositionEmbedding


def _encoder_block(x, s, causal, index):
    from keras import layers

    h = layers.LayerNormalization(name=f"ln_a{index}")(x)
    h = layers.MultiHeadAttention(s["heads"], s["d"] // s["heads"], name=f"mha{index}")(
        h, h, use_causal_mask=causal
    )
    x = layers.Add()([x, h])
    h = layers.LayerNormalization(name=f"ln_b{index}")(x)
    h = layers.Dense(s["ffn"], activation="gelu", name=f"ffn_in{index}")(h)
    h = layers.Dense(s["d"], name=f"ffn_out{index}")(h)
    return layers.Add()([x, h])


def build_model(name, s):
    """A fresh, uncompiled Keras model."""
    import keras
    from keras import layers

    if name == "mlp":
        inputs = keras.Input((s["inputs"],))
        x = layers.Dense(s["hidden"], activation="relu")(inputs)
        x = layers.Dense(s["hidden"], activation="relu")(x)
        outputs = layers.Dense(s["classes"])(x)
    elif name == "cnn":
        inputs = keras.Input((28, 28, 1))
        x = layers.Conv2D(s["filters"][0], 3, activation="relu")(inputs)
        x = layers.Conv2D(s["filters"][1], 3, activation="relu")(x)
        x = layers.MaxPooling2D(2)(x)
        x = layers.Flatten()(x)
        x = layers.Dense(s["dense"], activation="relu")(x)
        outputs = layers.Dense(s["classes"])(x)
    elif name in ("transformer", "lm"):
        causal = name == "lm"
        inputs = keras.Input((s["seq"],), dtype="int32")
        x = layers.Embedding(s["vocab"], s["d"])(inputs)
        x = _position_embedding_layer()()(x)
        for i in range(s["blocks"]):
            x = _encoder_block(x, s, causal, i)
        x = layers.LayerNormalization()(x)
        if causal:
            outputs = layers.Dense(s["vocab"])(x)  # logits per token
        else:
            x = layers.GlobalAveragePooling1D()(x)
            outputs = layers.Dense(10)(x)
    else:
        raise ValueError(f"Unknown model {name!r}.")
    return keras.Model(inputs, outputs, name=name)


def make_data(name, s, count, seed):
    """Fixed numpy (x, y) of `count` samples."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if name == "mlp":
        x = rng.normal(size=(count, s["inputs"])).astype("float32")
        y = rng.integers(0, s["classes"], size=(count,)).astype("int32")
    elif name == "cnn":
        x = rng.normal(size=(count, 28, 28, 1)).astype("float32")
        y = rng.integers(0, s["classes"], size=(count,)).astype("int32")
    elif name == "transformer":
        x = rng.integers(0, s["vocab"], size=(count, s["seq"])).astype("int32")
        y = rng.integers(0, 10, size=(count,)).astype("int32")
    else:  # lm: next-token targets
        tokens = rng.integers(0, s["vocab"], size=(count, s["seq"] + 1)).astype("int32")
        x, y = tokens[:, :-1], tokens[:, 1:]
    return x, y


# -- the backend ---------------------------------------------------------------


def _backend():
    import keras

    return keras.backend.backend()


def _torch_cuda():
    import torch

    return torch.cuda.is_available()


def _tf_gpus():
    import tensorflow as tf

    return tf.config.list_physical_devices("GPU")


def wait_for_device(model):
    """Returns once the device has finished the work queued so far."""
    backend = _backend()
    if backend == "jax":
        import jax

        jax.block_until_ready([v.value for v in model.trainable_variables])
    elif backend == "torch":
        if _torch_cuda():
            import torch

            torch.cuda.synchronize()
    elif backend == "tensorflow":
        if _tf_gpus():
            import tensorflow as tf

            tf.test.experimental.sync_devices()


def _cpu_model():
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info():
    """The device the backend runs on, and the machine's CPU."""
    backend = _backend()
    info = {
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else None,
    }
    if backend == "jax":
        import jax

        device = jax.devices()[0]
        info.update(platform=device.platform, name=str(device.device_kind))
        info["device_count"] = jax.device_count()
    elif backend == "torch":
        import torch

        cuda = _torch_cuda()
        info.update(
            platform="gpu" if cuda else "cpu",
            name=torch.cuda.get_device_name(0) if cuda else info["cpu_model"],
            device_count=torch.cuda.device_count() if cuda else 1,
            torch_threads=torch.get_num_threads(),
        )
    else:
        import tensorflow as tf

        gpus = _tf_gpus()
        name = info["cpu_model"]
        if gpus:
            details = tf.config.experimental.get_device_details(gpus[0])
            name = details.get("device_name", gpus[0].name)
        info.update(platform="gpu" if gpus else "cpu", name=name, device_count=len(gpus) or 1)
    if info["platform"] == "cpu":
        info["name"] = info["cpu_model"]
    return info


def library_versions():
    import keras
    import numpy as np

    import keras_accum

    versions = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "keras": keras.__version__,
        "keras_accum": getattr(keras_accum, "__version__", None),
    }
    backend = _backend()
    if backend == "jax":
        import jax
        import jaxlib

        versions.update(
            jax=jax.__version__,
            jaxlib=jaxlib.__version__,
            jax_platform_version=str(jax.devices()[0].client.platform_version),
        )
    elif backend == "torch":
        import torch

        versions.update(torch=torch.__version__, torch_cuda_build=torch.version.cuda)
    else:
        import tensorflow as tf

        versions["tensorflow"] = tf.__version__
        build = tf.sysconfig.get_build_info()
        cuda = build.get("cuda_version") if build.get("is_cuda_build") else None
        versions["tensorflow_cuda_build"] = cuda
    return versions


def git_commit():
    """The checkout's commit and whether its tree differs from it, or None."""
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return {"commit": head, "modified": bool(dirty)}


# -- one arm -------------------------------------------------------------------


def _nbytes(variables):
    import numpy as np

    return int(sum(int(np.prod(v.shape)) * np.dtype(str(v.dtype)).itemsize for v in variables))


def compiled_model(name, s, arm, steps, weights):
    import keras

    model = build_model(name, s)
    if weights is not None:
        model.set_weights(weights)
    model.compile(
        optimizer=make_optimizer(arm, steps),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def run_fit(model, x, y, batch):
    """One `fit` epoch, waited for on the device; seconds."""
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    wait_for_device(model)
    return time.perf_counter() - start


def _find_jitted(function, seen=None):
    """The jax.jit-wrapped step inside Keras's `train_function` closure."""
    seen = set() if seen is None else seen
    if id(function) in seen:
        return None
    seen.add(id(function))
    if hasattr(function, "lower") and callable(function.lower):
        return function
    for cell in getattr(function, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if callable(value):
            found = _find_jitted(value, seen)
            if found is not None:
                return found
    return None


def xla_memory_analysis(model, x, y, batch):
    """JAX: XLA's memory analysis of the compiled train step."""
    import jax

    model.make_train_function()
    jitted = _find_jitted(model.train_function)
    source = "keras train_function"
    if jitted is None:
        jitted = jax.jit(model.train_step, donate_argnums=0)
        source = "jax.jit(model.train_step, donate_argnums=0)"
    state = model._get_jax_state(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
    )
    data = (x[:batch], y[:batch])
    try:
        stats = jitted.lower(state, data).compile().memory_analysis()
    except Exception as e:  # memory_analysis is platform-dependent
        return {"available": False, "error": f"{type(e).__name__}: {e}"}
    if stats is None:
        return {"available": False, "error": "memory_analysis() returned None"}
    return {
        "available": True,
        "source": source,
        "temp_bytes": int(stats.temp_size_in_bytes),
        "argument_bytes": int(stats.argument_size_in_bytes),
        "output_bytes": int(stats.output_size_in_bytes),
        "alias_bytes": int(stats.alias_size_in_bytes),
        "generated_code_bytes": int(stats.generated_code_size_in_bytes),
    }


def _ru_maxrss_bytes():
    scale = 1 if platform.system() == "Darwin" else 1024  # Linux reports KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _proc_status_bytes(key):
    """VmRSS or VmHWM of this process from /proc/self/status (Linux), or None."""
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def _reset_peak_rss():
    """Sets the RSS high-water mark (VmHWM) to the current RSS; False where Linux can't."""
    try:
        pathlib.Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return _proc_status_bytes("VmHWM") is not None


def _reset_device_peak():
    backend = _backend()
    if backend == "torch" and _torch_cuda():
        import torch

        torch.cuda.reset_peak_memory_stats()
    elif backend == "tensorflow" and _tf_gpus():
        import tensorflow as tf

        tf.config.experimental.reset_memory_stats("GPU:0")


def _device_peak():
    """(peak device bytes, how measured), or (None, why not)."""
    backend = _backend()
    if backend == "torch":
        if not _torch_cuda():
            return None, "torch keeps no accounting of CPU allocations"
        import torch

        return int(torch.cuda.max_memory_allocated()), "torch.cuda.max_memory_allocated"
    if backend == "tensorflow":
        if not _tf_gpus():
            return None, "tensorflow accounts device memory on GPUs only"
        import tensorflow as tf

        peak = tf.config.experimental.get_memory_info("GPU:0")["peak"]
        return int(peak), "tf.config.experimental.get_memory_info('GPU:0')['peak']"
    import jax

    stats = jax.devices()[0].memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        return None, "jax memory_stats() has no peak_bytes_in_use on this platform"
    return int(stats["peak_bytes_in_use"]), "jax memory_stats()['peak_bytes_in_use']"


def _free_device_memory():
    """Frees the timed models' memory before the probes run beside this process."""
    import gc

    gc.collect()
    if _backend() == "torch" and _torch_cuda():
        import torch

        torch.cuda.empty_cache()


def probe(value):
    """Prints one arm's memory, compiled and fitted in this fresh process.

    A first `fit` compiles the step (JAX, TensorFlow) and allocates the
    optimizer's state; the second, measured alone, is the steady state.
    """
    name, _, arm = value.partition(":")
    s, micro = _settings(name)
    x, y = make_data(name, s, micro * s["batch"], FLAGS.seed)
    rss_start = _proc_status_bytes("VmRSS")
    model = compiled_model(name, s, arm, FLAGS.steps, None)
    run_fit(model, x, y, s["batch"])
    resettable = _reset_peak_rss()
    # The high-water mark just reset: the same counter as the peak read after.
    rss_before = _proc_status_bytes("VmHWM" if resettable else "VmRSS")
    _reset_device_peak()
    run_fit(model, x, y, s["batch"])
    device_peak, source = _device_peak()
    fit_peak = _proc_status_bytes("VmHWM") if resettable else None
    report = {
        "process_peak_rss_bytes": _ru_maxrss_bytes(),
        "rss_at_start_bytes": rss_start,
        "rss_before_fit_bytes": rss_before,
        "fit_peak_rss_bytes": fit_peak,
        "fit_rss_growth_bytes": None if fit_peak is None else fit_peak - rss_before,
        "device_peak_bytes": device_peak,
        "device_peak_source": source,
    }
    print(PROBE_PREFIX + json.dumps(report))


def probe_subprocess(model_name, arm):
    """`probe` of one arm in a fresh process on the same backend."""
    command = [sys.executable, str(pathlib.Path(__file__).resolve())]
    command += [f"--probe={model_name}:{arm}", f"--steps={FLAGS.steps}", f"--seed={FLAGS.seed}"]
    if FLAGS.quick:
        command.append("--quick")
    if FLAGS.batch_size:
        command.append(f"--batch_size={FLAGS.batch_size}")
    if FLAGS.micro_batches:
        command.append(f"--micro_batches={FLAGS.micro_batches}")
    env = dict(os.environ, KERAS_BACKEND=_backend())
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    for line in done.stdout.splitlines():
        if line.startswith(PROBE_PREFIX):
            return json.loads(line[len(PROBE_PREFIX) :])
    raise RuntimeError(
        f"Memory probe {model_name}:{arm} exited {done.returncode} and printed no "
        f"{PROBE_PREFIX}:\n{done.stderr[-2000:]}"
    )


# -- the benchmark -------------------------------------------------------------


def _settings(name):
    s = _sizes(name, FLAGS.quick)
    if FLAGS.batch_size:
        s["batch"] = FLAGS.batch_size
    micro = FLAGS.micro_batches or (8 if FLAGS.quick else 64)
    return s, micro


def _spread(values):
    return {
        "rounds": list(values),
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def bench_model(name, rounds, steps, seed, memory):
    import keras

    s, micro = _settings(name)
    batch = s["batch"]
    x, y = make_data(name, s, micro * batch, seed)
    keras.utils.set_random_seed(seed)
    weights = build_model(name, s).get_weights()
    jax = _backend() == "jax"

    models, rows = {}, {}
    for arm in ARMS:
        model = compiled_model(name, s, arm, steps, weights)
        first_fit_s = run_fit(model, x, y, batch)  # compiles the step on JAX and TF
        row = {
            "model": name,
            "arm": arm,
            "batch": batch,
            "micro_batches": micro,
            "params": int(model.count_params()),
            "param_bytes": _nbytes(model.variables),
            "trainable_bytes": _nbytes(model.trainable_variables),
            "optimizer_state_bytes": _nbytes(model.optimizer.variables),
            "jit_compile": bool(getattr(model, "jit_compile", False)),
            "first_fit_s": first_fit_s,
        }
        if memory and jax:
            row["xla_memory"] = xla_memory_analysis(model, x, y, batch)
        models[arm] = model
        rows[arm] = row
        print(f"[{name}] {arm}: warm-up fit {first_fit_s:.2f}s", file=sys.stderr)

    times = {arm: [] for arm in ARMS}
    ratios = {base: {arm: [] for arm in ARMS} for base in BASE_ARMS}
    for r in range(rounds):
        order = ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]
        this_round = {}
        for arm in order:
            this_round[arm] = run_fit(models[arm], x, y, batch) * 1000.0 / micro
        for arm in ARMS:
            times[arm].append(this_round[arm])
            for base in BASE_ARMS:
                ratios[base][arm].append(this_round[arm] / this_round[base])
        print(
            f"[{name}] round {r + 1}/{rounds} ({', '.join(order)}): "
            + ", ".join(f"{a} {this_round[a]:.2f}ms" for a in ARMS),
            file=sys.stderr,
        )
    del models, model
    _free_device_memory()

    if memory:
        for arm in ARMS:
            rows[arm]["probe"] = probe_subprocess(name, arm)
            print(f"[{name}] {arm}: memory probe done", file=sys.stderr)

    for arm in ARMS:
        rows[arm].update(
            rounds=len(times[arm]),
            ms_per_micro_batch=times[arm],
            ms_median=statistics.median(times[arm]),
            **{f"ratio_to_{base}": _spread(ratios[base][arm]) for base in BASE_ARMS},
        )
    return [rows[a] for a in ARMS]


# -- the report ----------------------------------------------------------------


def _mib(value):
    if value is None:
        return "n/a"
    mib = value / 2**20
    return f"{mib:.3g}" if abs(mib) < 1000 else f"{mib:,.0f}"


def _times(value, unit):
    """`value` in multiples of `unit` (e.g. temp bytes in parameter-sized copies)."""
    return "n/a" if value is None or not unit else f"{value / unit:.2f}x"


def _ratio(spread):
    return f"{spread['median']:.3f} ({spread['min']:.3f}-{spread['max']:.3f})"


def markdown(result):
    """The report: a legend and one table row per model and arm."""
    rows = result["rows"]
    device = result["device"]
    versions = ", ".join(f"{k} {v}" for k, v in result["versions"].items() if v)
    lines = [
        f"# keras_accum on {result['backend']}: model.fit",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Backend {result['backend']} on {device['platform']} ({device['name']}); {versions}. "
        f"{result['rounds']} rounds, steps={result['steps']}. "
        "ms: median over rounds of ms per micro-batch. Ratios: this arm's time over "
        "keras_gas's and over plain_adam's within each round, median (min-max) over "
        "rounds. Bytes in MiB; params (MiB) counts every model variable; optimizer "
        "state is `optimizer.variables`.",
        "",
    ]
    xla = any("xla_memory" in row for row in rows)
    probe = any("probe" in row for row in rows)
    gpu_peak = any((row.get("probe") or {}).get("device_peak_bytes") for row in rows)
    if xla:
        lines[-2] += (
            " temp: XLA memory_analysis() scratch of the compiled train step beyond its "
            "arguments and outputs; temp / params: over the trainable bytes."
        )
    if probe:
        lines[-2] += (
            " Process peak RSS: the arm compiled and fitted twice in a fresh process "
            "(import and compile included); fit RSS growth: the RSS high-water mark over "
            "the second fit less the RSS before it."
        )
    if gpu_peak:
        lines[-2] += f" GPU peak: {rows[0]['probe']['device_peak_source']}."
    header = [
        "model",
        "arm",
        "ms / micro-batch",
        "ratio to keras_gas",
        "ratio to plain_adam",
        "rounds",
        "params (MiB)",
        "optimizer state MiB",
    ]
    if xla:
        header += ["temp MiB", "temp / params"]
    if probe:
        header += ["process peak RSS MiB", "fit RSS growth MiB"]
    if gpu_peak:
        header += ["GPU peak MiB"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [
            row["model"],
            row["arm"],
            f"{row['ms_median']:.2f}",
            _ratio(row["ratio_to_keras_gas"]),
            _ratio(row["ratio_to_plain_adam"]),
            str(row["rounds"]),
            f"{row['params']:,} ({_mib(row['param_bytes'])})",
            _mib(row["optimizer_state_bytes"]),
        ]
        if xla:
            mem = row.get("xla_memory") or {}
            cells += [
                _mib(mem.get("temp_bytes")),
                _times(mem.get("temp_bytes"), row["trainable_bytes"]),
            ]
        if probe:
            p = row.get("probe") or {}
            cells += [_mib(p.get("process_peak_rss_bytes")), _mib(p.get("fit_rss_growth_bytes"))]
        if gpu_peak:
            cells.append(_mib((row.get("probe") or {}).get("device_peak_bytes")))
        lines.append("| " + " | ".join(cells) + " |")
    unavailable = [
        f"{r['model']}/{r['arm']}: {r['xla_memory']['error']}"
        for r in rows
        if r.get("xla_memory") and not r["xla_memory"]["available"]
    ]
    if unavailable:
        lines += ["", "memory_analysis() unavailable: " + "; ".join(unavailable)]
    return "\n".join(lines) + "\n"


def main(argv):
    if len(argv) > 1:
        sys.exit(f"Unexpected arguments {argv[1:]}; flags are --name=value.")
    import keras

    backend = keras.backend.backend()
    if backend not in BACKENDS:
        sys.exit(
            f"error: KERAS_BACKEND must be one of {BACKENDS} (a backend that trains). "
            f"Received: KERAS_BACKEND={backend!r}"
        )
    if FLAGS.probe:
        probe(FLAGS.probe)
        return
    for name in FLAGS.models:
        try:
            _sizes(name, FLAGS.quick)  # unknown names fail before anything runs
        except ValueError as e:
            sys.exit(f"error: {e}")
    if FLAGS.rounds < 1:
        sys.exit(f"error: `rounds` must be an integer >= 1. Received: rounds={FLAGS.rounds}")

    started = time.time()
    rows = []
    for name in FLAGS.models:
        rows += bench_model(name, FLAGS.rounds, FLAGS.steps, FLAGS.seed, FLAGS.memory)
    result = {
        "command": f"KERAS_BACKEND={backend} python " + " ".join(shlex.quote(a) for a in sys.argv),
        "backend": backend,
        "device": device_info(),
        "versions": library_versions(),
        "git": git_commit(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "rounds": FLAGS.rounds,
        "steps": FLAGS.steps,
        "quick": FLAGS.quick,
        "arms": list(ARMS),
        "seconds": time.time() - started,
        "rows": rows,
    }
    report = markdown(result)
    print(report)
    if FLAGS.output:
        out = pathlib.Path(FLAGS.output)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.md").write_text(report)
        (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"Wrote {out}/results.md and results.json", file=sys.stderr)


if __name__ == "__main__":
    app.run(main)
