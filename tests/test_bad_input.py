"""Bad input to the API and to scripts/train.py: each case must be refused
with ONE line that names the culprit (and the accepted values), no
traceback, and nothing written, so the same folder serves the corrected
command."""

import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys

import pytest

from keras_accum import training
from keras_accum.experiments import config as cfg
from keras_accum.experiments import experiment

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAIN = ROOT / "saved_configs/mnist1d_cnn_invariant.py"
spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts/train.py")
train_script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train_script)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


def smoke(folder, **overrides):
    config = experiment.load_config_file(MAIN, True)
    return {**config, "data_dir": folder, "verbose": 0, "epochs": 1, **overrides}


@pytest.fixture(scope="module")
def finished_run(data_dir, tmp_path_factory):
    """A complete one-epoch run folder, copied by the resume cases."""
    workdir = tmp_path_factory.mktemp("finished") / "run"
    experiment.train_and_evaluate(smoke(data_dir), workdir)
    return workdir


def assert_one_line(message, *culprits):
    assert "\n" not in message.strip(), message
    assert "Traceback" not in message, message
    for culprit in culprits:
        assert culprit in message, (culprit, message)


# (overrides of the smoke config, words the error must contain). Each case
# fails before anything is written; those marked "data" need the dataset.
API_CASES = [
    ({"beta_1": 1.0}, ["beta_1=1.0", "[0.0, 1.0)"]),
    ({"beta_1": 1.5}, ["beta_1=1.5"]),
    ({"beta_1": -0.1}, ["beta_1=-0.1"]),
    ({"beta_2": 1.0}, ["beta_2=1.0"]),
    ({"learning_rate": -1e-3}, ["learning_rate=-0.001", "> 0.0"]),
    ({"learning_rate": 0}, ["learning_rate=0"]),
    ({"learning_rate": "1e-3"}, ["learning_rate='1e-3'"]),
    ({"weight_decay": -0.1}, ["weight_decay=-0.1"]),
    ({"epsilon": "x"}, ["epsilon='x'"]),
    ({"epsilon": 0.0}, ["epsilon=0.0"]),
    ({"epsilon": float("nan")}, ["epsilon=nan"]),
    ({"mixed_precision": "no"}, ["mixed_precision='no'", "True or False"]),
    ({"mixed_precision": 1}, ["mixed_precision=1"]),
    ({"jit_compile": "yes"}, ["jit_compile='yes'"]),
    ({"steps": 0}, ["steps=0", ">= 1"]),
    ({"steps": 2.5}, ["steps=2.5"]),
    ({"steps": True}, ["steps=True"]),
    ({"micro_batch_size": -1}, ["micro_batch_size=-1"]),
    ({"epochs": 0}, ["epochs=0"]),
    ({"seed": -1}, ["seed=-1"]),
    ({"seed": "0"}, ["seed='0'"]),
    ({"optimizer": "adam"}, ["optimizer='adam'", "'invariant_adam'"]),
    ({"inner_optimizer": "rmsprop"}, ["inner_optimizer='rmsprop'", "'adamw'"]),
    ({"strategy": "tpu"}, ["strategy='tpu'", "'mirrored'"]),
    ({"scaling_rule": "linear"}, ["scaling_rule='linear'", "'sqrt'"]),
    ({"lr_schedule": "linear"}, ["lr_schedule='linear'", "'cosine'"]),
    ({"model": "vit"}, ["model='vit'", "'mlp'"]),
    ({"model_kwargs": {"chanels": 3}}, ["model_kwargs=", "channels"]),
    ({"model_kwargs": [1, 2]}, ["model_kwargs=[1, 2]"]),
    ({"validation_split": 1.0}, ["validation_split=1.0"]),
    ({"validation_split": -0.1}, ["validation_split=-0.1"]),
    ({"noise_scale_every": -1}, ["noise_scale_every=-1"]),
    ({"verbose": 3}, ["verbose=3"]),
    ({"data_dir": 3}, ["data_dir=3"]),
    ({"data_dir": __file__}, ["data_dir=", "must be a folder"]),
    ({"stpes": 4}, ["'stpes'", "steps"]),
    # 12 x (1 - 0.9) >= 1: the linear rule has no beta_1 there.
    ({"steps": 12, "scaling_rule": "invariant"}, ["beta_1", "kappa=12", "'power'"]),
    ({"dataset": "mnsit1d"}, ["dataset='mnsit1d'", "mnist1d"]),
    ({"dataset": ""}, ["dataset=''"]),
    ({"dataset": "mnist"}, ["'mnist' is not prepared", "tfds build"]),  # data
    ({"model": "transformer", "model_kwargs": {}}, ["transformer", "dataset='mnist1d'"]),
    ({"model": "resnet", "model_kwargs": {}}, ["resnet", "(40,)"]),  # data
    ({"micro_batch_size": 5000}, ["window", "3600 examples"]),  # data
    ({"validation_split": 1e-5}, ["validation_split=1e-05"]),  # data
]


