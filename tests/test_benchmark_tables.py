"""BENCHMARKS.md's before/after tables of `scripts/backend_bench.py` are
the raw files' numbers: every row `scripts/backend_table.py` prints from
docs/benchmarks/rule_driver/ stands in BENCHMARKS.md as printed."""

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RAW = ROOT / "docs" / "benchmarks" / "rule_driver"
sys.path.insert(0, str(ROOT / "scripts"))

import backend_table  # noqa: E402


def _load(name):
    path = RAW / f"backend_bench_{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


@pytest.mark.parametrize("backend", ["torch", "jax", "tensorflow"])
def test_every_row_of_the_table_is_the_raw_files(backend):
    after = _load(f"{backend}_after")
    assert after is not None, f"no raw file for {backend}"
    assert after["backend"] == backend and after["rounds"] == 9
    before = _load(f"{backend}_before")
    rows = backend_table.table(before, after).splitlines()[2:]
    assert len(rows) == 10  # two models x five arms
    text = (ROOT / "BENCHMARKS.md").read_text()
    if backend == "tensorflow":
        # Not tabled (scheduler-bound on one core): the numbers the text cites.
        ms = {(r["model"], r["arm"]): r["ms_per_micro_batch"] for r in after["rows"]}
        plain = ms[("mlp", "plain_adam")]
        assert f"{min(plain):.1f}-{max(plain):.1f} ms" in text
        every = [x for values in ms.values() for x in values]
        high = [x for x in every if x > 20.0]
        low = [x for x in every if x < 11.0]
        middle = [x for x in every if 11.0 <= x <= 20.0]
        assert (len(every), len(high), len(low), len(middle)) == (90, 69, 19, 2)
        assert f"69 at {min(high):.2f}-{max(high):.2f} ms" in text
        assert f"19 at {min(low):.2f}-{max(low):.2f} ms" in text
        assert f"2 near {sum(middle) / 2:.1f}" in text
        both = _load("tensorflow_after_2cores")
        assert both["device"]["cpu_affinity"] == [0, 1]
        every = [x for r in both["rows"] for x in r["ms_per_micro_batch"]]
        high, low = [x for x in every if x > 15.0], [x for x in every if x <= 15.0]
        assert (
            f"{len(high)} of {len(every)} rounds at {min(high):.2f}-{max(high):.2f} ms, "
            f"{len(low)} at {min(low):.2f}-{max(low):.2f} ms"
        ) in " ".join(text.split())
        return
    for row in rows:
        assert row in text, row


def test_the_before_runs_are_the_old_library_and_the_after_runs_this_one():
    for backend in ("torch", "jax"):
        before, after = _load(f"{backend}_before"), _load(f"{backend}_after")
        assert before["git"]["commit"].startswith("1f01bb0")
        assert after["git"]["commit"].startswith("c3deb3c")
