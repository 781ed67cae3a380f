"""The kill drill in small: the custom loop (scripts/train.py, 2 epochs)
killed inside its last checkpoint write, resumed, compared bit for bit with
an uninterrupted run. The full drill is scripts/kill_drill.py."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_drill():
    spec = importlib.util.spec_from_file_location("kill_drill", ROOT / "scripts" / "kill_drill.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kill_inside_checkpoint_write_resumes_exactly(tmp_path):
    drill = load_drill()
    # Atomic writes of the first launch: config.json (1), the checkpoints of
    # epoch 1 (2) and epoch 2 (3). Killing inside 3 leaves a half-written
    # temporary file; the resume must use epoch 1's checkpoint.
    (row,) = drill.drill(
        ["loop"],
        random_kills=0,
        write_kills=[3],
        epochs=2,
        config="saved_configs/mnist1d_cnn_invariant.py",
        root=tmp_path,
        data_dir=str(tmp_path / "data"),
        seed=0,
        timeout=300,
    )
    assert row["kill"] == "kill:3 (exit -9)"
    assert row["resumed"] == 1  # one "Resuming from" line: epoch 1's checkpoint
    for key in ("weights+optimizer", "metrics.csv", "tensorboard", "log.jsonl"):
        assert row[key], (key, row)
