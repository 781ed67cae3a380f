"""The Keras floor: one line at import below it, the same floor everywhere."""

import configparser
import pathlib
import re

import keras
import pytest

from keras_accum import _floor

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "version, parsed",
    [
        ("3.4.1", (3, 4, 1)),
        ("3.9.2", (3, 9, 2)),
        ("3.10.0", (3, 10, 0)),
        ("3.15.1", (3, 15, 1)),
        ("3.16.0.dev2026", (3, 16, 0)),
        ("3.10.0rc1", (3, 10, 0)),
        ("3.8", (3, 8, 0)),
    ],
)
def test_release_reads_the_leading_numbers(version, parsed):
    assert _floor.release(version) == parsed


@pytest.mark.parametrize(
    "version, refused",
    [
        ("3.4.1", True),
        ("3.7.0", True),
        ("3.8.0", False),
        ("3.9.2", False),
        ("3.10.0", False),
        ("3.15.1", False),
        ("3.16.0.dev2026", False),
    ],
)
def test_check_keras(version, refused):
    if not refused:
        _floor.check_keras(version)
        return
    with pytest.raises(ImportError) as error:
        _floor.check_keras(version)
    message = str(error.value)
    assert "\n" not in message
    assert f"Keras {version} is installed" in message
    assert f"Keras >= {_floor.KERAS_FLOOR}" in message


def test_installed_keras_is_at_or_above_the_floor():
    assert _floor.release(keras.__version__) >= _floor.release(_floor.KERAS_FLOOR)


def test_setup_cfg_declares_the_same_floor():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    requires = config["options"]["install_requires"].split()
    assert f"keras>={_floor.KERAS_FLOOR}" in requires
    # TensorFlow is an extra (`[tensorflow]`, which `[experiments]` and `[test]`
    # bring): a JAX or PyTorch install does not pull it in.
    assert not any(r.startswith("tensorflow") for r in requires), requires
    extras = config["options.extras_require"]
    tensorflow = extras["tensorflow"].split()
    assert len(tensorflow) == 1 and re.fullmatch(r"tensorflow>=\d+\.\d+\.\d+", tensorflow[0])
    assert "keras_accum[tensorflow]" in extras["experiments"].split()
    assert "keras_accum[experiments]" in extras["test"].split()
