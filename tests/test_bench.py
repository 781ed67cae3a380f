"""Smoke test of the benchmark: format and exact quantities, never a time.

Runs `keras_accum.experiments.bench` in quick mode in-process (tiny sizes;
conftest.py gives two logical CPUs, so a mirrored group runs here too) and
checks the shape of what it reports. The assertions on numbers are exact
quantities: optimizer bytes per parameter (InvariantAdam keeps two float32
slots), trace counts, and the elements all-reduced per micro-step under
MirroredStrategy. The target logic is checked on hand-made results.
"""

import csv
import dataclasses
import io
import json
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from conftest import mirrored_strategy

from keras_accum.experiments import bench
from keras_accum.experiments.bench import config as bench_config
from keras_accum.experiments.bench import (
    contenders,
    group,
    memory,
    report,
    runner,
    targets,
    worker,
    workloads,
)

CONFIG = bench.BenchConfig(
    quick=True,
    models=("cnn",),
    settings=("graph",),
    limit_micro_batch=0,
    rss=False,
    xla_copies=False,
)


@pytest.fixture(scope="module")
def result():
    return bench.run(CONFIG)


def test_rows_and_machine_name_the_device(result):
    # One-replica groups run where TensorFlow places the step: the GPU when
    # it sees one (the names in "accelerator"), else the CPU.
    gpus = tf.config.list_physical_devices("GPU")
    accelerator = result["machine"]["accelerator"]
    assert (accelerator == "none") == (not gpus)
    assert accelerator.count("GPU:") == len(gpus)
    assert {row["device"] for row in result["rows"]} == {"gpu" if gpus else "cpu"}


def test_every_contender_has_finite_positive_ratios(result):
    rows = {row["contender"]: row for row in result["rows"]}
    assert set(rows) == set(CONFIG.contenders)
    for name, row in rows.items():
        assert "error" not in row, (name, row.get("error"))
        assert row["seconds_per_micro_batch"] > 0
        assert math.isfinite(row["final_loss"])
        assert len(row["samples"]) == CONFIG.resolved().repeats
        for key, ratio in row["ratios"].items():
            assert ratio is not None, (name, key)
            for value in ratio.values():
                assert math.isfinite(value) and value > 0, (name, key, ratio)
    # Reference contenders are 1 against themselves, exactly.
    assert rows["adam"]["ratios"]["vs_adam"]["median"] == 1.0
    assert rows["keras_accumulation"]["ratios"]["vs_keras_accumulation"]["median"] == 1.0


def test_no_retracing_after_warm_up_or_a_learning_rate_or_steps_change(result):
    for row in result["rows"]:
        assert row["retraces"] == 0, row["contender"]
        assert row["retraces_learning_rate"] == 0, row["contender"]
        if row["role"] == "ours":  # `steps` held in a variable (AdaptiveSteps)
            assert row["retraces_steps"] == 0, row["contender"]


def test_optimizer_bytes_per_parameter(result):
    rows = {row["contender"]: row for row in result["rows"]}
    # Two float32 slots (m, v) and nothing else parameter-sized.
    assert rows["invariant_adam"]["bytes_per_param"] == 8.0
    assert rows["adam"]["bytes_per_param"] == 8.0
    # One accumulator more.
    assert rows["gradient_accumulation"]["bytes_per_param"] == 12.0
    assert rows["keras_accumulation"]["bytes_per_param"] == 12.0
    assert rows["update_accumulation_adam"]["bytes_per_param"] == 12.0
    assert rows["gradients_only"]["bytes_per_param"] == 0.0


def test_markdown_and_files(result, tmp_path):
    text = bench.markdown(result, "python scripts/bench.py --quick")
    for columns in (
        report.SUMMARY_COLUMNS,
        report.RATIO_COLUMNS,
        report.TARGET_COLUMNS,
        report.MEMORY_COLUMNS,
    ):
        assert "| " + " | ".join(columns) + " |" in text
    b = CONFIG.resolved().micro_batch
    for name in CONFIG.contenders:
        assert f"| graph | cnn | {b} | {name} |" in text
    for title, _ in targets.TARGETS.values():
        assert f"| {title} |" in text  # One summary line per target.
    bench.write_outputs(result, str(tmp_path), "python scripts/bench.py")
    assert {p.name for p in tmp_path.iterdir()} == {
        "results.md",
        "results.json",
        "samples.csv",
        "config.json",
    }
    with open(tmp_path / "samples.csv") as f:
        samples = list(csv.DictReader(f))
    assert len(samples) == len(CONFIG.contenders) * CONFIG.resolved().repeats
    assert all(float(s["seconds_per_micro_batch"]) > 0 for s in samples)


