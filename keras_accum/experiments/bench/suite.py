"""The whole run: every timed group, then memory and XLA copies in
subprocesses, then the targets."""

import dataclasses
import os
import platform
import time

import keras
import tensorflow as tf

import keras_accum as ka
from keras_accum.experiments.bench import group, worker
from keras_accum.experiments.bench.config import SETTINGS, BenchConfig, device_of, log
from keras_accum.experiments.bench.targets import OURS, evaluate_targets


def machine_info():
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "accelerator": accelerators(),
        "load": ", ".join(f"{x:.2f}" for x in os.getloadavg()),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "keras_accum": ka.__version__,
        "platform": platform.platform(),
    }


def accelerators():
    """The GPUs TensorFlow sees, by name ("none" without one): groups with
    one replica run there (`config.run_device`)."""
    names = []
    for gpu in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(gpu)
        names.append(f"{gpu.name.split(':', 1)[-1]} {details.get('device_name', '')}".strip())
    return ", ".join(names) or "none"


def _timed_rows(config):
    rows = []
    for setting, micro_batch in config.groups() if config.timing else ():
        for model_name in config.models:
            log(f"== {setting} / {model_name} / b={micro_batch}")
            if SETTINGS[setting].replicas > 1:
                task = {
                    "kind": "group",
                    "setting": setting,
                    "model": model_name,
                    "micro_batch": micro_batch,
                }
                rows += worker.run_worker(task, config)
            else:
                rows += group.run_group(model_name, setting, config, micro_batch)
    return rows


def run(config=None):
    """Runs the benchmark; returns {"config", "machine", "rows", ...}."""
    config = (config or BenchConfig()).resolved()
    machine = machine_info()
    started = time.time()
    rows = _timed_rows(config)
    rss = []
    if config.rss:
        rss = [
            dict(found["result"], model=found["model"], contender=found["contender"])
            for found in worker.per_contender("rss", "peak RSS", config)
        ]
    tensors = []
    if config.rss:
        settings = [s for s in ("graph", "xla") if s in config.settings]
        tensors = [
            dict(found["result"], model=found["model"], contender=found["contender"])
            for found in worker.per_contender(
                "tensor_memory", "peak tensor memory", config, settings=settings
            )
        ]
    copies = []
    if config.xla_copies:
        # Only the optimizers: the references' copies are not targets.
        names = [n for n in config.contenders if n in OURS + ("adam", "keras_accumulation")]
        copies = [
            dict(found["result"], model=found["model"], contender=found["contender"])
            for found in worker.per_contender("xla_copies", "XLA copies", config, names)
        ]
    result = {
        "config": dataclasses.asdict(config),
        "machine": machine,
        "rows": rows,
        "xla_copies": copies,
        "rss": rss,
        "tensor_memory": tensors,
        "seconds": time.time() - started,
    }
    attach_rss(result)
    result["targets"] = evaluate_targets(result)
    return result


def attach_rss(result):
    """Puts each peak-RSS measurement on its graph-mode row at the main
    micro-batch, each peak tensor memory on its setting's row there (the
    memory table and targets read them there), on the same device."""
    found = {(device_of(r), r["model"], r["contender"]): r for r in result.get("rss") or []}
    tensors = {
        (r.get("setting"), device_of(r), r["model"], r["contender"]): r
        for r in result.get("tensor_memory") or []
    }
    b = result["config"]["micro_batch"]
    for row in result["rows"]:
        if row.get("micro_batch", b) != b:
            continue
        key = (device_of(row), row["model"], row["contender"])
        if row["setting"] == "graph" and key in found:
            row["rss"] = found[key]
        if (row["setting"], *key) in tensors:
            row["tensor_memory"] = tensors[(row["setting"], *key)]


def merge_results(results):
    """One result from several runs (e.g. one per setting, run one after
    the other): rows and copies concatenated, a group timed in several runs
    pooled into one row per contender (`group.pool_runs`), the config's
    model, contender and setting lists united, wall times summed; targets
    recomputed. Runs of another window size `steps` are refused."""
    first = results[0]
    config = dict(first["config"])
    steps = [result["config"]["steps"] for result in results]
    if any(s != steps[0] for s in steps):
        raise ValueError(f"Cannot merge runs with different `steps` (N). Received: steps={steps}")
    for key in ("models", "contenders", "settings", "limit_settings"):
        union = []
        for result in results:
            union += [n for n in result["config"][key] if n not in union]
        config[key] = union
    merged = {
        "config": config,
        "machine": dict(
            first["machine"],
            load="; ".join(r["machine"].get("load", "?") for r in results),
        ),
        "machines": [m for r in results for m in r.get("machines") or [r["machine"]]],
        "rows": group.pool_runs([result["rows"] for result in results], steps[0]),
        "xla_copies": [c for result in results for c in result.get("xla_copies") or []],
        "rss": [r for result in results for r in result.get("rss") or []],
        "tensor_memory": [r for result in results for r in result.get("tensor_memory") or []],
        "seconds": sum(result["seconds"] for result in results),
        "command": "\n".join(r.get("command") or "" for r in results),
    }
    attach_rss(merged)
    merged["targets"] = evaluate_targets(merged)
    return merged
