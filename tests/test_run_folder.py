"""A new run folder killed inside and between its first writes (the kill
drill's early kills, in small): the same command with --resume, or the
plain command, must take the folder the kill leaves and finish with the
results of an uninterrupted run. Also which folders a new run may take and
what it refuses (keras_accum.experiments.run_folder)."""

import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from keras_accum.experiments import experiment

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAIN = ROOT / "saved_configs/mnist1d_cnn_invariant.py"
spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts/train.py")
train_script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train_script)

# The atomic writes of a new run, counted by the hook: checkpoints/config.json
# (1), config.json (2), the epoch-1 checkpoint (3). kill:<n> kills inside
# write n, after:<n> between write n and what follows.
HOOKS = ["kill:1", "after:1", "kill:2", "after:2", "kill:3"]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """(config file, data_dir) of a one-epoch run of a few seconds."""
    folder = tmp_path_factory.mktemp("small")
    config = experiment.load_config_file(MAIN, True)
    config.update(data_dir=str(folder / "tfds"), verbose=0, epochs=1, model_kwargs={"channels": 16})
    path = folder / "small.json"
    path.write_text(json.dumps(config))
    return path, config["data_dir"]


def script(capsys, *argv):
    """scripts/train.py in-process: (exit status, stderr)."""
    status = train_script.main(["train.py", *argv])
    return status, capsys.readouterr().err


@pytest.fixture(scope="module")
def reference(small, tmp_path_factory):
    """The uninterrupted run's folder (in this process, as the recoveries)."""
    workdir = tmp_path_factory.mktemp("reference") / "run"
    status = train_script.main(["train.py", f"--config={small[0]}", f"--workdir={workdir}"])
    assert status == 0
    return workdir


