"""The kill drill in small: the custom loop (scripts/train.py, 2 epochs)
killed inside its last checkpoint write, resumed, and killed between two
of a new folder's first writes, restarted by the plain command; each
compared bit for bit with an uninterrupted run. The full drill is
scripts/kill_drill.py; tests/test_run_folder.py kills the fit path inside
and between every write before its first checkpoint."""

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
    # Atomic writes of the first launch: checkpoints/config.json (1),
    # config.json (2), loop/config.json (3), the checkpoints of epoch 1 (4)
    # and epoch 2 (5). Killing inside 5 leaves a half-written temporary
    # file; the resume must use epoch 1's checkpoint. Then a new run killed
    # just after loop/config.json (no checkpoint yet): the plain command, in
    # the same folder, must restart it.
    rows = drill.drill(
        ["loop"],
        random_kills=0,
        write_kills=[5, ("new", "after:3", "plain")],
        epochs=2,
        config="saved_configs/mnist1d_cnn_invariant.py",
        root=tmp_path,
        data_dir=str(tmp_path / "data"),
        seed=0,
        timeout=300,
    )
    assert [row["kill"] for row in rows] == ["kill:5 (exit -9)", "after:3 (exit -9) then plain"]
    assert rows[0]["resumed"] == 1  # one "Resuming from" line: epoch 1's checkpoint
    assert rows[1]["resumed"] == 0  # restarted, nothing to resume
    for row in rows:
        for key in ("weights+optimizer", "metrics.csv", "tensorboard", "log.jsonl"):
            assert row[key], (key, row)
