"""The training script and its configs: smoke runs, resume, error paths."""

import csv
import json
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest

from keras_accum.experiments import experiment

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Configs of scripts/train.py (get_config(smoke=...)); other scripts' configs,
# such as saved_configs/invariance.py, are tested with their own script.
CONFIGS = sorted(
    p for p in (ROOT / "saved_configs").glob("*.py") if "def get_config(smoke" in p.read_text()
)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


def smoke(path, data_dir, **overrides):
    namespace = {}
    exec(path.read_text(), namespace)
    config = namespace["get_config"](smoke=True)
    config.update(data_dir=data_dir, verbose=0, **overrides)
    return config


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_saved_config_runs_in_smoke_size(path, data_dir, tmp_path):
    config = smoke(path, data_dir, epochs=1)
    final = experiment.train_and_evaluate(config, tmp_path / "run")
    run = tmp_path / "run"
    for name in (
        "config.json",
        "metrics.csv",
        "final.json",
        "curves.png",
        "checkpoints/epoch_001.keras",
    ):
        assert (run / name).exists(), name
    assert list((run / "tensorboard").rglob("*tfevents*"))
    resolved = json.loads((run / "config.json").read_text())
    assert resolved == experiment.resolve_config(config)
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    assert len(rows) == 1
    # 4000 examples less those held out for validation, windows of
    # micro_batch_size x steps: whole windows only.
    steps = resolved["steps"]
    micro = resolved["micro_batch_size"]
    train_examples = 4000 - round(4000 * resolved["validation_split"])
    assert int(rows[0]["updates"]) == train_examples // (micro * steps) == final["updates"]
    split = "val_" if resolved["validation_split"] else "test_"
    assert split + "accuracy" in rows[0] and "accuracy" in rows[0]
    assert 0.0 <= final["test_accuracy"] <= 1.0
    assert np.isfinite(final["test_loss"])


def test_resume_continues_exactly(data_dir, tmp_path):
    config = smoke(
        ROOT / "saved_configs/mnist1d_cnn_invariant.py", data_dir, epochs=2, noise_scale_every=0
    )
    experiment.train_and_evaluate(config, tmp_path / "straight")
    # A run that stopped after its first epoch: what it had on disk then.
    experiment.train_and_evaluate(config, tmp_path / "stopped")
    stopped = tmp_path / "stopped"
    (stopped / "checkpoints/epoch_002.keras").unlink()
    rows = (stopped / "metrics.csv").read_text().splitlines()
    (stopped / "metrics.csv").write_text("\n".join(rows[:2]) + "\n")

    experiment.train_and_evaluate(None, stopped, resume=True)
    a = keras.models.load_model(tmp_path / "straight/checkpoints/epoch_002.keras")
    b = keras.models.load_model(stopped / "checkpoints/epoch_002.keras")
    for x, y in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(a.optimizer.variables, b.optimizer.variables):
        np.testing.assert_array_equal(x.numpy(), y.numpy())
    assert len((stopped / "metrics.csv").read_text().splitlines()) == 3


def test_first_run_on_a_fresh_data_dir_equals_the_second(tmp_path):
    # The first run prepares the dataset; that must not move the seed's
    # random stream (initial weights, shuffles): both runs are bit-equal.
    fresh = str(tmp_path / "tfds")
    config = smoke(ROOT / "saved_configs/mnist1d_cnn_invariant.py", fresh, epochs=1)
    experiment.train_and_evaluate(config, tmp_path / "first")
    experiment.train_and_evaluate(config, tmp_path / "second")
    a = keras.models.load_model(tmp_path / "first/checkpoints/epoch_001.keras")
    b = keras.models.load_model(tmp_path / "second/checkpoints/epoch_001.keras")
    for x, y in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_array_equal(x, y)


def test_unknown_config_key_lists_valid_ones():
    with pytest.raises(
        ValueError,
        match=r"Unknown config key 'stpes'\. Valid keys: .*micro_batch_size.*steps",
    ):
        experiment.resolve_config({"stpes": 4})


