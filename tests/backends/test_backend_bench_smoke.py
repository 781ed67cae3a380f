"""Smoke test of scripts/backend_bench.py: --quick, one model, in a subprocess.

Runs the script on the backend this test process runs under (TensorFlow in
the slow tier; JAX and PyTorch through `.ci/backends`). Checks the output's
shape and the identities its numbers must keep (ratios rebuilt from the raw
per-round times, Adam's state bytes from the parameter count), never a time
or a ratio's size.
"""

import json
import os
import pathlib
import subprocess
import sys

import keras
import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "backend_bench.py"
ARMS = ("keras_gas", "grad_accum", "update_adam", "invariant", "plain_adam")
ROUNDS = 2
MICRO_BATCHES = 4
# Adam's scalars in `optimizer.variables`: `iteration` (int32, int64 on
# TensorFlow) and `learning_rate` (float32).
ADAM_SCALAR_BYTES = {"tensorflow": 12}.get(keras.backend.backend(), 8)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The script's quick run on this process's backend: (json, markdown)."""
    out = tmp_path_factory.mktemp("backend_bench")
    env = dict(os.environ, KERAS_BACKEND=keras.backend.backend(), TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--quick",
            "--models=mlp",
            f"--rounds={ROUNDS}",
            f"--micro_batches={MICRO_BATCHES}",
            f"--output={out}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "results.json").read_text()), (out / "results.md").read_text()


def test_runs_on_this_backend_and_names_the_device(run):
    result, report = run
    assert result["backend"] == keras.backend.backend()
    assert result["versions"]["keras"] == keras.__version__
    assert result["device"]["platform"] in ("cpu", "gpu", "cuda")
    assert result["device"]["name"]
    assert result["command"].startswith(f"KERAS_BACKEND={keras.backend.backend()} ")
    assert f"# keras_accum on {keras.backend.backend()}: model.fit" in report


def test_every_arm_has_its_rounds_and_ratios_rebuilt_from_them(run):
    result, report = run
    rows = {row["arm"]: row for row in result["rows"]}
    assert tuple(rows) == ARMS
    assert result["rounds"] == ROUNDS
    for arm, row in rows.items():
        assert row["model"] == "mlp" and row["micro_batches"] == MICRO_BATCHES
        assert row["rounds"] == ROUNDS == len(row["ms_per_micro_batch"])
        assert all(t > 0 for t in row["ms_per_micro_batch"])
        for base in ("keras_gas", "plain_adam"):
            spread = row[f"ratio_to_{base}"]
            expected = [
                t / b for t, b in zip(row["ms_per_micro_batch"], rows[base]["ms_per_micro_batch"])
            ]
            assert spread["rounds"] == pytest.approx(expected, rel=1e-12)
            assert spread["min"] == min(expected) and spread["max"] == max(expected)
            assert min(expected) <= spread["median"] <= max(expected)
        assert f"| mlp | {arm} | " in report
    assert rows["keras_gas"]["ratio_to_keras_gas"]["rounds"] == [1.0] * ROUNDS
    assert rows["plain_adam"]["ratio_to_plain_adam"]["rounds"] == [1.0] * ROUNDS


def test_state_bytes_keep_adams_layout(run):
    result, _ = run
    rows = {row["arm"]: row for row in result["rows"]}
    params = rows["plain_adam"]["params"]
    trainable = 4 * params  # the mlp: every weight float32 and trainable
    for row in rows.values():
        assert row["params"] == params
        assert row["param_bytes"] == row["trainable_bytes"] == trainable
    state = {arm: row["optimizer_state_bytes"] for arm, row in rows.items()}
    # Adam: two moments a parameter; Keras's accumulation: one buffer more.
    assert state["plain_adam"] == 2 * trainable + ADAM_SCALAR_BYTES
    assert state["keras_gas"] == state["plain_adam"] + trainable
    # Ours: a parameter-sized buffer more (accumulated gradient or update)...
    for arm in ("grad_accum", "update_adam"):
        assert state[arm] >= state["plain_adam"] + trainable
    # ...except InvariantAdam, which keeps Adam's two moments and a few scalars.
    assert state["plain_adam"] <= state["invariant"] < state["plain_adam"] + trainable


def test_memory_is_measured_per_arm(run):
    result, _ = run
    for row in result["rows"]:
        probe = row["probe"]
        assert probe["process_peak_rss_bytes"] >= probe["rss_before_fit_bytes"] > 0
        if probe["fit_rss_growth_bytes"] is not None:  # Linux
            assert probe["fit_rss_growth_bytes"] == (
                probe["fit_peak_rss_bytes"] - probe["rss_before_fit_bytes"]
            )
            assert probe["fit_rss_growth_bytes"] >= 0
        if result["device"]["platform"] == "cpu" and result["backend"] != "jax":
            assert probe["device_peak_bytes"] is None and probe["device_peak_source"]
        if result["backend"] == "jax":
            memory = row["xla_memory"]
            assert memory["available"], memory
            assert memory["temp_bytes"] >= 0
            assert memory["argument_bytes"] >= row["trainable_bytes"]
        else:
            assert "xla_memory" not in row
