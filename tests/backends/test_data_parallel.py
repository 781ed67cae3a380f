"""`keras.distribution.DataParallel` on two JAX CPU devices: the optimizers
see the global gradient, so `GradientAccumulation` equals the big batch;
`InvariantAdam` then counts a window as `steps` micro-batches (one per
step, not one per device) and says so; `layers.BatchNormalization`'s moving
statistics are Keras's layer's at the global big batch."""

import os
import pathlib
import subprocess
import sys

import keras
import pytest

pytestmark = pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX's DataParallel")
ROOT = str(pathlib.Path(__file__).resolve().parents[2])

SCRIPT = """
import warnings, numpy as np, keras, keras_accum as ka
assert len(keras.distribution.list_devices()) == 2
keras.distribution.set_distribution(keras.distribution.DataParallel())
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 5)).astype("float32"); y = rng.normal(size=(64, 1)).astype("float32")
def fitted(optimizer, batch_size):
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
                          keras.layers.Dense(1)])
    m.compile(optimizer=optimizer, loss="mse")
    m.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    return m.get_weights()
ours = fitted(ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=4), 16)
big = fitted(keras.optimizers.Adam(0.01), 64)
print("max_difference", max(float(np.max(np.abs(a - b))) for a, b in zip(ours, big)))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fitted(ka.InvariantAdam(0.01, steps=4), 16)
print("warned", any("kappa = steps" in str(w.message) for w in caught))
"""


def test_data_parallel_two_devices():
    env = dict(
        os.environ,
        KERAS_BACKEND="jax",
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
    )
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert float(lines["max_difference"]) < 1e-5, out.stdout
    assert lines["warned"] == "True", out.stdout


# Each accumulator and slot against its parameter under DataParallel and
# ModelParallel (a LayoutMap sharding both Dense kernels and one bias over a
# 'model' axis), the weights against one device, and what Keras warned.
SHARDING_SCRIPT = """
import json, warnings, jax, numpy as np, keras, keras_accum as ka
devices = keras.distribution.list_devices()
assert len(devices) == 2
rng = np.random.default_rng(0)
x = rng.normal(size=(128, 6)).astype("float32"); y = rng.normal(size=(128, 2)).astype("float32")

def distribution(kind):
    if kind == "one_device":
        return None
    if kind == "data_parallel":
        return keras.distribution.DataParallel(devices=devices)
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["net/hidden/kernel"] = (None, "model")
    layout_map["net/hidden/bias"] = ("model",)
    layout_map["net/out/kernel"] = ("model", None)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")

OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "ga": lambda: ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=4),
    "update": lambda: ka.UpdateAccumulationAdam(0.01, steps=4),
    "invariant": lambda: ka.InvariantAdam(0.01, steps=4),
}

def spec(variable):
    sharding = variable.value.sharding
    return list(sharding.spec) if hasattr(sharding, "spec") else None

def fit(kind, name, batch_size):
    keras.distribution.set_distribution(distribution(kind))
    keras.utils.set_random_seed(0)
    model = keras.Sequential(name="net", layers=[
        keras.Input((6,)), keras.layers.Dense(8, activation="tanh", name="hidden"),
        keras.layers.Dense(2, name="out")])
    optimizer = OPTIMIZERS[name]()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    slots = []
    for parameter in model.trainable_variables:
        prefix = parameter.path.replace("/", "_") + "_"
        slots += [[parameter.path, spec(parameter), v.name, spec(v)]
                  for v in optimizer.variables if v.name.startswith(prefix)]
    device = jax.devices()[0]
    state_bytes = sum(s.data.nbytes for v in optimizer.variables
                      for s in v.value.addressable_shards if s.device == device)
    return dict(weights=[w.tolist() for w in model.get_weights()], slots=slots,
                warnings=[str(w.message) for w in caught], state_bytes=state_bytes)

runs = {"one_device/adam_64": fit("one_device", "adam", 64)}
for name in ("update", "invariant"):
    runs[f"one_device/{name}"] = fit("one_device", name, 16)
for kind in ("data_parallel", "model_parallel"):
    for name in ("ga", "update", "invariant"):
        runs[f"{kind}/{name}"] = fit(kind, name, 16)
print("RESULT", json.dumps(runs))
"""

