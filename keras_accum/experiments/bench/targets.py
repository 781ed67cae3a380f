"""The targets of the speed issue, each checked case by case.

`evaluate_targets(result)` returns one dict per case: target id, where
(setting, model, micro-batch, contender), the measured value, the threshold
and whether it is met (True / False; None when it cannot be measured, with
the reason in "note"). `summarize` folds the cases into one line per target.
"""

from keras_accum.experiments.bench.config import SETTINGS, device_of, place

# id -> (what the issue asks, unit of the value).
TARGETS = {
    "ga_vs_keras": ("GradientAccumulation <= 1.00x Keras's built-in accumulation", "x"),
    "ga_vs_limit": ("GradientAccumulation within 5% of the limit at b >= 256, 10% below", "x"),
    "ia_vs_keras": ("InvariantAdam <= 1.00x Keras's accumulation (XLA), <= 1.10x (graph)", "x"),
    "ia_slots": ("InvariantAdam keeps 2 float32 slots (8 bytes / parameter)", "B/param"),
    "uaa_vs_adam": ("UpdateAccumulationAdam <= 1.10x plain Adam per micro-batch", "x"),
    "xla_copies": (
        "No parameter-sized copies per micro-batch in the XLA step (beyond Adam's)",
        "params",
    ),
    "memory_state": ("Optimizer state <= Keras's accumulation (bytes / parameter)", "B/param"),
    "memory_tensors": (
        "Peak tensor memory (TensorFlow's allocator) <= Keras's accumulation",
        "MB",
    ),
    "memory_peak": ("Peak RSS over baseline <= Keras's accumulation + 10 MB", "MB"),
    "mirrored_vs_adam": ("MirroredStrategy: each optimizer <= plain Adam per micro-batch", "x"),
    "mirrored_reductions": ("MirroredStrategy: one all-reduce per window", "params/window"),
    "retrace": ("No retracing after warm-up", "traces"),
    "retrace_learning_rate": ("No retracing when the learning rate variable changes", "traces"),
    "retrace_steps": ("No retracing when `steps` changes through a variable", "traces"),
}
OURS = ("gradient_accumulation", "invariant_adam", "update_accumulation_adam")
# Peak RSS is one sample per configuration; allocator noise is ~10 MB.
RSS_ALLOWANCE_MB = 10.0
# Scalars (window weights, counters) reduced beside the parameters.
REDUCTION_ALLOWANCE = 0.01


def _case(target, row, value, threshold, met=None, note=""):
    if met is None and value is not None and threshold is not None:
        met = value <= threshold
    return {
        "target": target,
        "setting": place(row),
        "model": row["model"],
        "micro_batch": row.get("micro_batch"),
        "contender": row["contender"],
        "value": value,
        "threshold": threshold,
        "met": met,
        "note": note,
    }


def _ratio(row, key):
    value = (row.get("ratios") or {}).get(key)
    return None if value is None else value["median"]


def _why_missing(row, rows, role):
    if "error" in row:
        return row["error"]
    ref = next((r for r in rows if r["role"] == role and _same_group(r, row)), None)
    return (ref or {}).get("error", f"no {role} contender in this group")


def _same_group(a, b):
    keys = ("setting", "model", "micro_batch")
    return device_of(a) == device_of(b) and all(a.get(k) == b.get(k) for k in keys)


def _single_device(row):
    setting = SETTINGS.get(row["setting"])
    return setting is not None and setting.replicas == 1


def _ratio_cases(rows, config):
    """The time targets: ratios against Keras, Adam and the limit."""
    cases = []
    for row in rows:
        name, single = row["contender"], _single_device(row)
        b = row.get("micro_batch") or config["micro_batch"]
        jit = SETTINGS[row["setting"]].jit_compile if row["setting"] in SETTINGS else False
        checks = []
        if name == "gradient_accumulation" and single:
            checks += [("ga_vs_keras", "vs_keras_accumulation", 1.0, "keras")]
            checks += [("ga_vs_limit", "vs_limit", 1.05 if b >= 256 else 1.10, "adam")]
        if name == "invariant_adam" and single:
            checks += [("ia_vs_keras", "vs_keras_accumulation", 1.0 if jit else 1.10, "keras")]
        if name == "update_accumulation_adam":
            checks += [("uaa_vs_adam", "vs_adam", 1.10, "adam")]
        if name in OURS and not single:
            checks += [("mirrored_vs_adam", "vs_adam", 1.0, "adam")]
        for target, key, threshold, role in checks:
            value = _ratio(row, key)
            note = "" if value is not None else _why_missing(row, rows, role)
            cases.append(_case(target, row, value, threshold, note=note))
    return cases


def _retrace_cases(rows):
    cases = []
    for target, key in (
        ("retrace", "retraces"),
        ("retrace_learning_rate", "retraces_learning_rate"),
        ("retrace_steps", "retraces_steps"),
    ):
        for row in rows:
            if "error" in row or key not in row:
                continue
            if target == "retrace_steps" and row["contender"] not in OURS:
                continue  # Keras's own `steps` are Python ints by design.
            value = row[key]
            note = "" if value is not None else "pending: not probed in this run"
            cases.append(_case(target, row, value, 0, note=note))
    return cases


