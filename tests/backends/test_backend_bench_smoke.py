"""Smoke test of scripts/backend_bench.py: --quick, one model, in a subprocess.

JAX only (`.ci/backends` runs tests/backends under `KERAS_BACKEND=jax`);
skipped under the other backends. Checks the output's shape, never a time
or a ratio.
"""

import json
import os
import pathlib
import subprocess
import sys

import keras
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="scripts/backend_bench.py runs under JAX only"
)

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "backend_bench.py"
ARMS = {"keras_gas", "grad_accum", "update_adam", "invariant", "plain_adam"}


def test_quick_run_writes_every_arm(tmp_path):
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--quick",
            "--models=mlp",
            "--rounds=1",
            "--micro_batches=4",
            f"--output={tmp_path}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "results.json").read_text())
    assert (tmp_path / "results.md").exists()
    rows = result["rows"]
    assert {row["arm"] for row in rows} == ARMS
    assert {row["model"] for row in rows} == {"mlp"}
    for row in rows:
        assert row["ms_median"] > 0
        assert all(t > 0 for t in row["ms_per_micro_batch"])
        assert row["params"] > 0
        memory = row["memory"]
        if memory["available"]:
            assert memory["temp_bytes"] >= 0 and memory["argument_bytes"] > 0
        else:
            assert row["peak_rss_bytes"] > 0
    assert "| mlp | plain_adam |" in (tmp_path / "results.md").read_text()