SLOTS_PER_PARAMETER = {"ga": 3, "update": 3, "invariant": 2}  # GA: accumulator + Adam's m, v


def _run(script, timeout):
    return _run_file(["-c", script], timeout)


def _run_file(arguments, timeout):
    env = dict(
        os.environ,
        KERAS_BACKEND="jax",
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
    )
    out = subprocess.run(
        [sys.executable, *arguments],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_slots_are_sharded_as_their_parameters_and_train_as_one_device():
    import json

    import numpy as np

    out = _run(SHARDING_SCRIPT, 600)
    runs = json.loads(out.stdout.split("RESULT ", 1)[1])
    for kind in ("data_parallel", "model_parallel"):
        for name, per_parameter in SLOTS_PER_PARAMETER.items():
            run = runs[f"{kind}/{name}"]
            # Every accumulator and slot has its parameter's sharding.
            assert len(run["slots"]) == 4 * per_parameter, run["slots"]
            for parameter, parameter_spec, slot, slot_spec in run["slots"]:
                assert slot_spec == parameter_spec, (kind, parameter, slot)
            # Keras found no mix of local and mesh-aware variables.
            assert not [w for w in run["warnings"] if "mix of local" in w], run["warnings"]
            # GA equals the big batch; the Adam variants their one-device run.
            reference = runs["one_device/adam_64" if name == "ga" else f"one_device/{name}"]
            for ours, theirs in zip(run["weights"], reference["weights"], strict=True):
                np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)
    # The LayoutMap did shard: the kernels' slots are split over 'model',
    # and hold less on device 0 than the replicated ones of DataParallel.
    slots = {slot: spec for _, _, slot, spec in runs["model_parallel/ga"]["slots"]}
    assert slots["net_hidden_kernel_accumulator"] == [None, "model"]
    assert slots["net_out_kernel_accumulator"] == ["model", None]
    for name in SLOTS_PER_PARAMETER:
        model_parallel = runs[f"model_parallel/{name}"]["state_bytes"]
        assert model_parallel < runs[f"data_parallel/{name}"]["state_bytes"], name
    # Only a split batch averages micro-batches before InvariantAdam sees
    # them: the kappa warning under DataParallel, none under a batch axis of 1.
    kappa = [w for w in runs["data_parallel/invariant"]["warnings"] if "kappa = steps" in w]
    assert len(kappa) == 1
    assert not [w for w in runs["model_parallel/invariant"]["warnings"] if "kappa" in w]


def test_sharded_state_script_measures_and_renders(tmp_path):
    import json

    script = os.path.join(ROOT, "scripts", "jax_sharded_state.py")
    output = tmp_path / "after.json"
    _run_file([script, "--width=4", f"--output={output}"], 300)
    rows = {(r["optimizer"], r["setting"]): r for r in json.loads(output.read_text())["rows"]}
    assert len(rows) == 12
    for (name, setting), row in rows.items():
        assert row["slots_unlike_parameter"] == 0, (name, setting)
        if setting == "model_parallel":
            replicated = rows[(name, "data_parallel")]["state_bytes_device0"]
            assert 0 < row["state_bytes_device0"] < replicated, name
    table = _run_file([script, f"--render={output}"], 60).stdout
    assert "| grad_accum | model_parallel |" in table


def test_per_device_gradient_script_agrees_and_times_three_arms(tmp_path):
    import json

    script = os.path.join(ROOT, "scripts", "jax_per_device_grads.py")
    output = tmp_path / "per_device.json"
    _run_file(
        [script, "--width=8", "--depth=1", "--rounds=2", "--calls=1", f"--output={output}"], 300
    )
    result = json.loads(output.read_text())
    # The per-device mean gradient is Keras's, the squares numpy's.
    assert result["max_disagreement"] < 1e-4
    assert set(result["ms_per_call"]) == {"keras_like", "shard_mean", "shard_both"}
    assert all(len(v) == 2 and min(v) > 0 for v in result["samples_ms"].values())