@pytest.mark.parametrize(
    "overrides,words", API_CASES, ids=[json.dumps(c[0], default=str) for c in API_CASES]
)
def test_api_refuses_before_writing(overrides, words, data_dir, tmp_path):
    workdir = tmp_path / "run"
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        experiment.train_and_evaluate(smoke(data_dir, **overrides), workdir)
    assert_one_line(str(info.value), *words)
    assert not workdir.exists()  # Nothing written: the folder stays free.


@pytest.mark.parametrize(
    "tf_config,words",
    [
        ("{not json", ["TF_CONFIG is not valid JSON"]),
        ('{"cluster": {"worker": ["a:1"]}}', ["TF_CONFIG must look like"]),
        (
            '{"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}',
            ["type='chief'", "'worker'"],
        ),
        (
            '{"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 2}}',
            ["index=2", "[0, 1]"],
        ),
    ],
)
def test_bad_tf_config_is_refused(tf_config, words, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_config)
    with pytest.raises(cfg.ConfigError) as info:
        experiment.resolve_config({"strategy": "multi_worker"})
    assert_one_line(str(info.value), *words)
    # The library reads TF_CONFIG itself (custom loop users): the same line.
    with pytest.raises(ValueError) as info:
        training.strategy_from_environment()
    assert_one_line(str(info.value), *words)


def test_refused_folder_serves_the_corrected_command(data_dir, tmp_path):
    workdir = tmp_path / "run"
    with pytest.raises(ValueError, match="beta_1"):
        experiment.train_and_evaluate(smoke(data_dir, beta_1=1.0), workdir)
    with pytest.raises(ValueError, match="window"):  # Refused after the data check.
        experiment.train_and_evaluate(smoke(data_dir, micro_batch_size=5000), workdir)
    final = experiment.train_and_evaluate(smoke(data_dir, beta_1=0.9), workdir)
    assert final["epochs"] == 1 and (workdir / "final.json").exists()


def resume_case(finished_run, tmp_path, edit):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    edit(run / "config.json")
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    return run, before


def _edit_key(key, value):
    def edit(path):
        config = json.loads(path.read_text())
        config[key] = value
        path.write_text(json.dumps(config))

    return edit


@pytest.mark.parametrize(
    "edit,words",
    [
        (_edit_key("learning_rate", 0.5), ["differs", "learning_rate"]),
        (_edit_key("epochs", 3), ["differs", "epochs"]),
        (_edit_key("beta_1", 2.0), ["beta_1=2.0"]),
        (_edit_key("stpes", 2), ["'stpes'"]),
        (lambda p: p.write_text('{"seed": 0,'), ["config.json", "not valid JSON"]),
        (lambda p: p.write_text("[1, 2]"), ["config.json", "JSON object"]),
        (lambda p: p.unlink(), ["config.json missing"]),
    ],
    ids=["edited_lr", "edited_epochs", "bad_value", "unknown_key", "corrupt", "list", "missing"],
)
def test_resume_refuses_a_bad_config_json(edit, words, finished_run, tmp_path):
    run, before = resume_case(finished_run, tmp_path, edit)
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        experiment.train_and_evaluate(None, run, resume=True)
    assert_one_line(str(info.value), *words)
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


def test_resume_with_another_config_names_the_keys(finished_run, tmp_path, data_dir):
    run, _ = resume_case(finished_run, tmp_path, lambda p: None)
    with pytest.raises(ValueError) as info:
        experiment.train_and_evaluate(smoke(data_dir, seed=5), run, resume=True)
    assert_one_line(str(info.value), "seed")


def script(capsys, *argv):
    """scripts/train.py in-process: (exit status, stdout, stderr)."""
    status = train_script.main(["train.py", *argv])
    out = capsys.readouterr()
    return status, out.out, out.err