def test_merged_runs_pool_a_group_timed_twice(result):
    # The same group from two runs (processes): one row per contender,
    # every round of both, the same number of per-row target cases.
    merged = bench.merge_results([result, result])
    assert len(merged["rows"]) == len(result["rows"])
    for row, once in zip(merged["rows"], result["rows"]):
        assert row["contender"] == once["contender"]
        assert row["samples"] == once["samples"] * 2
        assert row["processes"] == 2
        # Each round's ratio twice: the same median, exactly.
        for key, ratio in once["ratios"].items():
            assert row["ratios"][key]["median"] == ratio["median"], (row["contender"], key)

    def per_row(r):
        return [t for t in r["targets"] if t["target"].startswith("retrace")]

    assert len(per_row(merged)) == len(per_row(result)) > 0
    assert merged["config"]["models"] == list(CONFIG.models)
    assert f"| {2 * CONFIG.resolved().repeats} (2 runs) |" in bench.markdown(merged)


ROLES = {"keras_accumulation": "keras", "adam": "adam", "gradients_only": "gradients_only"}


def _run_rows(samples, steps, retraces=0):
    """Rows of one hand-made timed group, ratios as `run_group` adds them."""
    rows = {
        name: {
            "setting": "graph",
            "model": "mlp",
            "micro_batch": 32,
            "contender": name,
            "role": ROLES.get(name, "ours"),
            "samples": list(values),
            "seconds_per_micro_batch": float(np.median(values)),
            "examples_per_second": 32 / float(np.median(values)),
            "retraces": retraces,
            "retraces_learning_rate": 0,
        }
        for name, values in samples.items()
    }
    group.add_ratios(rows, samples, steps)
    return list(rows.values())


def test_pooled_ratios_are_medians_over_every_runs_rounds():
    steps = 4
    run_1 = {
        "keras_accumulation": [1.0, 2.0, 4.0],
        "adam": [2.0, 2.5, 3.0],
        "gradients_only": [0.5, 1.0, 1.5],
        "gradient_accumulation": [1.5, 1.0, 5.0],
    }
    run_2 = {
        "keras_accumulation": [3.0, 1.0],
        "adam": [1.0, 4.0],
        "gradients_only": [0.25, 2.0],
        "gradient_accumulation": [6.0, 9.0],
    }
    rows = group.pool_runs([_run_rows(run_1, steps), _run_rows(run_2, steps, retraces=1)], steps)
    pooled = {row["contender"]: row for row in rows}
    assert list(pooled) == list(run_1)
    ga = pooled["gradient_accumulation"]
    both = {n: np.array(run_1[n] + run_2[n]) for n in run_1}
    assert ga["samples"] == run_1["gradient_accumulation"] + run_2["gradient_accumulation"]
    assert ga["seconds_per_micro_batch"] == np.median(both["gradient_accumulation"])
    assert ga["processes"] == 2 and ga["retraces"] == 1
    # Each round's ratio within its run, the median over both runs' rounds
    # (chosen so that neither run alone has the pooled median).
    vs_keras = both["gradient_accumulation"] / both["keras_accumulation"]
    assert ga["ratios"]["vs_keras_accumulation"]["median"] == pytest.approx(np.median(vs_keras))
    limit = both["gradients_only"] + (both["adam"] - both["gradients_only"]) / steps
    expected = np.median(both["gradient_accumulation"] / limit)
    assert ga["ratios"]["vs_limit"]["median"] == pytest.approx(expected)
    for key in ("vs_keras_accumulation", "vs_limit"):
        first = {r["contender"]: r for r in _run_rows(run_1, steps)}
        alone = first["gradient_accumulation"]["ratios"][key]["median"]
        assert ga["ratios"][key]["median"] != pytest.approx(alone)
    assert ga["ratios"]["vs_big_batch"] is None  # no big_batch in either run


