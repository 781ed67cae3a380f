"""How many library files one window of `apply` enters (`scripts/route_files.py`):
at most 8 on JAX and PyTorch, the target of ARCHITECTURE.md; on TensorFlow
no more than today (its driver spans `folds`, `_execution`, `_replicas`
and `_tensors`, each near the 400-line limit), so that growth is seen."""

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
CEILING = {
    "tensorflow": {"InvariantAdam": 13, "UpdateAccumulationAdam": 12, "GradientAccumulation": 11},
}.get(BACKEND, dict.fromkeys(route_files.OPTIMIZERS, 8))
RULE_FILE = {
    "InvariantAdam": "invariant_adam.py",
    "UpdateAccumulationAdam": "update_accumulation_adam.py",
    "GradientAccumulation": "gradient_accumulation.py",
}


@pytest.mark.parametrize("name", sorted(route_files.OPTIMIZERS))
def test_route_of_one_window(name):
    files = route_files.entered(route_files.OPTIMIZERS[name])
    # The trace sees the route: the base's `apply`, the driver, and on
    # JAX/PyTorch the rule itself (TF runs UAA's form, not its rule).
    assert "base.py" in files and "apply" in files["base.py"]
    driver = "drivers/tensorflow/__init__.py" if BACKEND == "tensorflow" else "drivers/portable.py"
    assert driver in files, sorted(files)
    if BACKEND != "tensorflow":
        assert "_fold" in files[RULE_FILE[name]]
    assert len(files) <= CEILING[name], sorted(files)
