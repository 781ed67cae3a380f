"""What rematerialization saves and costs: the character-level transformer
(`charlm.build_lm`, its default sizes) at long sequences and micro-batch 1,
graph mode and XLA, for each `keras_accum.remat` mode.

* Memory: one fresh process per (setting, sequence length, mode), started
  with TF_CPU_ALLOCATOR_USE_BFC=true, as the benchmark's memory rows: the
  allocator's peak over a few training calls above what it held once the
  model, optimizer and data were built (`step_mb`: the step's activations,
  gradients and temporaries), and the whole peak (`total_mb`).
* Time: one process per setting and length holds a model per mode (same
  weights) and times them in turns, `rounds` rounds of `calls` calls each
  (one micro-batch a call); a ratio is the median of the per-round ratios
  to "none", so the machine's load, which drifts between rounds, cancels.

`scripts/remat_bench.py` runs it and writes the Markdown section.
"""

import glob
import json
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time

from keras_accum.experiments import child

MODES = ("none", "full", "larger_than")
# charlm.build_lm sizes: its defaults, and a deeper, wider one.
SIZES = {"lm": {}, "lm_4x64": {"dim": 64, "heads": 4, "blocks": 4, "mlp_dim": 256}}
SETTINGS = {"graph": False, "xla": True}


def _model(size, seq_len, mode, jit_compile):
    import keras

    import keras_accum as ka
    from keras_accum.experiments import charlm

    keras.utils.set_random_seed(0)
    model = ka.rematerialize(charlm.build_lm(seq_len=seq_len, **SIZES[size]), mode)
    model.compile(
        ka.InvariantAdam(1e-3, steps=8),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    model.optimizer.build(model.trainable_variables)
    model.make_train_function()
    return model


def _stream(seq_len):
    import numpy as np
    import tensorflow as tf

    from keras_accum.experiments import charlm

    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, charlm.VOCAB_SIZE, (8, seq_len), dtype="int32") for _ in range(2))
    return iter(tf.data.Dataset.from_tensor_slices((x, y)).batch(1).repeat())


def memory_here(size, setting, seq_len, mode, calls=3, dump_dir=None):
    """In this fresh BFC process: peaks of `calls` training calls (MB), and
    under XLA (`dump_dir`: this process's --xla_dump_to) the compiled
    step's temporary buffer."""
    stream = _stream(seq_len)
    model = _model(size, seq_len, mode, SETTINGS[setting])
    held = child.memory_info()["current"]
    child.reset_peak()
    for _ in range(calls):
        model.train_function(stream)
    peak = child.memory_info()["peak"]
    row = {"step_mb": (peak - held) / 2**20, "total_mb": peak / 2**20}
    if dump_dir:
        row["xla_temp_mb"] = xla_temp_bytes(dump_dir) / 2**20
    return row


# "allocation 497: size 44897832, preallocated-temp:" in a buffer assignment.
_TEMP = re.compile(r"^allocation \d+: size (\d+), preallocated-temp")


def xla_temp_bytes(dump_dir):
    """The preallocated temporary buffer of the newest compiled training
    step in `dump_dir` (XLA's buffer assignment: every intermediate of the
    step, packed by liveness). The allocator hands it out as one block, and
    the BFC allocator's peak counts the whole chunk it took it from (chunks
    come in powers of two), so this is the finer measure under XLA."""
    files = sorted(
        glob.glob(os.path.join(dump_dir, "*one_step_on_data*buffer-assignment.txt")),
        key=os.path.getmtime,
    )
    with open(files[-1]) as f:
        return sum(int(m.group(1)) for m in map(_TEMP.match, f) if m)


def time_here(size, setting, seq_len, modes=MODES, rounds=5, calls=5):
    """In this process: seconds per micro-batch of each mode, per round."""
    models = {mode: _model(size, seq_len, mode, SETTINGS[setting]) for mode in modes}
    streams = {mode: _stream(seq_len) for mode in modes}
    for mode in modes:  # Trace and warm up.
        for _ in range(2):
            models[mode].train_function(streams[mode])
    samples = {mode: [] for mode in modes}
    for _ in range(rounds):
        for mode in modes:
            start = time.perf_counter()
            for _ in range(calls):
                logs = models[mode].train_function(streams[mode])
            float(logs["loss"])  # Wait for the last call.
            samples[mode].append((time.perf_counter() - start) / calls)
    return samples