BAD_FILES = {
    "syntax.py": ("def get_config(:\n", ["syntax.py", "SyntaxError"]),
    "none.py": ("X = 1\n", ["none.py", "get_config()"]),
    "list.py": ("def get_config():\n    return [1]\n", ["must return a dict"]),
    "raises.py": ("def get_config():\n    raise KeyError('k')\n", ["raises.py", "KeyError"]),
}
SCRIPT_CASES = [
    (["--mixed_precision=no"], ["--mixed_precision=no", "true or false"]),
    (["--beta_1=1"], ["beta_1=1.0"]),
    (["--epsilon=x"], ["epsilon='x'"]),
    (["--learning_rate=-1"], ["learning_rate=-1.0"]),
    (["--weight_decay=-1e-4"], ["weight_decay=-0.0001"]),
    (["--steps=abc"], ["steps='abc'"]),
    (["--seed=1.5"], ["seed='1.5'"]),
    (["--model_kwargs=channels=3"], ["model_kwargs", "JSON object"]),
    (["--scaling_rule=linear"], ["scaling_rule='linear'"]),
    (["--stepz=3"], ["stepz", "Valid flags:", "--steps"]),
    (["extra"], ["Unexpected arguments"]),
    (["--config=saved_configs/nope.py"], ["nope.py"]),
    (["--resume"], ["--resume needs --workdir"]),
]


@pytest.mark.parametrize("argv,words", SCRIPT_CASES, ids=lambda c: str(c)[:30])
def test_script_refuses_in_one_line(argv, words, data_dir, tmp_path, capsys):
    workdir = tmp_path / "run"
    base = [f"--config={MAIN}", f"--data_dir={data_dir}", "--epochs=1", f"--workdir={workdir}"]
    if argv == ["--resume"]:
        base = []
    status, _, err = script(capsys, *base, *argv)
    assert status != 0
    assert err.startswith("error: ")
    assert_one_line(err, *words)
    assert not workdir.exists()


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_script_names_a_broken_config_file(name, tmp_path, capsys):
    text, words = BAD_FILES[name]
    (tmp_path / name).write_text(text)
    status, _, err = script(capsys, f"--config={tmp_path / name}", f"--workdir={tmp_path / 'r'}")
    assert status == 1 and err.startswith("error: ")
    assert_one_line(err, *words)
    assert not (tmp_path / "r").exists()


def test_script_workdir_problems(finished_run, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    status, _, err = script(capsys, f"--config={MAIN}", f"--workdir={tmp_path / 'file'}")
    assert status == 1
    assert_one_line(err, "is a file")
    status, _, err = script(capsys, f"--config={MAIN}", f"--workdir={finished_run}")
    assert status == 1
    assert_one_line(err, "not empty", "--resume")
    status, _, err = script(capsys, f"--workdir={finished_run}", "--resume", "--steps=2")
    assert status == 1
    assert_one_line(err, "drop --steps")


def test_script_corrected_command_runs_in_the_refused_folder(data_dir, tmp_path, capsys):
    workdir = tmp_path / "run"
    args = [f"--config={MAIN}", f"--data_dir={data_dir}", "--epochs=1", f"--workdir={workdir}"]
    status, _, err = script(capsys, *args, "--beta_1=1")
    assert status == 1 and "beta_1" in err
    status, out, err = script(capsys, *args, "--beta_1=0.9", "--verbose=0")
    assert status == 0, err
    assert "Final test accuracy:" in out


def run_script(*args):
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts/train.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


@pytest.mark.parametrize(
    "args,words",
    [
        (["--mixed_precision=no"], ["mixed_precision"]),
        (["--beta_1=1.5"], ["beta_1=1.5"]),
        (["--dataset=mnsit1d"], ["dataset='mnsit1d'"]),
    ],
)
def test_script_subprocess_error_is_one_line(args, words, data_dir, tmp_path):
    workdir = tmp_path / "run"
    result = run_script(f"--config={MAIN}", f"--data_dir={data_dir}", f"--workdir={workdir}", *args)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-2000:]
    assert result.stderr.rstrip().endswith(errors[0])
    assert_one_line(errors[0], *words)
    assert not workdir.exists()


