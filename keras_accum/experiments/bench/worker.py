"""Tasks run in a fresh Python: `python -m keras_accum.experiments.bench
PAYLOAD` (see `__main__.py`).

A peak-memory high-water mark cannot be split between configurations
sharing a process, XLA's dump flags are read once per process, and
MirroredStrategy needs its logical CPUs configured before TensorFlow
initialises: each of these runs in its own subprocess.
"""

import dataclasses
import json
import os
import subprocess
import sys
import tempfile

import keras_accum as ka
from keras_accum.experiments.bench.config import SETTINGS, BenchConfig, log
from keras_accum.training import atomic


def run_worker(task, config, timeout=3600):
    """Runs `task` (a dict with "kind": "group", "rss", "tensor_memory" or
    "xla_copies") in a fresh Python; returns its JSON result. RuntimeError
    if it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        task = dict(task, tmp=tmp)
        payload = json.dumps({"task": task, "config": dataclasses.asdict(config), "out": out})
        env = dict(os.environ)
        if task["kind"] == "xla_copies":
            # Read by XLA when it first compiles, in the child.
            env["XLA_FLAGS"] = f"--xla_dump_to={tmp}/hlo --xla_dump_hlo_as_text"
        if task["kind"] == "tensor_memory":
            # TensorFlow's BFC allocator on the CPU counts its peak.
            env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
        package_root = os.path.dirname(os.path.dirname(ka.__file__))
        env["PYTHONPATH"] = os.pathsep.join(
            [package_root] + [p for p in [env.get("PYTHONPATH")] if p]
        )
        proc = subprocess.run(
            [sys.executable, "-m", "keras_accum.experiments.bench", payload],
            env=env,
            timeout=timeout,
            stdout=subprocess.PIPE,
            text=True,
        )
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"bench worker {task} failed with code {proc.returncode}")
        with open(out) as f:
            return json.load(f)


def per_contender(kind, label, config, contenders=None, settings=(None,)):
    """Runs task `kind` in a fresh subprocess per (model, contender[,
    setting]); a failure is recorded as {"error": ...} instead of stopping
    the run."""
    for model_name in config.models:
        for name, setting in ((n, s) for n in contenders or config.contenders for s in settings):
            where = f"{model_name} / {name}" + (f" / {setting}" if setting else "")
            log(f"{label}: {where} (subprocess)")
            task = {"kind": kind, "model": model_name, "contender": name, "setting": setting}
            try:
                result = run_worker(task, config)
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                result = {"error": str(error)}
            yield {"model": model_name, "contender": name, "result": result}


def main(payload):
    """Subprocess entry: configures devices first, then runs one task."""
    import tensorflow as tf

    from keras_accum.experiments.bench import group, memory

    payload = json.loads(payload)
    task = payload["task"]
    config = BenchConfig.from_dict(payload["config"])
    if task["kind"] == "group":
        replicas = SETTINGS[task["setting"]].replicas
        # Logical CPUs must be configured before TensorFlow initialises.
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * replicas
        )
        result = group.run_group(task["model"], task["setting"], config, task["micro_batch"])
    elif task["kind"] == "tensor_memory":
        result = memory.measure_tensor_memory(
            task["model"], task["contender"], task["setting"], config
        )
    elif task["kind"] == "xla_copies":
        result = memory.measure_xla_copies(
            task["model"], task["contender"], config, os.path.join(task["tmp"], "hlo")
        )
    else:
        result = memory.measure_rss(task["model"], task["contender"], config)
    with atomic.replacing(payload["out"]) as f:  # a killed worker leaves no half file
        json.dump(result, f)
