"""The Markdown report of a run, its files, and splicing into BENCHMARKS.md."""

import csv
import json
import os

from keras_accum.experiments.bench.config import device_of, place
from keras_accum.experiments.bench.targets import TARGETS, summarize
from keras_accum.training import atomic

RATIO_COLUMNS = (
    "setting",
    "model",
    "b",
    "optimizer",
    "ms / micro-batch",
    "examples/s",
    "vs Keras accumulation",
    "vs Adam",
    "vs big batch",
    "vs limit",
    "retraces",
    "rounds",
)
SUMMARY_COLUMNS = ("target", "result", "numbers")
TARGET_COLUMNS = ("target", "setting", "model", "b", "optimizer", "measured", "limit", "met")
MEMORY_COLUMNS = (
    "model",
    "optimizer",
    "optimizer bytes / param",
    "float32 slots",
    "peak RSS MB",
    "RSS over baseline MB",
    "peak tensor MB, graph",
    "peak tensor MB, XLA",
    "peak tensor B / param, graph",
)
REDUCTION_COLUMNS = (
    "model",
    "optimizer",
    "reductions every micro-step (calls, elements / params)",
    "in conditionals (calls, elements / params)",
    "elements / params per window",
)
COPY_COLUMNS = (
    "model",
    "optimizer",
    "copied elements / params: every step (entry)",
    "in conditional branches",
    "elsewhere (fusions, loops)",
)


def table(columns, lines):
    out = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    out += ["| " + " | ".join(str(c).replace("|", "/") for c in line) + " |" for line in lines]
    return "\n".join(out)


def _num(value, fmt):
    return "-" if value is None else format(value, fmt)


def _fmt_ratio(value):
    if value is None:
        return "-"
    return f"{value['median']:.2f} ({value['q25']:.2f}-{value['q75']:.2f})"


def _b(row, config):
    return row.get("micro_batch") or config["micro_batch"]


def _rounds(row):
    """Rounds behind a row: "7", or "14 (2 runs)" when pooled."""
    rounds, runs = len(row.get("samples", ())), row.get("processes", 1)
    return str(rounds) if runs == 1 else f"{rounds} ({runs} runs)"


def _ratio_section(result):
    lines = []
    for row in result["rows"]:
        head = [place(row), row["model"], _b(row, result["config"]), row["contender"]]
        if "error" in row:
            failed = "failed: " + row["error"][:120]
            lines.append(head + [failed] + ["-"] * (len(RATIO_COLUMNS) - 5))
            continue
        r = row["ratios"]
        lines.append(
            head
            + [
                f"{1e3 * row['seconds_per_micro_batch']:.3f}",
                f"{row['examples_per_second']:.0f}",
                _fmt_ratio(r["vs_keras_accumulation"]),
                _fmt_ratio(r["vs_adam"]),
                _fmt_ratio(r["vs_big_batch"]),
                _fmt_ratio(r["vs_limit"]),
                row["retraces"],
                _rounds(row),
            ]
        )
    return ["### Time per micro-batch and ratios", "", table(RATIO_COLUMNS, lines), ""]


def _summary_section(result):
    lines = []
    for s in summarize(result["targets"]):
        verdict = {"missed": "**missed**"}.get(s["verdict"], s["verdict"])
        lines.append([s["target"], verdict, s["numbers"]])
    return ["### Summary: the targets", "", table(SUMMARY_COLUMNS, lines), ""]


def _targets_section(result):
    lines = []
    for t in result["targets"]:
        met = {True: "met", False: "**missed**", None: "n/a"}[t["met"]]
        if t["note"]:
            met += " (" + t["note"][:80] + ")"
        value, limit = t["value"], t["threshold"]
        lines.append(
            [
                TARGETS[t["target"]][0],
                t["setting"],
                t["model"],
                t["micro_batch"] or "-",
                t["contender"],
                "-" if value is None else (f"{value:.3f}" if isinstance(value, float) else value),
                "-" if limit is None else (f"{limit:.2f}" if isinstance(limit, float) else limit),
                met,
            ]
        )
    return ["### Targets, case by case", "", table(TARGET_COLUMNS, lines), ""]


def _model_on(row):
    """The model, and the device when it is not the CPU."""
    device = device_of(row)
    return row["model"] if device == "cpu" else f"{row['model']} ({device.upper()})"


def _memory_section(result):
    config = result["config"]
    lines = []
    for row in result["rows"]:
        main = _b(row, config) == config["micro_batch"]
        if row["setting"] != "graph" or not main or "bytes_per_param" not in row:
            continue
        rss = row.get("rss") or {}
        peak = rss.get("peak_mb")
        xla = next(
            (
                r
                for r in result["rows"]
                if r["setting"] == "xla"
                and _b(r, config) == config["micro_batch"]
                and (device_of(r), r["model"], r["contender"])
                == (device_of(row), row["model"], row["contender"])
            ),
            {},
        )
        tensors = row.get("tensor_memory") or {}
        lines.append(
            [
                _model_on(row),
                row["contender"],
                f"{row['bytes_per_param']:.2f}",
                f"{row['bytes_per_param'] / 4:.2f}",
                _num(peak, ".0f"),
                "-" if peak is None else f"{peak - rss['baseline_mb']:.0f}",
                _num(tensors.get("peak_mb"), ".1f"),
                _num((xla.get("tensor_memory") or {}).get("peak_mb"), ".1f"),
                _num(tensors.get("per_param"), ".1f"),
            ]
        )
    if not lines:
        return []
    return ["### Memory", "", table(MEMORY_COLUMNS, lines), ""]