@pytest.mark.parametrize(
    "script,variants",
    [("invariance.py", "'full', 'quick', 'frontier', 'smoke'"), ("schedules_study.py", "'smoke'")],
)
def test_study_script_refuses_an_unknown_variant_in_one_line(script, variants, tmp_path):
    # The config file owns its variants; the script passes the flag on.
    workdir = tmp_path / "study"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), "--variant=nope", f"--workdir={workdir}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert_one_line(error, "variant='nope'", variants)
    assert not workdir.exists()


def test_script_subprocess_names_a_corrupt_config_json(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / "config.json").write_text("{")
    result = run_script(f"--workdir={run}", "--resume")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.rstrip().splitlines()[-1].startswith("error: ")
    assert "config.json" in result.stderr and "not valid JSON" in result.stderr


# The mechanism itself, on a schema shaped like the invariance study's.
STUDY = cfg.Schema(
    "study",
    [
        cfg.Field("kappas", "list", [1, 2], "kappas", item=cfg.Field("", "int", 1, "", minimum=1)),
        cfg.Field(
            "methods",
            "list",
            ["invariant"],
            "methods",
            item=cfg.Field("", "str", "", "", choices=("invariant", "sqrt")),
        ),
        cfg.Field("lr", "float", 1e-3, "base lr", minimum=0.0, open_minimum=True),
        cfg.Field("rule", "str", None, "rule", choices=(None, "invariant", "sqrt")),
        cfg.Field("share", "bool", True, "share kappa = 1"),
    ],
)


@pytest.mark.parametrize(
    "config,words",
    [
        ({"kappas": []}, ["kappas=[]", "at least 1"]),
        ({"kappas": "1,2"}, ["kappas='1,2'"]),
        ({"kappas": [1, 0]}, ["kappas[1]=0", ">= 1"]),
        ({"methods": ["power"]}, ["methods[0]='power'", "'sqrt'"]),
        ({"share": "yes"}, ["share='yes'"]),
        ([1, 2], ["must be a dict"]),
    ],
)
def test_schema_refuses_in_one_line(config, words):
    with pytest.raises(cfg.ConfigError) as info:
        STUDY.resolve(config)
    assert_one_line(str(info.value), *words)


def test_schema_flags_parse_to_the_same_values():
    from absl import flags

    fv = flags.FlagValues()
    STUDY.define_flags(fv)
    fv(["prog", "--kappas=1,4", "--methods=sqrt", "--lr=0.01", "--rule=none", "--noshare"])
    overrides = STUDY.flag_overrides(fv)
    assert overrides == {
        "kappas": [1, 4],
        "methods": ["sqrt"],
        "lr": 0.01,
        "rule": None,
        "share": False,
    }
    assert STUDY.resolve(overrides) == overrides


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--kappas=1,x"], ["kappas='x'"]),
        (["--lr=-1"], ["lr=-1.0"]),
        (["--rule=linear"], ["rule='linear'"]),
    ],
)
def test_schema_flag_values_are_checked(argv, words):
    from absl import flags

    fv = flags.FlagValues()
    STUDY.define_flags(fv)
    fv(["prog", *argv])
    with pytest.raises(cfg.ConfigError) as info:
        STUDY.flag_overrides(fv)
    assert_one_line(str(info.value), *words)


def test_cross_field_check_error_is_one_config_error():
    def window_fits(c):
        if c["lr"] > 1:
            raise ValueError(f"`lr` must be <= 1 for this study. Received: lr={c['lr']}")

    schema = cfg.Schema("s", STUDY.fields.values(), [window_fits])
    with pytest.raises(cfg.ConfigError) as info:
        schema.resolve({"lr": 2.0})
    assert_one_line(str(info.value), "lr=2.0")


def test_train_script_prints_a_lost_peer_as_one_line(tmp_path, monkeypatch, capsys):
    # scripts/train.py turns WorkerLostError into one `error:` line with the
    # resume command and exit status 3, no traceback.
    from keras_accum.training import WorkerLostError

    spec = importlib.util.spec_from_file_location("train", ROOT / "scripts" / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    message = "Lost a peer worker (UnavailableError). To resume: python scripts/train.py --resume"

    def lost(*args, **kwargs):
        raise WorkerLostError(message)

    monkeypatch.setattr(experiment, "train_and_evaluate", lost)
    config = str(ROOT / "saved_configs" / "mnist1d_cnn_invariant.py")
    code = train.main(["train.py", "--config", config, "--workdir", str(tmp_path / "run")])
    captured = capsys.readouterr()
    assert code == 3
    assert captured.err == f"error: {message}\n"
