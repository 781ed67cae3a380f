"""Times and sizes the accumulating optimizers under JAX, in `model.fit`.

Five arms, each `model.compile(optimizer=...)` + `model.fit` as Keras
jit-compiles it on JAX (same inner `Adam(1e-3)`, 4 micro-batches a window,
micro-batch size B):

    keras_gas    keras.optimizers.Adam(1e-3, gradient_accumulation_steps=4)
    grad_accum   keras_accum.GradientAccumulation(Adam(1e-3), steps=4)
    update_adam  keras_accum.UpdateAccumulationAdam(1e-3, steps=4)
    invariant    keras_accum.InvariantAdam(1e-3, steps=4)
    plain_adam   keras.optimizers.Adam(1e-3)  (reference, no accumulation)

Full run (4 models; about 10 minutes on one core of a busy shared 2-core machine):

    taskset -c 0 python scripts/jax_bench.py --rounds=3 --output=runs/jax_bench

Smoke test (tiny sizes, numbers meaningless):

    python scripts/jax_bench.py --quick --models=mlp --output=/tmp/jax_bench_quick

Time: one untimed `fit` (compiles), then per round every arm runs one `fit`
over the same fixed numpy data (`--micro_batches` micro-batches of B, no
shuffling), the arms' order rotated by one each round. Reported: the median
over rounds of each arm's ms per micro-batch, and the median (min-max) over
rounds of its ratio to `keras_gas` (Keras's own accumulation) taken within the round (the pooled
side-by-side method: a ratio compares arms timed moments apart).

Memory: Keras's own jitted train step (the `jax.jit(train_step,
donate_argnums=0)` inside `model.train_function`; re-jitted the same way
where it cannot be found) lowered with the trainer's state tuple (trainable,
non-trainable, optimizer and metrics variables) and one micro-batch, and
compiled; XLA's `memory_analysis()` of it gives temp, argument, output and
alias bytes. Beside them: the parameter bytes and the optimizer-state bytes
(`optimizer.variables`), so that a temp size holding parameter-sized copies
beyond the optimizer's own state shows. Where `memory_analysis()` gives
nothing, each arm's peak RSS (`resource.getrusage`) in its own subprocess
stands in, and the report says so.
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

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Use the package of this checkout, whatever else is installed.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

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
flags.DEFINE_bool("memory", True, "Measure the compiled train step's memory.")
flags.DEFINE_string("output", None, "Directory for results.md and results.json.")
flags.DEFINE_integer("seed", 0, "Seed of the data and the shared initial weights.")
flags.DEFINE_string("rss_probe", None, "Internal: MODEL:ARM, print one arm's peak RSS.")

ARMS = ("keras_gas", "grad_accum", "update_adam", "invariant", "plain_adam")
BASE_ARM = "keras_gas"
LR = 1e-3


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
    raise ValueError(f"Unknown arm {arm!r}; expected one of {ARMS}.")


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
        raise ValueError(f"Unknown model {name!r}; expected one of {sorted(table)}.")
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
    """One `fit` epoch, waited for; seconds."""
    import jax

    start = time.perf_counter()
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    jax.block_until_ready([v.value for v in model.trainable_variables])
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


def memory_analysis(model, x, y, batch):
    """XLA's memory analysis of the compiled train step, or None."""
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
    except Exception as e:  # memory_analysis is backend-dependent
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


def peak_rss_subprocess(model_name, arm):
    """Peak RSS (bytes) of one arm compiled and fitted in a fresh process."""
    command = [sys.executable, __file__, f"--rss_probe={model_name}:{arm}"]
    command += [f"--steps={FLAGS.steps}", f"--seed={FLAGS.seed}"]
    if FLAGS.quick:
        command.append("--quick")
    if FLAGS.batch_size:
        command.append(f"--batch_size={FLAGS.batch_size}")
    if FLAGS.micro_batches:
        command.append(f"--micro_batches={FLAGS.micro_batches}")
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    for line in done.stdout.splitlines():
        if line.startswith("PEAK_RSS_BYTES="):
            return int(line.split("=", 1)[1])
    raise RuntimeError(f"RSS probe printed no PEAK_RSS_BYTES:\n{done.stderr[-2000:]}")


def _ru_maxrss_bytes():
    scale = 1 if platform.system() == "Darwin" else 1024  # Linux reports KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


# -- the benchmark -------------------------------------------------------------


def _settings(name):
    s = _sizes(name, FLAGS.quick)
    if FLAGS.batch_size:
        s["batch"] = FLAGS.batch_size
    micro = FLAGS.micro_batches or (8 if FLAGS.quick else 64)
    return s, micro


