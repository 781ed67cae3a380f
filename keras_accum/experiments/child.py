"""Measurements that need a fresh Python, and the allocator's peak.

A peak-memory high-water mark cannot be split between measurements sharing a
process, TensorFlow reads `TF_CPU_ALLOCATOR_USE_BFC` and XLA its dump flags
once, when they start, and logical CPUs must be set before TensorFlow
initialises. The benchmark (`bench.worker`), `fit_memory` and `remat_bench`
therefore run each such measurement as `python -m MODULE ARGS...` through
`run`, which returns the JSON the child prints last.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

# Before TensorFlow starts: its BFC allocator on the CPU keeps a peak.
BFC = {"TF_CPU_ALLOCATOR_USE_BFC": "true"}
# The child imports this checkout's package, whatever else is installed.
ROOT = str(pathlib.Path(__file__).resolve().parents[2])


def xla_dump(folder: str) -> dict[str, str]:
    """The environment that makes the child's XLA dump its compiled HLO
    (optimised modules and buffer assignments, as text) into `folder`."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={folder} --xla_dump_hlo_as_text"
    return {"XLA_FLAGS": flags.strip()}


def run(module: str, *args: str, env: dict | None = None, timeout: float = 600) -> Any:
    """Runs `python -m module *args` in a fresh process with `env` added to
    this one's; returns the JSON value of the last stdout line that starts
    with `{` or `[`. RuntimeError (naming the module and the last line of
    the child's stderr) if it fails or prints none."""
    child_env = {
        **os.environ,
        "TF_CPP_MIN_LOG_LEVEL": "3",
        **(env or {}),
        "PYTHONPATH": os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
    }
    result = subprocess.run(
        [sys.executable, "-m", module, *args],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [line for line in result.stdout.splitlines() if line[:1] in "{["]
    if result.returncode or not lines:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{module} {' '.join(args)[:200]} failed: {tail}")
    return json.loads(lines[-1])


def allocator() -> str:
    """The device whose allocator holds the training step's tensors."""
    import tensorflow as tf

    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def reset_peak() -> None:
    """Starts the allocator's peak afresh (no-op where it keeps none)."""
    import tensorflow as tf

    try:
        tf.config.experimental.reset_memory_stats(allocator())
    except (ValueError, tf.errors.InvalidArgumentError):
        pass


def memory_info() -> dict[str, int] | None:
    """The allocator's {"current", "peak"} bytes; None where it reports none
    (the default CPU allocator: start the process with `BFC`)."""
    import tensorflow as tf

    try:
        info = tf.config.experimental.get_memory_info(allocator())
    except (ValueError, tf.errors.InvalidArgumentError):
        return None
    return info if info["peak"] else None


def peak_mb() -> float | None:
    """The allocator's peak since `reset_peak` in MB (2 decimals), or None
    where it reports none."""
    info = memory_info()
    return round(info["peak"] / 2**20, 2) if info else None
