"""Prints BENCHMARKS.md's before/after table of `scripts/backend_bench.py`
runs: one row per model and arm, the milliseconds per micro-batch and the
ratios to Keras's accumulation and to plain Adam, median (min-max) over
the rounds, from the raw JSON files (a missing "before" prints as -).

    python scripts/backend_table.py \\
        --before=docs/benchmarks/rule_driver/backend_bench_torch_before.json \\
        --after=docs/benchmarks/rule_driver/backend_bench_torch_after.json

tests/test_benchmark_tables.py checks that BENCHMARKS.md holds these rows.
"""

import json
import sys

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("before", None, "results.json of the run before the change (optional).")
flags.DEFINE_string("after", None, "results.json of the run after it.")

HEADER = (
    "| model | arm | before: ms | before: / Keras's acc. | before: / plain Adam "
    "| after: ms | after: / Keras's acc. | after: / plain Adam |\n"
    "|---|---|---|---|---|---|---|---|"
)


def _ratio(ratio):
    return f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})"


def _cells(row):
    if row is None:
        return ["-", "-", "-"]
    return [
        f"{row['ms_median']:.2f}",
        _ratio(row["ratio_to_keras_gas"]),
        _ratio(row["ratio_to_plain_adam"]),
    ]


def table(before, after):
    """The markdown table (header included) of two results.json dicts;
    `before` may be None."""
    old = {(r["model"], r["arm"]): r for r in (before or {}).get("rows", [])}
    lines = [HEADER]
    for row in after["rows"]:
        key = (row["model"], row["arm"])
        cells = [*key, *_cells(old.get(key)), *_cells(row)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load(path):
    if path is None:
        return None
    with open(path) as f:
        return json.load(f)


def main(argv):
    if len(argv) > 1:
        sys.exit(f"Unexpected arguments {argv[1:]}; flags are --name=value.")
    if FLAGS.after is None:
        sys.exit("--after is required: a results.json of scripts/backend_bench.py")
    print(table(load(FLAGS.before), load(FLAGS.after)))


if __name__ == "__main__":
    app.run(main)