def bench_model(name, rounds, steps, seed, memory):
    import keras

    s, micro = _settings(name)
    batch = s["batch"]
    x, y = make_data(name, s, micro * batch, seed)
    keras.utils.set_random_seed(seed)
    weights = build_model(name, s).get_weights()

    models, rows = {}, {}
    for arm in ARMS:
        model = compiled_model(name, s, arm, steps, weights)
        compile_s = run_fit(model, x, y, batch)  # compiles the train step
        trainable = model.trainable_variables
        row = {
            "model": name,
            "arm": arm,
            "batch": batch,
            "micro_batches": micro,
            "params": int(model.count_params()),
            "param_bytes": _nbytes(model.variables),
            "trainable_bytes": _nbytes(trainable),
            "optimizer_state_bytes": _nbytes(model.optimizer.variables),
            "first_fit_s": compile_s,
        }
        if memory:
            row["memory"] = memory_analysis(model, x, y, batch)
        models[arm] = model
        rows[arm] = row
        print(f"[{name}] {arm}: warm-up fit {compile_s:.2f}s", file=sys.stderr)

    times = {arm: [] for arm in ARMS}
    ratios = {arm: [] for arm in ARMS}
    for r in range(rounds):
        order = ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]
        this_round = {}
        for arm in order:
            this_round[arm] = run_fit(models[arm], x, y, batch) * 1000.0 / micro
        for arm in ARMS:
            times[arm].append(this_round[arm])
            ratios[arm].append(this_round[arm] / this_round[BASE_ARM])
        print(
            f"[{name}] round {r + 1}/{rounds}: "
            + ", ".join(f"{a} {this_round[a]:.2f}ms" for a in ARMS),
            file=sys.stderr,
        )

    if memory and not all(rows[a]["memory"]["available"] for a in ARMS):
        for arm in ARMS:
            rows[arm]["peak_rss_bytes"] = peak_rss_subprocess(name, arm)

    for arm in ARMS:
        rows[arm].update(
            ms_per_micro_batch=times[arm],
            ms_median=statistics.median(times[arm]),
            ratio_rounds=ratios[arm],
            ratio_median=statistics.median(ratios[arm]),
            ratio_min=min(ratios[arm]),
            ratio_max=max(ratios[arm]),
        )
    return [rows[a] for a in ARMS]


def _mib(value):
    return "n/a" if value is None else f"{value / 2**20:.3g}"


def _times(value, unit):
    """`value` in multiples of `unit` (e.g. temp bytes in parameter-sized copies)."""
    return "n/a" if value is None or not unit else f"{value / unit:.2f}x"


def markdown(result):
    """The report: one table row per model and arm."""
    lines = [
        "# keras_accum on JAX: model.fit, jit-compiled by Keras",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Backend {result['backend']} (jax {result['jax']}, keras {result['keras']}), "
        f"device {result['device']}; {result['rounds']} rounds, steps={result['steps']}. "
        f"Ratio: this arm's time over `{BASE_ARM}`'s within each round, median (min-max). "
        "Bytes in MiB; memory from XLA `memory_analysis()` of the compiled train step "
        "(temp = scratch beyond arguments and outputs; alias = outputs sharing donated "
        "argument buffers; temp / params = temp bytes over trainable-parameter bytes).",
        "",
    ]
    header = (
        "| model | arm | ms / micro-batch | ratio to keras_gas | temp MiB | argument MiB "
        "| output MiB | alias MiB | optimizer state MiB | params (MiB) | temp / params |"
    )
    rss = any("peak_rss_bytes" in row for row in result["rows"])
    if rss:
        header += " peak RSS MiB |"
    lines += [header, header_rule(header)]
    for row in result["rows"]:
        mem = row.get("memory") or {}
        cells = [
            row["model"],
            row["arm"],
            f"{row['ms_median']:.2f}",
            f"{row['ratio_median']:.3f} ({row['ratio_min']:.3f}-{row['ratio_max']:.3f})",
            _mib(mem.get("temp_bytes")),
            _mib(mem.get("argument_bytes")),
            _mib(mem.get("output_bytes")),
            _mib(mem.get("alias_bytes")),
            _mib(row["optimizer_state_bytes"]),
            f"{row['params']:,} ({_mib(row['param_bytes'])})",
            _times(mem.get("temp_bytes"), row["trainable_bytes"]),
        ]
        if rss:
            cells.append(_mib(row.get("peak_rss_bytes")))
        lines.append("| " + " | ".join(cells) + " |")
    unavailable = [
        f"{r['model']}/{r['arm']}: {r['memory']['error']}"
        for r in result["rows"]
        if r.get("memory") and not r["memory"]["available"]
    ]
    if unavailable:
        lines += [
            "",
            "memory_analysis() unavailable (peak RSS per arm in a subprocess instead): "
            + "; ".join(unavailable),
        ]
    return "\n".join(lines) + "\n"


def header_rule(header):
    return "|" + "---|" * (header.count("|") - 1)


def rss_probe(value):
    name, _, arm = value.partition(":")
    s, micro = _settings(name)
    x, y = make_data(name, s, micro * s["batch"], FLAGS.seed)
    model = compiled_model(name, s, arm, FLAGS.steps, None)
    run_fit(model, x, y, s["batch"])
    print(f"PEAK_RSS_BYTES={_ru_maxrss_bytes()}")


def main(argv):
    if len(argv) > 1:
        sys.exit(f"Unexpected arguments {argv[1:]}; flags are --name=value.")
    import jax
    import keras

    if keras.backend.backend() != "jax":
        sys.exit(f"error: needs KERAS_BACKEND=jax; Keras runs {keras.backend.backend()!r}.")
    if FLAGS.rss_probe:
        rss_probe(FLAGS.rss_probe)
        return
    for name in FLAGS.models:
        _sizes(name, FLAGS.quick)  # unknown names fail before anything runs
    if FLAGS.rounds < 1:
        sys.exit("error: --rounds must be at least 1.")

    started = time.time()
    rows = []
    for name in FLAGS.models:
        rows += bench_model(name, FLAGS.rounds, FLAGS.steps, FLAGS.seed, FLAGS.memory)
    result = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "backend": keras.backend.backend(),
        "jax": jax.__version__,
        "keras": keras.__version__,
        "device": str(jax.devices()[0]),
        "cpu_affinity": sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else None,
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
