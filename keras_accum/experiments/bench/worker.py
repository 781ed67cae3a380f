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
import tempfile

from keras_accum.experiments import child
from keras_accum.experiments.bench.config import SETTINGS, BenchConfig, log


def run_worker(task, config, timeout=3600):
    """Runs `task` (a dict with "kind": "group", "rss", "tensor_memory" or
    "xla_copies") in a fresh Python; returns its JSON result. RuntimeError
    if it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        task = dict(task, tmp=tmp)
        payload = json.dumps({"task": task, "config": dataclasses.asdict(config)})
        env = {}
        if task["kind"] == "xla_copies":  # read by XLA when it first compiles
            env = child.xla_dump(os.path.join(tmp, "hlo"))
        if task["kind"] == "tensor_memory":
            env = child.BFC
        return child.run("keras_accum.experiments.bench", payload, env=env, timeout=timeout)


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
    print(json.dumps(result), flush=True)
