"""What rematerialization saves and costs on the character-level transformer
at long sequences, micro-batch 1, graph mode and XLA (one process per memory
number; the modes timed in turns in one process). About 10 minutes on 2
busy cores:

    python scripts/remat_bench.py --splice=BENCHMARKS.md:remat

What is measured and how: keras_accum/experiments/remat_bench.py.

`--section=backends`: the compiled training step's XLA temporary memory
with and without `rematerialize` on TensorFlow and JAX, for models whose
activations dwarf their weights (`BACKEND_MODELS`), one process per number.
About 3 minutes:

    python scripts/remat_bench.py --section=backends --splice=BENCHMARKS.md:remat_backends

JAX: `memory_analysis()` of the step Keras jit-compiles (`jax.jit(train_step,
donate_argnums=0)`), lowered with the trainer's state and one micro-batch:
its `temp_size_in_bytes`. TensorFlow (`jit_compile=True`): the preallocated
temporary buffer of the same step in XLA's buffer assignment, after one
training call (`remat_bench.xla_temp_bytes`). The models are built here,
not in `keras_accum.experiments`, which runs on TensorFlow only.
"""

import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The harness is TensorFlow: this script sets the backend itself (an explicit
# KERAS_BACKEND is kept, and then refused in one line if it is another).
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# Use the package of this checkout, whatever else is installed.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes", ["lm", "lm_4x64"], "Model sizes (remat_bench.SIZES).")
flags.DEFINE_list("seq_lens", ["1024", "2048"], "Sequence lengths (characters).")
flags.DEFINE_list("settings", ["graph", "xla"], "graph and/or xla.")
flags.DEFINE_list("modes", ["none", "full", "larger_than"], "remat modes; none first.")
flags.DEFINE_integer("rounds", 5, "Timing rounds.", lower_bound=1)
flags.DEFINE_integer("calls", 5, "Calls (micro-batches) per mode per round.", lower_bound=1)
flags.DEFINE_string("output", None, "Write the raw results here as JSON.")
flags.DEFINE_string("splice", None, "FILE:SECTION, e.g. BENCHMARKS.md:remat.")
flags.DEFINE_enum(
    "section",
    "lm",
    ["lm", "backends"],
    "lm: the character LM on TensorFlow (sizes, seq_lens, settings); backends: XLA "
    "temporary memory of BACKEND_MODELS on each of --backends.",
)
flags.DEFINE_list("backends", ["tensorflow", "jax"], "Keras backends (--section=backends).")
flags.DEFINE_string("probe", None, "Internal: one --section=backends measurement (JSON).")

# --section=backends: (builder, micro-batch). Activations dwarf the weights.
BACKEND_MODELS = {
    # 16 x Dense(512, gelu): 2 MB of weights a layer; at micro-batch 1024 each
    # keeps its 2 MB output and the 2 MB GELU input.
    "mlp_16x512": ("mlp", 1024),
    # 4 convolutions (32, 32, 64, 64 channels, 3x3) on 32 x 32 x 3 images.
    "cnn_gelu": ("cnn_gelu", 64),
    # The same with ReLU, whose gradient reads the layer's output: a layer
    # keeps nothing but its output, which the next layer keeps as its input.
    "cnn_relu": ("cnn_relu", 64),
}
BACKEND_MODES = ("none", "full", "larger_than")


def _build(name):
    import keras

    kind, _ = BACKEND_MODELS[name]
    if kind == "mlp":
        inputs = keras.Input((512,))
        x = inputs
        for _ in range(16):
            x = keras.layers.Dense(512, activation="gelu")(x)
    else:
        inputs = keras.Input((32, 32, 3))
        x = inputs
        for filters in (32, 32, 64, 64):
            x = keras.layers.Conv2D(filters, 3, padding="same", activation=kind[4:])(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x), name=name)


def probe(request):
    """In this process (KERAS_BACKEND set by the parent): the compiled
    training step's XLA temporary bytes for one model and mode."""
    import keras
    import numpy as np

    import keras_accum as ka

    _, batch = BACKEND_MODELS[request["model"]]
    keras.utils.set_random_seed(0)
    model = ka.rematerialize(_build(request["model"]), request["mode"])
    model.compile(
        ka.InvariantAdam(1e-3, steps=8),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    model.optimizer.build(model.trainable_variables)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, *model.input_shape[1:])).astype("float32")
    y = rng.integers(0, 10, batch).astype("int32")
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        state = model._get_jax_state(
            trainable_variables=True,
            non_trainable_variables=True,
            optimizer_variables=True,
            metrics_variables=True,
        )
        step = jax.jit(model.train_step, donate_argnums=0)
        temp = step.lower(state, (x, y)).compile().memory_analysis().temp_size_in_bytes
        version = jax.__version__
    else:
        import tensorflow as tf

        from keras_accum.experiments import remat_bench

        model.train_on_batch(x, y)
        temp = remat_bench.xla_temp_bytes(request["dump_dir"])
        version = tf.__version__
    return {"temp_bytes": int(temp), "version": version, "keras": keras.__version__}


