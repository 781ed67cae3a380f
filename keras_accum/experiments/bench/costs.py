"""The cost model: bytes moved per parameter per micro-step, beside the
measured optimizer time.

Read off the code in graph mode with N = steps, one replica, the default
non-finite check (GradientAccumulation: once per window, on its sums; the
Adam variants: every micro-batch). Each entry: (first micro-step of a
window, other micro-steps, extra at the window's last micro-step). "fused": each tensor
read or written once per micro-step (what an ideal kernel, or XLA without
copies, would move). "ops": every TensorFlow op reads its inputs and writes
its output in full (graph mode, no fusion): add/sub/mul/div of two tensors
12, of a tensor and a scalar 8, square/sqrt 8, assign 8,
assign_add/assign_sub 12, the finiteness check (one reduce_sum read per
gradient) 4. InvariantAdam's fold and UpdateAccumulationAdam's micro-step
run in graph mode as one compiled kernel (`keras_accum/folds.py`, `_execution.run`) when
they span 65,536 parameters or more (the MLP; smaller folds run as
TensorFlow ops): each operand read once, each result written once, as in
"fused". Graph mode
takes the branch forms of the other optimizers (a `tf.cond` on the window
start and on the check), XLA the fused masks. BENCHMARKS.md derives each
line.
"""

import statistics

from keras_accum.experiments.bench.config import device_of

COST_MODEL = {
    # m += (g-m)(1-b1); v += (g^2-v)(1-b2); theta -= m alpha/(sqrt v + eps)
    "adam": {"fused": (28, 28, 0), "ops": (120, 120, 0)},
    # acc = g + acc; boundary: (g + acc)/N, Adam, acc = zeros.
    "keras_accumulation": {"fused": (12, 12, 24), "ops": (20, 20, 152 - 20)},
    # acc = g (first) or acc += g; boundary: the window check (one read of
    # acc: the default "skip_window"), acc / W, inner Adam.
    "gradient_accumulation": {"fused": (8, 12, 28), "ops": (8, 12, 132)},
    "gradient_accumulation_nocheck": {"fused": (8, 12, 28), "ops": (8, 12, 128)},
    # check; one kernel: read g, m, v, write m, v (the window-start decay
    # included); boundary: theta -= alpha m / (sqrt v + eps) as TF ops.
    # (Before the compiled fold: "ops" (92, 68, 48).)
    "invariant_adam": {"fused": (20, 20, 16), "ops": (24, 24, 48)},
    "invariant_adam_nocheck": {"fused": (20, 20, 16), "ops": (20, 20, 48)},
    # check; one kernel: read g, m, v, A, write m, v, A (Adam moments,
    # step = alpha m/(sqrt v + eps), A = step or A + step); boundary:
    # theta -= A. (Before the compiled micro-step: "ops" (120, 124, 12).)
    "update_accumulation_adam": {"fused": (24, 28, 12), "ops": (32, 32, 12)},
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


def _cost_line(model, name, row, base, steps):
    fused = modelled_bytes(name, steps, "fused")
    ops = modelled_bytes(name, steps, "ops")
    measured = implied = None
    if base is not None:
        seconds = statistics.median(a - g for a, g in zip(row["samples"], base["samples"]))
        measured = 1e9 * seconds / row["params"]
        if ops and seconds > 0:
            # gradients_only already reads g once: compare the rest.
            base_ops = modelled_bytes("gradients_only", steps, "ops")
            implied = (ops - base_ops) * row["params"] / seconds / 1e9
    return {
        "model": model,
        "contender": name,
        "fused": fused,
        "ops": ops,
        "ns_per_param": measured,
        "implied_gb_s": implied,
    }


def cost_rows(result, setting="graph"):
    """Modelled bytes beside the measured optimizer time, per model in
    `setting` at the main micro-batch on the CPU (the model counts passes
    over host memory): optimizer time = t(contender) - t(gradients_only),
    per parameter."""
    config = result["config"]
    lines = []
    for model in config["models"]:
        rows = {
            r["contender"]: r
            for r in result["rows"]
            if r["setting"] == setting
            and device_of(r) == "cpu"
            and r["model"] == model
            and r.get("micro_batch", config["micro_batch"]) == config["micro_batch"]
            and "seconds_per_micro_batch" in r
        }
        for name, row in rows.items():
            if row["role"] in ("big_batch", "gradients_only"):
                continue  # Not an optimizer pass per micro-batch.
            lines.append(_cost_line(model, name, row, rows.get("gradients_only"), config["steps"]))
    return lines
