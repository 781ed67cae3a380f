"""How many library files one window of `apply` enters (`scripts/route_files.py`):
at most 8 on JAX and PyTorch and 9 on TensorFlow (whose driver adds its
`_execution` and `_replicas`), the targets of ARCHITECTURE.md; and on every
backend the trace sees the rule's own functions run."""

import importlib.util
import pathlib

import keras
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("route_files", ROOT / "scripts" / "route_files.py")
route_files = importlib.util.module_from_spec(spec)
spec.loader.exec_module(route_files)

BACKEND = keras.backend.backend()
# The most files each optimizer's route may enter on this backend.
CEILING = 9 if BACKEND == "tensorflow" else 8
# (the rule's file, a pure function of it that every driver runs)
RULE = {
    "InvariantAdam": ("invariant_adam.py", "fold_factors"),
    "UpdateAccumulationAdam": ("update_accumulation_adam.py", "alpha"),
    "GradientAccumulation": ("gradient_accumulation.py", "weights"),
}


@pytest.mark.parametrize("name", sorted(route_files.OPTIMIZERS))
def test_route_of_one_window(name):
    files = route_files.entered(route_files.OPTIMIZERS[name])
    # The trace sees the route: the base's `apply`, the driver, and the
    # rule's own function, on every backend.
    assert "base.py" in files and "apply" in files["base.py"]
    driver = "drivers/tensorflow/__init__.py" if BACKEND == "tensorflow" else "drivers/portable.py"
    assert driver in files, sorted(files)
    rule_file, function = RULE[name]
    assert function in files[rule_file], files[rule_file]
    assert len(files) <= CEILING, sorted(files)
