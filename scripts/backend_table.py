"""Prints BENCHMARKS.md's before/after table of `scripts/backend_bench.py`
runs: one row per model and arm, the milliseconds per micro-batch and the
ratios to Keras's accumulation and to plain Adam, median (min-max) over
the rounds, from the raw JSON files (a missing "before" prints as -).

    python scripts/backend_table.py \\
        --before=docs/benchmarks/rule_driver/backend_bench_torch_before.json \\
        --after=docs/benchmarks/rule_driver/backend_bench_torch_after.json

With `--digests=BEFORE.txt,AFTER.txt` (two outputs of
`scripts/step_digest.py`) it prints instead the lines whose operations
changed, with their op counts, and how many stayed identical.

tests/test_benchmark_tables.py checks that BENCHMARKS.md holds these rows.
"""

import json
import sys

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("before", None, "results.json of the run before the change (optional).")
flags.DEFINE_string("after", None, "results.json of the run after it.")
flags.DEFINE_list("digests", None, "Two scripts/step_digest.py outputs: before,after.")

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


DIGEST_HEADER = "| set-up | mode | width | ops before | ops after |\n|---|---|---|---|---|"


def digest_table(before, after):
    """(markdown table of the lines of two `step_digest.py` outputs whose
    digest changed, the number of lines that are identical)."""

    def lines(text):
        return {tuple(x.split()[:3]): x.split()[3:] for x in text.splitlines() if x.strip()}

    old, new = lines(before), lines(after)
    assert old.keys() == new.keys(), "the two outputs list other set-ups"
    rows, same = [DIGEST_HEADER], 0
    for key, (digest, count, *_) in new.items():
        if old[key][0] == digest:
            same += 1
        else:
            rows.append("| " + " | ".join([*key, old[key][1], count]) + " |")
    return "\n".join(rows), same


def load(path):
    if path is None:
        return None
    with open(path) as f:
        return json.load(f)


def main(argv):
    if len(argv) > 1:
        sys.exit(f"Unexpected arguments {argv[1:]}; flags are --name=value.")
    if FLAGS.digests:
        before, after = (open(path).read() for path in FLAGS.digests)
        rows, same = digest_table(before, after)
        print(rows)
        print(f"{same} of {len(after.splitlines())} lines identical")
        return
    if FLAGS.after is None:
        sys.exit("--after is required: a results.json of scripts/backend_bench.py")
    print(table(load(FLAGS.before), load(FLAGS.after)))


if __name__ == "__main__":
    app.run(main)