def _child(kind, **request):
    env = dict(child.BFC)
    if kind == "memory" and SETTINGS[request["setting"]]:
        request["dump_dir"] = tempfile.mkdtemp(prefix="remat_bench_")
        env.update(child.xla_dump(request["dump_dir"]))
    try:
        module = "keras_accum.experiments.remat_bench"
        return child.run(module, kind, json.dumps(request), env=env, timeout=1200)
    finally:
        if request.get("dump_dir"):
            shutil.rmtree(request["dump_dir"], ignore_errors=True)


def run(sizes, seq_lens, settings=tuple(SETTINGS), modes=MODES, rounds=5, calls=5, report=print):
    """Every measurement, each in its own process; a JSON-able dict."""
    results = {"memory": [], "time": [], "rounds": rounds, "calls": calls}
    for size in sizes:
        for setting in settings:
            for seq_len in seq_lens:
                case = {"size": size, "setting": setting, "seq_len": seq_len}
                for mode in modes:
                    row = _child("memory", mode=mode, **case)
                    results["memory"].append(dict(row, mode=mode, **case))
                    report(f"memory {case} {mode}: {row}")
                samples = _child("time", modes=modes, rounds=rounds, calls=calls, **case)
                results["time"].append(dict(case, samples=samples))
                report(f"time {case}: {samples}")
    return results


def markdown(results, command):
    """The BENCHMARKS.md section."""
    import keras
    import tensorflow as tf

    memory = {(r["size"], r["setting"], r["seq_len"], r["mode"]): r for r in results["memory"]}
    times = {(r["size"], r["setting"], r["seq_len"]): r["samples"] for r in results["time"]}
    modes = [m for m in MODES if any(k[3] == m for k in memory)]
    lines = [
        f"* `nproc`: {os.cpu_count()}; TensorFlow {tf.__version__}, Keras {keras.__version__}, "
        f"Python {platform.python_version()}",
        "* Models: `charlm.build_lm(seq_len=L)` at its default sizes (*lm*: dim 32, 2 heads, "
        "2 blocks, MLP 64) and deeper and wider (*lm_4x64*: dim 64, 4 heads, 4 blocks, "
        "MLP 256); `InvariantAdam(steps=8)`, micro-batch 1, random characters.",
        "* *step MB*: the allocator's peak over 3 training calls above what it held once "
        "model, optimizer and data were built (activations, gradients, temporaries); "
        "*total MB*: the whole peak. One fresh process each, TF_CPU_ALLOCATOR_USE_BFC=true. "
        "*memory x*: step MB over `none`'s. *XLA temp MB*: the compiled step's "
        "preallocated temporary buffer in XLA's buffer assignment (`--xla_dump_to`), "
        "in brackets over `none`'s.",
        f"* *ms / micro-batch*: median of {results['rounds']} rounds of {results['calls']} "
        "calls, the modes timed in turns in one process; *time x*: median of the per-round "
        "ratios to `none`.",
        "",
        "Command:",
        "",
        "```",
        command,
        "```",
        "",
        "| model | setting | L | remat | step MB | total MB | memory x | XLA temp MB "
        "| ms / micro-batch | time x |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (size, setting, seq_len), samples in times.items():
        base = memory[(size, setting, seq_len, "none")]
        for mode in modes:
            row = memory[(size, setting, seq_len, mode)]
            ratios = [a / b for a, b in zip(samples[mode], samples["none"])]
            temp = "-"
            if "xla_temp_mb" in row:
                temp = f"{row['xla_temp_mb']:.1f} ({row['xla_temp_mb'] / base['xla_temp_mb']:.2f})"
            lines.append(
                f"| {size} | {setting} | {seq_len} | {mode} | {row['step_mb']:.1f} | "
                f"{row['total_mb']:.1f} | {row['step_mb'] / base['step_mb']:.2f} | {temp} | "
                f"{1000 * statistics.median(samples[mode]):.1f} | {statistics.median(ratios):.2f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    kind, request = sys.argv[1], json.loads(sys.argv[2])
    print(json.dumps(memory_here(**request) if kind == "memory" else time_here(**request)))