def _probe_child(backend, model, mode):
    request = {"model": model, "mode": mode}
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    if backend == "tensorflow":
        request["dump_dir"] = tempfile.mkdtemp(prefix="remat_bench_")
        dump = f"{env.get('XLA_FLAGS', '')} --xla_dump_to={request['dump_dir']}"
        env["XLA_FLAGS"] = f"{dump} --xla_dump_hlo_as_text".strip()
    try:
        done = subprocess.run(
            [sys.executable, __file__, f"--probe={json.dumps(request)}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=1200,
        )
    finally:
        if "dump_dir" in request:
            shutil.rmtree(request["dump_dir"], ignore_errors=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"probe {backend} {model} {mode} failed: {tail}")
    return json.loads(lines[-1])


def run_backends(backends, modes, report=print):
    """Every (backend, model, mode), each in its own process."""
    rows = []
    for backend in backends:
        for model in BACKEND_MODELS:
            for mode in modes:
                row = dict(_probe_child(backend, model, mode), backend=backend, model=model)
                rows.append(dict(row, mode=mode))
                report(f"{backend} {model} {mode}: {row}")
    return rows


def markdown_backends(rows, command):
    """The BENCHMARKS.md section of --section=backends."""
    import platform

    versions = {}
    for row in rows:
        versions.setdefault(row["backend"], (row["version"], row["keras"]))
    base = {(r["backend"], r["model"]): r["temp_bytes"] for r in rows if r["mode"] == "none"}
    lines = [
        f"* `nproc`: {os.cpu_count()}; "
        + ", ".join(f"{b} {v} (Keras {k})" for b, (v, k) in versions.items())
        + f", Python {platform.python_version()}",
        "* *temp MiB*: the compiled training step's XLA temporary buffer, one micro-batch, "
        "`InvariantAdam(steps=8)`, one process each; *x none*: over `none`'s on the same "
        "backend. JAX: `memory_analysis().temp_size_in_bytes` of `jax.jit(train_step, "
        "donate_argnums=0)`; TensorFlow: `jit_compile=True`, the preallocated temporary "
        "buffer of XLA's buffer assignment.",
        "* Models: *mlp_16x512*: 16 x Dense(512, gelu), micro-batch 1024; *cnn_gelu* and "
        "*cnn_relu*: 4 x Conv2D(3x3, 32-32-64-64 channels, same padding) on 32x32x3, "
        "micro-batch 64. `larger_than` (1024 elements per item) wraps no Dense(512).",
        "",
        "Command:",
        "",
        "```",
        command,
        "```",
        "",
        "| backend | model | remat | temp MiB | x none |",
        "|---|---|---|---:|---:|",
    ]
    for row in rows:
        none = base[(row["backend"], row["model"])]
        lines.append(
            f"| {row['backend']} | {row['model']} | {row['mode']} | "
            f"{row['temp_bytes'] / 2**20:.1f} | {row['temp_bytes'] / none:.2f} |"
        )
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        sys.exit(f"Unexpected arguments {argv[1:]}; flags are --name=value.")
    if FLAGS.probe:
        print(json.dumps(probe(json.loads(FLAGS.probe))))
        return
    if FLAGS.section == "backends":
        return main_backends()
    from keras_accum.experiments import remat_bench
    from keras_accum.experiments.bench import report

    try:
        for name, values, valid in (
            ("sizes", FLAGS.sizes, remat_bench.SIZES),
            ("settings", FLAGS.settings, remat_bench.SETTINGS),
            ("modes", FLAGS.modes, remat_bench.MODES),
        ):
            if not values or any(v not in valid for v in values):
                raise ValueError(
                    f"`{name}` must be a list of {', '.join(valid)}. Received: {name}={values!r}"
                )
        if FLAGS.modes[0] != "none":
            raise ValueError(f"`modes` must start with none. Received: modes={FLAGS.modes!r}")
        seq_lens = [int(v) for v in FLAGS.seq_lens]
        splice = FLAGS.splice.rsplit(":", 1) if FLAGS.splice else None
        if splice:
            report.check_splice(*splice)
    except ValueError as e:
        sys.exit(f"error: {e}")
    results = remat_bench.run(
        FLAGS.sizes,
        seq_lens,
        FLAGS.settings,
        FLAGS.modes,
        FLAGS.rounds,
        FLAGS.calls,
        report=lambda line: print(line, file=sys.stderr, flush=True),
    )
    if FLAGS.output:
        pathlib.Path(FLAGS.output).write_text(json.dumps(results, indent=1))
    text = remat_bench.markdown(results, "python " + " ".join(shlex.quote(a) for a in sys.argv))
    print(text)
    if splice:
        report.splice_markdown(*splice, text)


def main_backends():
    from keras_accum.experiments.bench import report

    try:
        for name, values, valid in (
            ("backends", FLAGS.backends, ("tensorflow", "jax")),
            ("modes", FLAGS.modes, BACKEND_MODES),
        ):
            if not values or any(v not in valid for v in values):
                raise ValueError(
                    f"`{name}` must be a list of {', '.join(valid)}. Received: {name}={values!r}"
                )
        if FLAGS.modes[0] != "none":
            raise ValueError(f"`modes` must start with none. Received: modes={FLAGS.modes!r}")
        splice = FLAGS.splice.rsplit(":", 1) if FLAGS.splice else None
        if splice:
            report.check_splice(*splice)
    except ValueError as e:
        sys.exit(f"error: {e}")
    rows = run_backends(
        FLAGS.backends, FLAGS.modes, report=lambda line: print(line, file=sys.stderr, flush=True)
    )
    if FLAGS.output:
        pathlib.Path(FLAGS.output).write_text(json.dumps(rows, indent=1))
    text = markdown_backends(rows, "python " + " ".join(shlex.quote(a) for a in sys.argv))
    print(text)
    if splice:
        report.splice_markdown(*splice, text)


if __name__ == "__main__":
    app.run(main)