def _memory_cases(rows, config):
    """Optimizer state and peak RSS (graph, main micro-batch) against
    Keras's accumulation on the same model and device; InvariantAdam's two
    slots."""
    cases = []
    devices = sorted({device_of(r) for r in rows})
    for device, model in ((d, m) for d in devices for m in config["models"]):
        group = {
            r["contender"]: r
            for r in rows
            if r["model"] == model
            and device_of(r) == device
            and r["setting"] == "graph"
            and r.get("micro_batch", config["micro_batch"]) == config["micro_batch"]
        }
        keras_row = group.get("keras_accumulation", {})
        for name in OURS:
            row = group.get(name)
            if row is None or "bytes_per_param" not in row:
                continue
            if name == "invariant_adam":
                value = row["bytes_per_param"]
                cases.append(_case("ia_slots", row, value, 8.0, met=value == 8.0))
            limit = keras_row.get("bytes_per_param")
            note = "" if limit is not None else "Keras's accumulation not measured"
            cases.append(_case("memory_state", row, row["bytes_per_param"], limit, note=note))
            rss, keras_rss = row.get("rss") or {}, keras_row.get("rss") or {}
            if "peak_mb" in rss and "peak_mb" in keras_rss:
                value = rss["peak_mb"] - rss["baseline_mb"]
                limit = keras_rss["peak_mb"] - keras_rss["baseline_mb"] + RSS_ALLOWANCE_MB
                cases.append(_case("memory_peak", row, value, limit))
    for row in rows:  # peak tensor memory, in graph and XLA
        if row["contender"] not in OURS or "tensor_memory" not in row:
            continue
        keras_row = next(
            (r for r in rows if r["contender"] == "keras_accumulation" and _same_group(r, row)),
            None,
        )
        limit = ((keras_row or {}).get("tensor_memory") or {}).get("peak_mb")
        note = "" if limit is not None else "Keras's accumulation not measured"
        value = row["tensor_memory"].get("peak_mb")
        cases.append(_case("memory_tensors", row, value, limit, note=note))
    return cases


def _reduction_cases(rows, config):
    """Elements all-reduced per window, in parameters: N x (every micro-step)
    + (in the window-end conditional)."""
    cases = []
    for row in rows:
        counts = row.get("reductions")
        if counts is None or row["contender"] not in OURS + ("adam",):
            continue
        per_window = (
            config["steps"] * counts.get("every_step_elements", 0)
            + counts.get("conditional_elements", 0)
        ) / row["params"]
        calls = config["steps"] * counts.get("every_step_calls", 0) + counts.get(
            "conditional_calls", 0
        )
        note = f"{calls} reduction{'' if calls == 1 else 's'} per window"
        if row["contender"] == "adam":
            note += " (reference, not a target)"
            cases.append(_case("mirrored_reductions", row, per_window, None, met=None, note=note))
            continue
        cases.append(
            _case("mirrored_reductions", row, per_window, 1 + REDUCTION_ALLOWANCE, note=note)
        )
    return cases


def _copy_cases(copies):
    """Parameter-sized copies that run every micro-step: those of the entry
    computation plus those in conditional branches (the window-end
    conditional's not-taken branch runs N - 1 times in N), beyond plain
    Adam's on the same model (layout copies of the model's own step)."""
    cases = []
    per_step = {
        (device_of(c), c["model"], c["contender"]): c["entry"] + c["branches"]
        for c in copies
        if "error" not in c
    }
    for c in copies:
        if c["contender"] not in OURS:
            continue
        row = {"setting": "xla", "model": c["model"], "contender": c["contender"]}
        row["device"] = device_of(c)
        if "error" in c:
            cases.append(_case("xla_copies", row, None, COPY_ALLOWANCE, note=c["error"]))
            continue
        adam = per_step.get((device_of(c), c["model"], "adam"))
        value = per_step[(device_of(c), c["model"], c["contender"])] - (adam or 0.0)
        note = "" if adam is not None else "plain Adam's copies not measured: not subtracted"
        cases.append(_case("xla_copies", row, value, COPY_ALLOWANCE, note=note))
    return cases


# Elements / parameters copied per step beyond plain Adam's that still
# count as "none" (scalars and small tensors).
COPY_ALLOWANCE = 0.05


def evaluate_targets(result):
    """Every case of every target in `TARGETS` that `result` measured."""
    rows, config = result["rows"], result["config"]
    return (
        _ratio_cases(rows, config)
        + _memory_cases(rows, config)
        + _copy_cases(result.get("xla_copies") or [])
        + _reduction_cases(rows, config)
        + _retrace_cases(rows)
    )


def _where(case):
    parts = [case["setting"], case["model"]]
    if case["micro_batch"]:
        parts.append(f"b={case['micro_batch']}")
    return "/".join(parts + [case["contender"]])


def summarize(cases):
    """One line per target: cases met, worst value and where, verdict."""
    lines = []
    for target, (title, unit) in TARGETS.items():
        mine = [c for c in cases if c["target"] == target and c["threshold"] is not None]
        measured = [c for c in mine if c["value"] is not None]
        met = [c for c in measured if c["met"]]
        if not measured:
            note = next((c["note"] for c in mine if c["note"]), "not measured in this run")
            verdict = "pending" if note.startswith("pending") else "n/a"
            lines.append({"target": title, "verdict": verdict, "numbers": note, "unit": unit})
            continue
        worst = max(measured, key=lambda c: c["value"] - c["threshold"])
        best = min(measured, key=lambda c: c["value"] - c["threshold"])
        verdict = "met" if len(met) == len(measured) else "missed"
        numbers = (
            f"{len(met)}/{len(measured)} cases met; worst {_fmt(worst['value'])} {unit} "
            f"({_where(worst)}, limit {_fmt(worst['threshold'])}); "
            f"best {_fmt(best['value'])} ({_where(best)})"
        )
        if len(measured) < len(mine):
            numbers += f"; {len(mine) - len(measured)} not measurable"
        lines.append({"target": title, "verdict": verdict, "numbers": numbers, "unit": unit})
    return lines


def _fmt(value):
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)