def _reduction_section(result):
    steps = result["config"]["steps"]
    lines = []
    for row in result["rows"]:
        counts = row.get("reductions")
        if counts is None:
            continue
        every = counts.get("every_step_elements", 0) / row["params"]
        cond = counts.get("conditional_elements", 0) / row["params"]
        lines.append(
            [
                row["model"],
                row["contender"],
                f"{counts.get('every_step_calls', 0)}, {every:.4f}",
                f"{counts.get('conditional_calls', 0)}, {cond:.4f}",
                f"{steps * every + cond:.4f}",
            ]
        )
    if not lines:
        return []
    title = "### Cross-replica reductions traced in the step (MirroredStrategy)"
    return [title, "", table(REDUCTION_COLUMNS, lines), ""]


def _copies_section(result):
    lines = []
    for c in result.get("xla_copies") or ():
        if "error" in c:
            lines.append([_model_on(c), c["contender"], "failed", "-", "-"])
            continue
        entry, branches, other = c["entry"], c["branches"], c.get("other", 0)
        lines.append(
            [_model_on(c), c["contender"], f"{entry:.2f}", f"{branches:.2f}", f"{other:.2f}"]
        )
    if not lines:
        return []
    title = "### XLA copies in the compiled step (elements / parameters)"
    return [title, "", table(COPY_COLUMNS, lines), ""]


def _hardware(machine):
    """`nproc`, CPU and GPU of one machine, one line."""
    line = f"`nproc`: {machine.get('nproc', '?')}; CPU: {machine.get('cpu', '?')}"
    accelerator = machine.get("accelerator") or "none"
    return line + ("" if accelerator == "none" else f"; GPU: {accelerator}")


def _machine_section(result, command):
    machine = result["machine"]
    # A merged report may hold runs made on different machines (a GPU run
    # beside CPU runs): each distinct one is named.
    hardware = []
    for one in result.get("machines") or [machine]:
        if _hardware(one) not in hardware:
            hardware.append(_hardware(one))
    parts = [
        "### Machine",
        "",
        *(f"* {line}" for line in hardware),
        f"* TensorFlow {machine['tensorflow']}, Keras {machine['keras']}, "
        f"Python {machine['python']}, keras_accum {machine['keras_accum']}",
        f"* {machine['platform']}",
        f"* wall time of the run: {result['seconds']:.0f} s",
    ]
    if "load" in machine:
        parts.append(f"* load average (1, 5, 15 min) at the start of each run: {machine['load']}")
    parts.append("")
    if command:
        parts += ["### Command", "", "```", command, "```", ""]
    return parts


def markdown(result, command=None):
    """The Markdown report of a run: machine, command, tables."""
    config = result["config"]
    parts = _machine_section(result, command)
    if result["rows"]:
        parts += [
            f"N = {config['steps']} micro-batches per window, b = examples per "
            f"micro-batch, {config['repeats']} rounds per run; ratios are "
            "medians of per-round ratios (quartiles in brackets); < 1 means "
            "faster. A group timed in several runs (one process each, merged "
            "with `--render`) pools the rounds of all of them, each ratio "
            "taken within its own run (column *rounds*).",
            "",
        ]
    parts += _summary_section(result)
    if result["rows"]:
        parts += _ratio_section(result)
    parts += _targets_section(result)
    for section in (_memory_section, _reduction_section, _copies_section):
        parts += section(result)
    return "\n".join(parts)


def write_outputs(result, directory, command=None):
    """Writes results.md, results.json, samples.csv and config.json, each
    atomically."""
    os.makedirs(directory, exist_ok=True)
    with atomic.replacing(os.path.join(directory, "results.md")) as f:
        f.write(markdown(result, command))
    with atomic.replacing(os.path.join(directory, "results.json")) as f:
        json.dump(dict(result, command=command), f, indent=1)
    with atomic.replacing(os.path.join(directory, "config.json")) as f:
        json.dump({"command": command, "config": result["config"]}, f, indent=1)
    with atomic.replacing(os.path.join(directory, "samples.csv"), newline="") as f:
        writer = csv.writer(f)
        writer.writerow(
            ["setting", "model", "micro_batch", "contender", "round", "seconds_per_micro_batch"]
        )
        for row in result["rows"]:
            b = _b(row, result["config"])
            for i, value in enumerate(row.get("samples", ())):
                writer.writerow([row["setting"], row["model"], b, row["contender"], i, value])


def check_splice(path, section):
    """The content of `path` if it has the `bench:SECTION` markers that
    `splice_markdown` writes between, else ValueError (one line, naming
    the file): checked before a run, so that a typo costs no measurement."""
    begin, end = f"<!-- bench:{section} -->", f"<!-- /bench:{section} -->"
    try:
        with open(path) as f:
            content = f.read()
    except OSError as e:
        raise ValueError(f"cannot read {path!r} for --splice: {e.strerror}") from None
    if begin not in content or end not in content:
        raise ValueError(f"{path} has no {begin} ... {end} section.")
    return content


def splice_markdown(path, section, text):
    """Replaces the text between `<!-- bench:SECTION -->` and
    `<!-- /bench:SECTION -->` in `path` (BENCHMARKS.md) with `text`, so that
    the numbers there are the script's output, never edited by hand."""
    begin, end = f"<!-- bench:{section} -->", f"<!-- /bench:{section} -->"
    content = check_splice(path, section)
    head, rest = content.split(begin, 1)
    _, tail = rest.split(end, 1)
    atomic.atomic_write_text(path, f"{head}{begin}\n{text.strip()}\n{end}{tail}")
