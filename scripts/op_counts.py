"""Counts the TensorFlow ops of one traced `apply` per optimizer and mode.

A noise-free check beside the timings of `scripts/bench.py`: the same op
counts on the hot path before and after a change mean the same work per
micro-batch. Counts include `tf.cond` branches and compiled kernels; a
model "small" is below, "big" above the size where the graph-mode fold is
compiled.

    PYTHONPATH=. python scripts/op_counts.py runs/ops.json    # this checkout
    PYTHONPATH=../old python scripts/op_counts.py old.json    # another one
    python scripts/op_counts.py --compare old.json runs/ops.json

Writes {"<optimizer> <size> <mode>": total, "... types": {op: count}}.
"""

import collections
import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_accum as ka  # noqa: E402


def graph_ops(graph, seen):
    """Op types of `graph` and of the functions it calls."""
    counts = collections.Counter()
    for op in graph.get_operations():
        counts[op.type] += 1
    # functions called from this graph (cond branches, compiled kernels)
    for name, fn in getattr(graph, "_functions", {}).items():
        if name in seen:
            continue
        seen.add(name)
        fdef = fn.cached_definition if hasattr(fn, "cached_definition") else fn.definition
        for node in fdef.node_def:
            counts[node.op] += 1
    return counts


def variables(big):
    """Four variables below (`big` False) or above the compiled-fold size."""
    shapes = [(512, 256), (256,), (256, 10), (10,)] if big else [(8, 16), (16,), (16, 3), (3,)]
    return [keras.Variable(np.full(s, 0.5, "float32")) for s in shapes]


MAKERS = {
    "ga": lambda: ka.GradientAccumulation(keras.optimizers.Adam(0.1), steps=4),
    "ga_skip_micro": lambda: ka.GradientAccumulation(
        keras.optimizers.Adam(0.1), steps=4, nonfinite="skip_micro_batch"
    ),
    "ga_none": lambda: ka.GradientAccumulation(keras.optimizers.Adam(0.1), steps=4, nonfinite=None),
    "ia": lambda: ka.InvariantAdam(0.1, steps=4),
    "ia_steps1": lambda: ka.InvariantAdam(0.1, steps=1),
    "ia_clip_wd": lambda: ka.InvariantAdam(0.1, steps=4, global_clipnorm=1.0, weight_decay=0.1),
    "uaa": lambda: ka.UpdateAccumulationAdam(0.1, steps=4),
    "uaa_steps1": lambda: ka.UpdateAccumulationAdam(0.1, steps=1),
    "uaa_skip_window": lambda: ka.UpdateAccumulationAdam(0.1, steps=4, nonfinite="skip_window"),
}


def count(make, big, jit):
    """Op types of one traced `apply` of a fresh optimizer."""
    variables_ = variables(big)
    optimizer = make()
    optimizer.build(variables_)
    step = tf.function(lambda *g: optimizer.apply(list(g), variables_), jit_compile=jit)
    specs = [tf.TensorSpec(v.shape, "float32") for v in variables_]
    return graph_ops(step.get_concrete_function(*specs).graph, set())


def main(argv):
    if len(argv) == 4 and argv[1] == "--compare":  # two outputs: what differs
        before, after = (json.load(open(path)) for path in argv[2:])
        for key in sorted(k for k in before if not k.endswith("types")):
            b, a = before[f"{key} types"], after[f"{key} types"]
            changed = {t: (b.get(t, 0), a.get(t, 0)) for t in sorted(set(b) | set(a))}
            changed = {t: v for t, v in changed.items() if v[0] != v[1]}
            print(f"{key}: {before[key]} -> {after[key]}", changed or "")
        return 0
    if len(argv) != 2:
        print(__doc__)
        return 2
    out = {}
    for name, make in MAKERS.items():
        for big in (False, True):
            for jit in (False, True):
                key = f"{name} {'big' if big else 'small'} {'xla' if jit else 'graph'}"
                counts = count(make, big, jit)
                out[key], out[f"{key} types"] = sum(counts.values()), dict(sorted(counts.items()))
    with open(argv[1], "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