def test_a_gpu_run_is_reported_beside_the_cpu_run_never_pooled_with_it():
    # The same group timed on the CPU and, in a run on a GPU machine, on the
    # GPU: two groups, each ratio from its own device's rounds, each target
    # case against the Keras row of its own device, both machines named.
    steps = 4
    cpu = {"keras_accumulation": [2.0, 2.0, 2.0], "gradient_accumulation": [1.0, 3.0, 2.2]}
    gpu = {"keras_accumulation": [1.0, 1.0], "gradient_accumulation": [0.5, 0.7]}
    config = {"models": ["mlp"], "contenders": list(cpu), "settings": ["graph"]}
    config.update(limit_settings=[], micro_batch=32, steps=steps, repeats=3)
    gpu_rows = [dict(row, device="gpu") for row in _run_rows(gpu, steps)]
    machine = {"nproc": 2, "cpu": "AMD EPYC", "accelerator": "none", "load": "1"}
    machine.update(tensorflow="2", keras="3", python="3", keras_accum="0", platform="Linux")
    runs = [
        {"config": config, "machine": machine, "rows": _run_rows(cpu, steps), "seconds": 1.0},
        {
            "config": config,
            "machine": dict(machine, nproc=16, cpu="Xeon", accelerator="GPU:0 NVIDIA H100"),
            "rows": gpu_rows,
            "seconds": 1.0,
        },
    ]
    merged = bench.merge_results(runs)
    assert len(merged["rows"]) == 4 and all("processes" not in r for r in merged["rows"])
    rows = merged["rows"]
    ga = {bench_config.device_of(r): r for r in rows if r["contender"] != "keras_accumulation"}
    for device, samples in (("cpu", cpu), ("gpu", gpu)):
        expected = np.array(samples["gradient_accumulation"]) / samples["keras_accumulation"]
        ratio = ga[device]["ratios"]["vs_keras_accumulation"]["median"]
        assert ratio == pytest.approx(np.median(expected))
    cases = {t["setting"]: t for t in merged["targets"] if t["target"] == "ga_vs_keras"}
    assert set(cases) == {"graph", "graph on GPU"}
    assert cases["graph"]["value"] == pytest.approx(1.1) and not cases["graph"]["met"]
    assert cases["graph on GPU"]["value"] == pytest.approx(0.6) and cases["graph on GPU"]["met"]
    text = bench.markdown(merged)
    assert "| graph on GPU | mlp | 32 | gradient_accumulation |" in text
    assert "* `nproc`: 2; CPU: AMD EPYC\n" in text
    assert "* `nproc`: 16; CPU: Xeon; GPU: GPU:0 NVIDIA H100\n" in text
    # Peak tensor memory lands on the row of its own device.
    tensors = [
        {"model": "mlp", "contender": "gradient_accumulation", "setting": "graph", "peak_mb": mb}
        for mb in (10.0, 20.0)
    ]
    tensors[1]["device"] = "gpu"
    with_memory = dict(runs[0], rows=[], tensor_memory=tensors, seconds=1.0)
    merged = bench.merge_results(runs + [with_memory])
    peaks = {
        bench_config.device_of(r): r["tensor_memory"]["peak_mb"]
        for r in merged["rows"]
        if "tensor_memory" in r
    }
    assert peaks == {"cpu": 10.0, "gpu": 20.0}


def test_pooling_refuses_runs_that_differ(result):
    run = {"adam": [1.0, 2.0], "gradient_accumulation": [1.0, 1.5]}
    fewer = {"adam": [1.0, 2.0]}
    with pytest.raises(ValueError, match="different contenders"):
        group.pool_runs([_run_rows(run, 4), _run_rows(fewer, 4)], 4)
    other_steps = dict(result, config=dict(result["config"], steps=result["config"]["steps"] + 1))
    with pytest.raises(ValueError, match="different `steps`"):
        bench.merge_results([result, other_steps])