def killed(small, workdir, hook):
    """Runs the small config as a new process with the hook; returns its exit status."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), KERAS_ACCUM_CHECKPOINT_HOOK=hook)
    command = [sys.executable, str(ROOT / "scripts/train.py"), f"--config={small[0]}"]
    result = subprocess.run(
        [*command, f"--workdir={workdir}"], env=env, capture_output=True, text=True, timeout=300
    )
    return result.returncode, result.stderr


def assert_same_results(reference, workdir):
    for name in ("config.json", "checkpoints/config.json", "metrics.csv"):
        assert (workdir / name).read_text() == (reference / name).read_text(), name
    a, b = (json.loads((d / "final.json").read_text()) for d in (reference, workdir))
    assert a["test_loss"] == b["test_loss"] and a["updates"] == b["updates"]
    assert [p.name for p in (workdir / "checkpoints").iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("hook", HOOKS)
def test_new_run_killed_early_is_taken_by_either_command(hook, small, reference, tmp_path, capsys):
    workdir = tmp_path / "run"
    code, err = killed(small, workdir, hook)
    assert code == -9, err[-2000:]  # the hook fired

    plain = tmp_path / "plain"
    shutil.copytree(workdir, plain)
    status, err = script(capsys, f"--config={small[0]}", f"--workdir={plain}")
    assert status == 0, err
    assert_same_results(reference, plain)

    before = sorted(workdir.rglob("*"))
    status, err = script(capsys, f"--workdir={workdir}", "--resume")
    if hook == "kill:1":  # no config anywhere: nothing to resume, says what to do
        assert status == 1 and err.startswith("error: ") and "\n" not in err.strip()
        assert "config.json missing" in err and f"--workdir {workdir}" in err
        assert sorted(workdir.rglob("*")) == before
    else:
        assert status == 0, err
        assert_same_results(reference, workdir)


def test_resume_of_an_unstarted_run_takes_its_edited_config(small, reference, tmp_path, capsys):
    # Killed after config.json, before the first checkpoint; config.json then
    # edited: no checkpoint holds the old config, so the edit is the run's.
    workdir = tmp_path / "run"
    assert killed(small, workdir, "after:2")[0] == -9
    config = json.loads((workdir / "config.json").read_text())
    (workdir / "config.json").write_text(json.dumps(dict(config, seed=1)))
    status, err = script(capsys, f"--workdir={workdir}", "--resume")
    assert status == 0, err
    assert json.loads((workdir / "checkpoints/config.json").read_text())["seed"] == 1


def make(folder, *names):
    for name in names:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    return folder


UNSTARTED = [
    ["checkpoints/.config.json.tmp-12"],
    ["checkpoints/config.json", ".config.json.tmp-12"],
    ["checkpoints/config.json", "config.json", "metrics.csv", "checkpoints/.epoch_001.keras.tmp-1"],
    ["checkpoints/config.json", "tensorboard/train/events.out.tfevents.1.x.v2"],
    # The custom loop killed inside its first checkpoint's index write.
    ["checkpoints/config.json", "config.json", "loop/config.json", "loop/log.jsonl"]
    + ["loop/checkpoints/ckpt-1.data-00000-of-00001", "loop/checkpoints/.ckpt-1.index.tmp-3"],
]
REFUSED = [
    (["checkpoints/config.json", "checkpoints/epoch_001.keras"], "checkpoints"),
    (["checkpoints/config.json", "loop/checkpoints/ckpt-2.index"], "checkpoints"),
    (["checkpoints/config.json", "notes.txt"], "not those of a run"),
    (["checkpoints/config.json", "final.json"], "not those of a run"),
    (["checkpoints/config.json", "tensorboard/notes.txt"], "not those of a run"),
    (["config.json"], "not those of a run"),  # no checkpoints/: not written by a run
]


@pytest.mark.parametrize("names", UNSTARTED, ids=range(len(UNSTARTED)))
def test_a_folder_killed_before_its_first_checkpoint_is_reused(names, tmp_path):
    from keras_accum.experiments import run_folder

    folder = make(tmp_path / "run", *names)
    assert run_folder.check_new(folder) is True
    run_folder.clear(folder)
    assert [p.relative_to(folder) for p in folder.rglob("*")] == [pathlib.Path("checkpoints")]


@pytest.mark.parametrize("names,words", REFUSED, ids=range(len(REFUSED)))
def test_a_folder_with_a_checkpoint_or_foreign_files_is_refused(names, words, tmp_path):
    from keras_accum.experiments import run_folder

    folder = make(tmp_path / "run", *names)
    before = sorted(folder.rglob("*"))
    with pytest.raises(FileExistsError) as info:
        run_folder.check_new(folder)
    message = str(info.value)
    assert "\n" not in message and "workdir=" in message and words in message
    assert sorted(folder.rglob("*")) == before


@pytest.mark.parametrize("resume", [False, True], ids=["new", "resume"])
def test_workdir_under_a_file_is_one_line_naming_workdir(resume, small, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    workdir = tmp_path / "file" / "run"
    argv = ["--resume"] if resume else [f"--config={small[0]}"]
    status, err = script(capsys, f"--workdir={workdir}", *argv)
    assert status == 1 and err.startswith("error: ") and "\n" not in err.strip()
    assert "`workdir`" in err and repr(str(workdir)) in err and "Errno" not in err
    assert (tmp_path / "file").read_text() == "x"


def test_a_config_json_cut_by_an_older_version_is_restarted(small, reference, tmp_path, capsys):
    # The plain writes of earlier versions could leave a cut config.json and no
    # checkpoint: --resume names the file and the command that restarts it.
    workdir = tmp_path / "run"
    (workdir / "checkpoints").mkdir(parents=True)
    (workdir / "checkpoints/config.json").write_text(small[0].read_text())
    (workdir / "config.json").write_text('{"da')
    status, err = script(capsys, f"--workdir={workdir}", "--resume")
    assert status == 1 and "\n" not in err.strip()
    assert "not valid JSON" in err and f"--workdir {workdir}) starts the run again" in err
    assert (workdir / "config.json").read_text() == '{"da'
    status, err = script(capsys, f"--config={small[0]}", f"--workdir={workdir}")
    assert status == 0, err
    assert_same_results(reference, workdir)
