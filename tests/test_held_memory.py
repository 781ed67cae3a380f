"""No parameter-sized buffer held by the compiled step between calls.

Graph mode folds a `tf.zeros_like` of a known shape into a constant that
lives as long as the compiled function, whether the branch that uses it
runs or not: the branches that zero the window state (a dropped window, a
skipped first micro-batch) held one parameter-sized buffer for good, and so
did the noise-scale probe's loop (its running sum started from
`tf.zeros_like`). They now write `_execution.zeros_like_state` (x * 0, NaN and Inf
included). This reads TensorFlow's own allocator in a fresh process
(tests/_held_memory.py), with a control that zeroes with `tf.zeros_like` and
must show the buffer.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL_BYTES = 1024 * 2048 * 4


@pytest.fixture(scope="module")
def held():
    env = dict(os.environ, PYTHONPATH=ROOT)
    script = os.path.join(ROOT, "tests", "_held_memory.py")
    done = subprocess.run(
        [sys.executable, script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_probe_sees_a_constant_held_by_a_branch(held):
    assert held["control_zeros_like"] >= KERNEL_BYTES


@pytest.mark.parametrize(
    "name",
    [
        "gradient_accumulation",
        "gradient_accumulation_skip_micro_batch",
        "invariant_adam",
        "update_accumulation_adam",
        "noise_scale_probe",
    ],
)
def test_no_parameter_sized_buffer_held_after_the_calls(held, name):
    assert held[name] < KERNEL_BYTES / 4