BENCH_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "bench.py"
MARKED = "# Doc\n<!-- bench:main -->\nold\n<!-- /bench:main -->\n"


def _bench_script(*args, cwd):
    return subprocess.run(
        [sys.executable, str(BENCH_SCRIPT), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "args, culprit",
    [
        (["--render=missing.json"], "cannot read 'missing.json'"),
        (["--render=notes.md"], "'notes.md' is not JSON"),
        (["--render=run.json,other_steps.json"], "different `steps`"),
        (["--render=run.json", "--splice=BENCHMARKS.md"], "must be FILE:SECTION"),
        (["--render=run.json", "--splice=notes.md:main"], "notes.md has no <!-- bench:main -->"),
        # A timed run is refused before it measures or writes anything.
        (["--quick", "--output=out", "--splice=notes.md:main"], "notes.md has no"),
        (["--quick", "--output=out", "--splice=gone.md:main"], "cannot read 'gone.md'"),
    ],
    ids=lambda case: str(case)[:40],
)
def test_bench_script_refuses_bad_input_in_one_line(args, culprit, result, tmp_path):
    (tmp_path / "run.json").write_text(json.dumps(dict(result, command="run")))
    other = dict(result, config=dict(result["config"], steps=result["config"]["steps"] + 1))
    (tmp_path / "other_steps.json").write_text(json.dumps(dict(other, command="other")))
    (tmp_path / "notes.md").write_text("# Notes\nno markers\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    done = _bench_script(*args, cwd=tmp_path)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and culprit in last, done.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written
    assert (tmp_path / "notes.md").read_text() == "# Notes\nno markers\n"


def test_bench_script_renders_and_splices_a_saved_run(result, tmp_path):
    (tmp_path / "run.json").write_text(json.dumps(dict(result, command="python bench.py")))
    (tmp_path / "doc.md").write_text(MARKED)
    done = _bench_script("--render=run.json,run.json", "--splice=doc.md:main", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    text = (tmp_path / "doc.md").read_text()
    assert text.startswith("# Doc\n<!-- bench:main -->\n") and "old" not in text
    assert "(2 runs) |" in text and text.endswith("<!-- /bench:main -->\n")


def test_memory_targets_are_met_exactly(result):
    cases = [t for t in result["targets"] if t["target"] in ("ia_slots", "memory_state")]
    assert {t["target"] for t in cases} == {"ia_slots", "memory_state"}
    assert all(t["met"] is True for t in cases)


def test_mirrored_group_counts_reductions_and_records_keras_failure():
    # Keras's built-in accumulation crashes under MirroredStrategy
    # (keras-team/keras#20582): recorded as an error, not raised.
    config = dataclasses.replace(
        CONFIG, contenders=("adam", "keras_accumulation", "gradient_accumulation")
    ).resolved()
    rows = group.run_group("cnn", "mirrored", config, strategy=mirrored_strategy())
    rows = {r["contender"]: r for r in rows}
    assert "error" in rows["keras_accumulation"]
    adam, ours = rows["adam"], rows["gradient_accumulation"]
    assert ours["retraces"] == 0 and ours["bytes_per_param"] == 12.0
    # Adam all-reduces every gradient every micro-step; GradientAccumulation
    # only in the window-end conditional: the window mean, plus its weight
    # and its non-finite flag (one 2-element reduction).
    assert adam["reductions"]["every_step_elements"] == adam["params"]
    assert ours["reductions"].get("every_step_elements", 0) == 0
    assert ours["reductions"]["conditional_elements"] == ours["params"] + 2


def test_transformer_workload_trains_through_sparse_gradients():
    config = dataclasses.replace(CONFIG, models=("transformer",)).resolved()
    fit_runner = runner.FitRunner(
        workloads.WORKLOADS["transformer"],
        contenders.CONTENDERS["gradient_accumulation"],
        config,
        tf.distribute.get_strategy(),
        bench_config.SETTINGS["graph"],
        config.micro_batch,
    )
    _, loss = fit_runner.call(1)
    assert math.isfinite(loss)
    assert fit_runner.params == workloads.WORKLOADS["transformer"].build(quick=True).count_params()
    assert fit_runner.bytes_per_param == 12.0


def test_peak_rss_worker_in_subprocess():
    # Also checks that `python -m keras_accum.experiments.bench` runs a task.
    rss = worker.run_worker(
        {"kind": "rss", "model": "cnn", "contender": "invariant_adam"}, CONFIG.resolved()
    )
    assert rss["peak_mb"] >= rss["baseline_mb"] > 0
    assert rss["bytes_per_param"] == 8.0


def test_count_copies_by_computation():
    hlo = io.StringIO(
        "ENTRY %main (p: f32[4,5]) -> f32[4,5] {\n"
        "  %copy.1 = f32[4,5]{1,0} copy(f32[4,5]{0,1} %p)\n"
        "}\n"
        "%Adam_cond_true_12.3 (a: f32[7]) -> f32[7] {\n"
        "  %copy.2 = f32[7]{0} copy(f32[7]{0} %a)\n"
        "  %add = f32[7]{0} add(%a, %a)\n"
        "}\n"
        "%fused_computation (x: f32[3]) -> f32[3] {\n"
        "  %copy.3 = f32[3]{0} copy(f32[3]{0} %x)\n"
        "}\n"
    )
    assert memory.count_copies(hlo) == {"entry": 20, "branches": 7, "other": 3}


def _row(setting, contender, role, b, **ratios):
    ratios = {k: {"q25": v, "median": v, "q75": v} for k, v in ratios.items()}
    full = {"vs_keras_accumulation": None, "vs_adam": None, "vs_big_batch": None, "vs_limit": None}
    return {
        "setting": setting,
        "model": "m",
        "micro_batch": b,
        "contender": contender,
        "role": role,
        "params": 100,
        "ratios": dict(full, **ratios),
        "retraces": 0,
        "retraces_learning_rate": 0,
        "retraces_steps": None,
    }


def test_targets_thresholds_follow_the_issue():
    rows = [
        _row(
            "graph", "gradient_accumulation", "ours", 32, vs_keras_accumulation=1.0, vs_limit=1.08
        ),
        _row("xla", "gradient_accumulation", "ours", 256, vs_keras_accumulation=0.9, vs_limit=1.08),
        _row("graph", "invariant_adam", "ours", 32, vs_keras_accumulation=1.08),
        _row("xla", "invariant_adam", "ours", 32, vs_keras_accumulation=1.08),
        _row("graph", "update_accumulation_adam", "ours", 32, vs_adam=1.11),
        _row("mirrored", "invariant_adam", "ours", 32, vs_adam=0.5),
    ]
    rows[-1]["reductions"] = {"every_step_elements": 1, "conditional_elements": 100}
    rows.insert(0, _row("mirrored", "adam", "adam", 32))  # a reference: no threshold
    rows[0]["reductions"] = {"every_step_elements": 100}
    result = {"rows": rows, "config": {"models": ("m",), "micro_batch": 32, "steps": 4}}
    met = {
        (t["target"], t["setting"], t["micro_batch"]): t["met"]
        for t in targets.evaluate_targets(result)
    }
    assert met[("ga_vs_keras", "graph", 32)] is True
    assert met[("ga_vs_limit", "graph", 32)] is True  # Within 10% at b = 32.
    assert met[("ga_vs_limit", "xla", 256)] is False  # Not within 5% at 256.
    assert met[("ia_vs_keras", "graph", 32)] is True  # <= 1.10 in graph mode.
    assert met[("ia_vs_keras", "xla", 32)] is False  # <= 1.00 under XLA.
    assert met[("uaa_vs_adam", "graph", 32)] is False
    assert met[("mirrored_vs_adam", "mirrored", 32)] is True
    # 4 x 1 + 100 elements per window over 100 parameters: 1.04 > 1.01.
    assert met[("mirrored_reductions", "mirrored", 32)] is False
    lines = {s["target"]: s["verdict"] for s in targets.summarize(targets.evaluate_targets(result))}
    assert lines[targets.TARGETS["retrace_steps"][0]] == "pending"
    assert lines[targets.TARGETS["retrace"][0]] == "met"
    assert lines[targets.TARGETS["xla_copies"][0]] == "n/a"


@pytest.mark.parametrize(
    "overrides, culprit",
    [
        ({"steps": 0}, "`steps` must be an integer >= 1"),
        ({"models": ("cnn", "resnet")}, "`models[1]` must be one of"),
        ({"contenders": ("adam", "sgd")}, "`contenders[1]` must be one of"),
        ({"limit_settings": ("gpu",)}, "`limit_settings[0]` must be one of"),
        ({"min_sample_seconds": -1.0}, "`min_sample_seconds` must be a finite number"),
    ],
)
def test_bad_config_is_one_line_naming_the_key(overrides, culprit):
    with pytest.raises(ValueError) as error:
        bench.BenchConfig(**overrides)
    assert culprit in str(error.value) and "\n" not in str(error.value)


def test_merge_puts_peak_rss_of_a_memory_run_on_the_timed_rows():
    config = {"models": ["m"], "contenders": [], "settings": [], "limit_settings": []}
    config.update(micro_batch=32, steps=4)
    machine = {"load": "1"}
    rows = [
        _row("graph", name, role, 32)
        for name, role in (("keras_accumulation", "keras"), ("invariant_adam", "ours"))
    ]
    for row in rows:
        row["bytes_per_param"] = 8.0
    timed = {"config": config, "machine": machine, "rows": rows, "seconds": 1.0}
    rss = [
        {"model": "m", "contender": "keras_accumulation", "baseline_mb": 100.0, "peak_mb": 150.0},
        {"model": "m", "contender": "invariant_adam", "baseline_mb": 100.0, "peak_mb": 170.0},
    ]
    memory = {"config": config, "machine": machine, "rows": [], "rss": rss, "seconds": 1.0}
    merged = bench.merge_results([timed, memory])
    peak = next(t for t in merged["targets"] if t["target"] == "memory_peak")
    # 70 MB over baseline against Keras's 50 + the 10 MB allowance.
    assert (peak["value"], peak["threshold"], peak["met"]) == (70.0, 60.0, False)


def test_peak_tensor_memory_worker_counts_the_optimizer_state():
    # TensorFlow's BFC allocator (set in the worker; without it the child's
    # get_memory_info fails) counts every tensor: the peak covers at least
    # the optimizer's state, m and v of 4 bytes each per parameter.
    task = {"kind": "tensor_memory", "model": "cnn", "contender": "invariant_adam"}
    result = worker.run_worker(dict(task, setting="graph"), CONFIG.resolved())
    assert result["per_param"] >= 8.0
    assert result["setting"] == "graph"
    assert result["device"] == ("gpu" if tf.config.list_physical_devices("GPU") else "cpu")


def test_merge_puts_peak_tensor_memory_on_its_setting_row_with_a_verdict():
    config = {"models": ["m"], "contenders": [], "settings": [], "limit_settings": []}
    config.update(micro_batch=32, steps=4)
    machine = {"load": "1"}
    rows = [
        _row(setting, name, role, 32)
        for setting in ("graph", "xla")
        for name, role in (("keras_accumulation", "keras"), ("gradient_accumulation", "ours"))
    ]
    timed = {"config": config, "machine": machine, "rows": rows, "seconds": 1.0}
    peaks = {("graph", "keras_accumulation"): 80.0, ("graph", "gradient_accumulation"): 90.0}
    peaks.update({("xla", "keras_accumulation"): 120.0, ("xla", "gradient_accumulation"): 85.0})
    tensors = [
        {"model": "m", "contender": name, "setting": setting, "peak_mb": mb, "per_param": 1.0}
        for (setting, name), mb in peaks.items()
    ]
    memory = {"config": config, "machine": machine, "rows": [], "tensor_memory": tensors}
    merged = bench.merge_results([timed, dict(memory, seconds=1.0)])
    cases = {
        t["setting"]: (t["value"], t["threshold"], t["met"])
        for t in merged["targets"]
        if t["target"] == "memory_tensors"
    }
    assert cases == {"graph": (90.0, 80.0, False), "xla": (85.0, 120.0, True)}