BATCH_NORM = """
import numpy as np, keras, keras_accum as ka
assert len(keras.distribution.list_devices()) == 2
keras.distribution.set_distribution(keras.distribution.DataParallel())
rng = np.random.default_rng(0)
x = rng.normal(1.0, 2.0, size=(48, 6, 2)).astype("float32")
y = rng.normal(size=(48, 1)).astype("float32")
def fitted(layer, optimizer, batch_size):
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((6, 2)), keras.layers.Conv1D(3, 3), layer,
                          keras.layers.Flatten(), keras.layers.Dense(1)])
    m.compile(optimizer=optimizer, loss="mse")
    m.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return m
# Global micro-batches of 8 (4 per device), windows of 3: batches of 24.
ours = fitted(ka.layers.BatchNormalization(momentum=0.5, momentum_unit="update"),
              ka.GradientAccumulation(keras.optimizers.SGD(0.0), steps=3), 8)
big = fitted(keras.layers.BatchNormalization(momentum=0.5), keras.optimizers.SGD(0.0), 24)
a, b = ours.layers[1], big.layers[1]
print("relative_difference", max(
    float(np.max(np.abs(np.asarray(getattr(a, n).value) - np.asarray(getattr(b, n).value))
                 / np.abs(np.asarray(getattr(b, n).value))))
    for n in ("moving_mean", "moving_variance")))
print("micro_steps", int(a.micro_step.value), int(ours.optimizer.micro_step.value))
"""


def test_batch_norm_two_devices_is_keras_at_the_global_big_batch():
    out = _run_file(["-c", BATCH_NORM], timeout=600)
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert float(lines["relative_difference"]) < 1e-5, out.stdout
    assert lines["micro_steps"] == "6 6", out.stdout


# A bfloat16 model (issue #51): float32 moments under DataParallel, on
# Keras's step and on PerDeviceGradients' route (one part per device).
BFLOAT16 = """
import numpy as np, keras, keras_accum as ka
keras.distribution.set_distribution(keras.distribution.DataParallel())
keras.config.set_dtype_policy("bfloat16")
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 4)).astype("float32"); y = rng.normal(size=(64, 1)).astype("float32")
class Net(ka.PerDeviceGradients, keras.Sequential): pass
for name, cls, make in [("ia", keras.Sequential, lambda: ka.InvariantAdam(2e-2, steps=4)),
                        ("ua", keras.Sequential, lambda: ka.UpdateAccumulationAdam(2e-2, steps=4)),
                        ("ia_per_device", Net, lambda: ka.InvariantAdam(2e-2, steps=2))]:
    keras.utils.set_random_seed(0)
    m = cls([keras.Input((4,)), keras.layers.Dense(3)])
    m.compile(optimizer=make(), loss="mse")
    before = [np.asarray(w, "float32") for w in m.get_weights()]
    m.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    after = [np.asarray(w, "float32") for w in m.get_weights()]
    dtypes = sorted({str(v.dtype) for v in m.optimizer._momentums})
    moved = min(float(np.min(np.abs(a - b))) for a, b in zip(after, before))
    print(name, ",".join(dtypes), len(m.optimizer._momentums[0].shape), moved)
"""


def test_bfloat16_model_keeps_float32_moments_under_data_parallel():
    out = _run_file(["-c", BFLOAT16], timeout=600)
    rows = {r[0]: r[1:] for r in (line.split() for line in out.stdout.splitlines()) if len(r) == 4}
    assert set(rows) == {"ia", "ua", "ia_per_device"}, out.stdout
    for dtypes, _rank, moved in rows.values():
        assert dtypes == "float32" and float(moved) > 0, out.stdout
    assert rows["ia"][1] == "2" and rows["ia_per_device"][1] == "3", out.stdout  # [devices, 4, 3]