@pytest.mark.parametrize(
    "key,value",
    [
        ("optimizer", "sgd"),
        ("steps", 0),
        ("strategy", "tpu"),
        ("model", "vit"),
        ("lr_schedule", "linear"),
    ],
)
def test_bad_config_values(key, value):
    with pytest.raises(ValueError, match=f"Received: {key}={value!r}"):
        experiment.resolve_config({key: value})


def test_refuses_to_overwrite_a_run(data_dir, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run/keep.txt").write_text("results")
    with pytest.raises(FileExistsError, match="--resume"):
        experiment.train_and_evaluate({"data_dir": data_dir}, tmp_path / "run")
    assert (tmp_path / "run/keep.txt").read_text() == "results"


def run_script(*args, timeout=120):
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts/train.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_script_unknown_flag_lists_valid_flags():
    result = run_script("--config", "saved_configs/mnist1d_cnn_invariant.py", "--stepz", "4")
    assert result.returncode != 0
    assert "stepz" in result.stderr
    assert "Valid flags:" in result.stderr and "--steps" in result.stderr


def test_script_missing_dataset_fails_fast(tmp_path):
    result = run_script(
        "--config",
        "saved_configs/mnist1d_cnn_invariant.py",
        "--dataset",
        "mnist",
        "--data_dir",
        str(tmp_path),
        "--workdir",
        str(tmp_path / "run"),
        timeout=60,
    )
    assert result.returncode != 0
    assert "'mnist' is not prepared" in result.stderr


def test_script_trains_and_reports(data_dir, tmp_path):
    result = run_script(
        "--config",
        "saved_configs/mnist1d_cnn_update_accumulation.py",
        "--epochs",
        "1",
        "--steps",
        "2",
        "--data_dir",
        data_dir,
        "--workdir",
        str(tmp_path / "run"),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Final test accuracy:" in result.stdout
    config = json.loads((tmp_path / "run/config.json").read_text())
    assert config["steps"] == 2 and config["epochs"] == 1


def test_script_runs_two_local_workers(data_dir, tmp_path):
    # strategy=multi_worker goes through keras_accum.training (model.fit is
    # broken under MultiWorkerMirroredStrategy in Keras 3.15). Two processes
    # on 127.0.0.1, one replica each: kappa = steps x 2.
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "keras_accum.training.multiworker",
            "--num_workers",
            "2",
            "--timeout",
            "240",
            "--",
            sys.executable,
            str(ROOT / "scripts/train.py"),
            "--config",
            "saved_configs/mnist1d_cnn_invariant.py",
            "--strategy",
            "multi_worker",
            "--validation_split",
            "0",  # Watch the test split: its columns must say so.
            "--epochs",
            "1",
            "--data_dir",
            data_dir,
            "--workdir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    final = json.loads((tmp_path / "run/final.json").read_text())
    assert final["kappa"] == 4 * 2
    assert final["updates"] == 4000 // (25 * 4 * 2)
    rows = list(csv.DictReader(open(tmp_path / "run/metrics.csv")))
    assert len(rows) == 1 and float(rows[0]["loss"]) > 0
    assert "test_accuracy" in rows[0] and "val_accuracy" not in rows[0]  # Labelled honestly.


def test_seeds_report_is_mean_and_sample_std_of_the_runs():
    import importlib.util

    spec = importlib.util.spec_from_file_location("seeds", ROOT / "scripts/seeds.py")
    seeds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(seeds)
    rows = [
        {"seed": 0, "test_accuracy": 0.94, "validation_accuracy": 0.95, "wall": 60, "cpu": 50},
        {"seed": 1, "test_accuracy": 0.96, "validation_accuracy": 0.97, "wall": 80, "cpu": 70},
    ]
    text = seeds.report(rows, "saved_configs/x.py", [1.0, 2.0])
    # mean 95.0%, sample std sqrt(2 * 0.01^2 / 1) = 1.41 points.
    assert "| **mean +- std** | **95.0% +- 1.4** | 96.0% +- 1.4 | 70 s (max 80) | 60 s |" in text
    assert "| 1 | 96.0% | 97.0% | 80 s | 70 s |" in text
