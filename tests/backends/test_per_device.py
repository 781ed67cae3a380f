"""`keras_accum.PerDeviceGradients` under JAX's `DataParallel` on two CPU
devices: what the compiled train step communicates (the optimized HLO),
and that the route trains as the big batch (`GradientAccumulation`) and as
one device with a micro-batch per device (`InvariantAdam`, kappa = steps x
devices)."""

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import keras
import numpy as np
import pytest

from tests import references

pytestmark = pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX's DataParallel")
ROOT = str(pathlib.Path(__file__).resolve().parents[2])


def _run(script, *arguments, xla_flags="", devices=2):
    env = dict(
        os.environ,
        KERAS_BACKEND="jax",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {xla_flags}".strip(),
        PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
    )
    out = subprocess.run(
        [sys.executable, "-c", script, *arguments],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.split("RESULT ", 1)[1])


# -- the optimized HLO of the train step --------------------------------------

HLO_SCRIPT = """
import sys, json, numpy as np, keras, keras_accum as ka
assert len(keras.distribution.list_devices()) == 2
keras.distribution.set_distribution(keras.distribution.DataParallel())
arm = sys.argv[1]
class Net(ka.PerDeviceGradients, keras.Sequential):
    pass
OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "ga": lambda: ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=4),
    "ia": lambda: ka.InvariantAdam(0.01, steps=4),
    "uaa": lambda: ka.UpdateAccumulationAdam(0.01, steps=4),
}
keras.utils.set_random_seed(0)
model = Net([keras.Input((5,)), keras.layers.Dense(64, activation="tanh"), keras.layers.Dense(1)])
model.compile(optimizer=OPTIMIZERS[arm](), loss="mse")
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 5)).astype("float32"); y = rng.normal(size=(64, 1)).astype("float32")
model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
print("RESULT", json.dumps({"parameters": model.count_params()}))
"""

_ARRAY = re.compile(r"\b(?:pred|[suf](?:8|16|32|64)|bf16|f8\w*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")


def computations(text):
    """({name: [instruction lines]}, the ENTRY computation's name) of an
    HLO module's text: a computation opens with a header line ending in
    '{' and closes with a line '}'."""
    blocks, entry, name = {}, None, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if name is None and header:
            name, blocks[header.group(2)] = header.group(2), []
            entry = name if header.group(1) else entry
        elif name is not None and line.strip() == "}":
            name = None
        elif name is not None:
            blocks[name].append(line)
    return blocks, entry


def all_reduce_sizes(lines):
    """Elements each all-reduce of a computation moves (all its outputs: a
    combined all-reduce is a tuple)."""
    sizes = []
    for line in lines:
        match = re.search(r"=\s*(.*?)\s+all-reduce(?:-start)?\(", line)
        if match:
            shapes = _ARRAY.findall(match.group(1))
            sizes.append(sum(math.prod(int(d) for d in s.split(",") if d) for s in shapes))
    return sizes


def branches(lines):
    """The computations the conditionals of `lines` branch to."""
    names = []
    for line in lines:
        if " conditional(" not in line:
            continue
        found = re.search(r"branch_computations=\{([^}]*)\}", line)
        if found:
            names += found.group(1).split(",")
        names += re.findall(r"(?:true|false)_computation=([^,\s]+)", line)
    return [name.strip().lstrip("%") for name in names]


def called(lines):
    """The computations `lines` call on every run (fusions, loops, calls,
    reductions): not a conditional's branches."""
    names = []
    for line in lines:
        names += re.findall(r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)", line)
    return names


def reached(blocks, roots, follow_branches):
    """`roots` and every computation they reach through `called` (and
    through conditional branches with `follow_branches`)."""
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in seen or name not in blocks:
            continue
        seen.add(name)
        todo += called(blocks[name])
        todo += branches(blocks[name]) if follow_branches else []
    return seen


def step_parts(path):
    """({name: lines}, the computations that run on every call of a compiled
    step's optimized HLO at `path`, those reached only through a
    conditional's branches)."""
    blocks, entry = computations(path.read_text())
    assert entry is not None and blocks[entry], sorted(blocks)
    every_call = reached(blocks, [entry], follow_branches=False)
    conditional = [b for name in every_call for b in branches(blocks[name])]
    return blocks, every_call, reached(blocks, conditional, follow_branches=True) - every_call


def train_step_reductions(arm, tmp_path):
    """(parameters, the all-reduce sizes of what runs on every call: ENTRY
    and what it calls outside a conditional; those of the conditionals'
    branches and all they reach) of the compiled train step of `arm`."""
    dump = tmp_path / arm
    flags = f"--xla_dump_to={dump} --xla_dump_hlo_as_text"
    parameters = _run(HLO_SCRIPT, arm, xla_flags=flags)["parameters"]
    files = sorted(dump.glob("*jit_train_step*after_optimizations.txt"))
    assert len(files) == 1, files  # one shape of batch: one compiled step
    blocks, every_call, in_branches = step_parts(files[0])
    sizes = lambda names: [size for n in sorted(names) for size in all_reduce_sizes(blocks[n])]  # noqa: E731
    return parameters, sizes(every_call), sizes(in_branches)


def test_the_hlo_reader_sees_computations_and_sizes():
    text = "\n".join(
        [
            "%add (a: f32[], b: f32[]) -> f32[] {",
            "  ROOT %s = f32[] add(f32[] %a, f32[] %b)",
            "}",
            "",
            "%branch_1 (p: (f32[2,3])) -> f32[2,3] {",
            "  %r = (f32[2,3]{1,0}, f32[4]{0}) all-reduce(%x, %y), to_apply=%add",
            "}",
            "",
            "ENTRY %main.3_spmd (p0: f32[2,3], p1: pred[]) -> f32[2,3] {",
            "  %ar = f32[] all-reduce(%z), channel_id=1, to_apply=%add",
            "  ROOT %c = f32[2,3]{1,0} conditional(%p1, %t, %f), "
            "branch_computations={%branch_0, %branch_1}",
            "}",
        ]
    )
    blocks, entry = computations(text)
    assert entry == "main.3_spmd" and set(blocks) == {"add", "branch_1", "main.3_spmd"}
    assert all_reduce_sizes(blocks[entry]) == [1]
    assert branches(blocks[entry]) == ["branch_0", "branch_1"]
    assert all_reduce_sizes(blocks["branch_1"]) == [10]
    assert reached(blocks, [entry], follow_branches=False) == {entry, "add"}
    assert reached(blocks, [entry], follow_branches=True) == {entry, "branch_1", "add"}


def test_plain_adam_all_reduces_every_gradient_every_step(tmp_path):
    # The control: Keras's train step reduces all the parameters' gradients
    # in ENTRY, on every call (the mixin leaves Adam to Keras).
    parameters, entry, _ = train_step_reductions("adam", tmp_path)
    assert max(entry) >= parameters, (parameters, entry)


@pytest.mark.parametrize("arm, moments", [("ga", 1), ("ia", 2)])
def test_the_window_reduces_once_inside_its_end(arm, moments, tmp_path):
    parameters, entry, in_branches = train_step_reductions(arm, tmp_path)
    # Every step: scalars only (the loss's mean, the finiteness checks).
    assert entry and max(entry) <= 8, (parameters, entry)
    # The window's end: the sums (GA), or m and v (IA), of every parameter.
    assert sum(in_branches) == moments * parameters, (parameters, in_branches)


def test_update_accumulation_adam_keeps_keras_reduction(tmp_path):
    # UAA needs the reduced gradient on every micro-batch: Keras's step.
    parameters, entry, _ = train_step_reductions("uaa", tmp_path)
    assert max(entry) >= parameters, (parameters, entry)


# -- what the route trains to -------------------------------------------------

# What the training scripts share: the devices, 64 rows of data, the model.
PRELUDE = """
import json, sys, warnings, numpy as np, keras, keras_accum as ka
devices = keras.distribution.list_devices()
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 5)).astype("float32"); y = rng.normal(size=(64, 1)).astype("float32")
@keras.saving.register_keras_serializable(package="test_per_device")
class Net(ka.PerDeviceGradients, keras.Sequential):
    pass
"""

TRAIN_SCRIPT = (
    PRELUDE
    + """
assert len(devices) == 2
def fit(split, mixin, optimizer, batch_size, hidden=True):
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=devices) if split else None)
    keras.utils.set_random_seed(0)
    layers = [keras.Input((5,))]
    layers += [keras.layers.Dense(8, activation="tanh")] if hidden else []
    model = (Net if mixin else keras.Sequential)([*layers, keras.layers.Dense(1)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer = optimizer()  # under the distribution, as the model
        model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
        initial = [w.tolist() for w in model.get_weights()]
        history = model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    return dict(initial=initial, weights=[w.tolist() for w in model.get_weights()],
                history=history.history, warnings=[str(w.message) for w in caught],
                route=getattr(optimizer, "_device_route", None) is not None)
adam = lambda: keras.optimizers.Adam(0.01)
ga = lambda: ka.GradientAccumulation(adam(), steps=4)
uaa = lambda: ka.UpdateAccumulationAdam(0.01, steps=4)
runs = {
    "adam_64": fit(True, False, adam, 64),
    "ga_today": fit(True, False, ga, 16),
    "ga_route": fit(True, True, ga, 16),
    "uaa_today": fit(True, False, uaa, 16),
    "uaa_mixin": fit(True, True, uaa, 16),
    # A linear model: the numpy reference differentiates it by hand.
    "ia_route": fit(True, True, lambda: ka.InvariantAdam(0.01, steps=2), 16, hidden=False),
    "ia_one_device": fit(False, False, lambda: ka.InvariantAdam(0.01, steps=4), 8, hidden=False),
}
# kappa = steps x devices also where the hyperparameters follow it.
scaled = dict(scaling_rule="invariant", beta_2=0.99, use_ema=True, weight_decay=0.01)
ia = lambda steps: lambda: ka.InvariantAdam(1e-3, steps=steps, **scaled)
runs["ia_scaled_route"] = fit(True, True, ia(2), 16)
runs["ia_scaled_one_device"] = fit(False, False, ia(4), 8)
# Clipping: each device's gradient is a micro-batch, clipped by its own norm.
for clip, value in (("clipnorm", 0.05), ("global_clipnorm", 0.05), ("clipvalue", 0.01)):
    runs[f"ia_{clip}_route"] = fit(
        True, True, lambda: ka.InvariantAdam(0.01, steps=2, **{clip: value}), 16)
    runs[f"ia_{clip}_one_device"] = fit(
        False, False, lambda: ka.InvariantAdam(0.01, steps=4, **{clip: value}), 8)
runs["ia_unclipped_route"] = fit(True, True, lambda: ka.InvariantAdam(0.01, steps=2), 16)
# weigh_micro_batches: each device's own count, under a token mean with
# zero weights and a short last batch (56 rows: micro-batches 16, 16, 16
# and 8, windows of 2): the big batches of 32 and 24 exactly.
sw = (rng.random(56) > 0.3).astype("float32")
token_mean = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
def weighed(split, mixin, optimizer, batch_size, weigh):
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=devices) if split else None)
    keras.utils.set_random_seed(0)
    model = (Net if mixin else keras.Sequential)(
        [keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer(), loss=token_mean)
    if weigh:
        ka.weigh_micro_batches(model)
    model.fit(x[:56], y[:56], sample_weight=sw, batch_size=batch_size, epochs=2,
              shuffle=False, verbose=0)
    return dict(weights=[w.tolist() for w in model.get_weights()],
                route=model.optimizer._device_route is not None
                if hasattr(model.optimizer, "_device_route") else False)
ga2 = lambda: ka.GradientAccumulation(adam(), steps=2)
runs["weighed_route"] = weighed(True, True, ga2, 16, True)
runs["unweighed_route"] = weighed(True, True, ga2, 16, False)
runs["weighed_big_batch"] = weighed(False, False, adam, 32, False)
# Keras's step under DataParallel (no mixin) weighs the global batch's count.
runs["weighed_keras_step"] = weighed(True, False, ga2, 16, True)
# Dropout: each device draws its own mask, the seed's count moves as on
# one device (one draw per step); the accumulator's rows are the devices'.
keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
keras.utils.set_random_seed(0)
model = Net([keras.Input((32,)), keras.layers.Dropout(0.5), keras.layers.Dense(1, use_bias=False)])
optimizer = ka.GradientAccumulation(keras.optimizers.SGD(0.0), steps=4)
model.compile(optimizer=optimizer, loss="mae")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # ends inside a window, on purpose
    model.fit(np.ones((12, 32), "float32"), np.full((12, 1), -9.0, "float32"),
              batch_size=4, shuffle=False, verbose=0)
runs["dropout"] = dict(
    rows=[np.asarray(v.value).tolist() for v in optimizer.variables if "accumulator" in v.name],
    seed=[np.asarray(v.value).tolist() for v in model.non_trainable_variables
          if v.name == "seed_generator_state"])
# Two outputs (the compiled loss's trackers are metrics variables, added
# to inside the shard_map), saved and loaded mid-window, then trained on.
import os, tempfile
@keras.saving.register_keras_serializable(package="test_per_device")
class Functional(ka.PerDeviceGradients, keras.Model):
    pass
y2 = rng.normal(size=(64, 2)).astype("float32")
def two_outputs(cls):
    keras.utils.set_random_seed(0)
    i = keras.Input((5,)); h = keras.layers.Dense(8, activation="tanh")(i)
    model = cls(i, [keras.layers.Dense(1, name="a")(h), keras.layers.Dense(2, name="b")(h)])
    model.compile(optimizer=ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=3),
                  loss=["mse", "mae"], metrics=[["mae"], ["mse"]])
    history = model.fit(x, [y, y2], batch_size=16, epochs=2, shuffle=False, verbose=0).history
    return model, history
ours, ours_history = two_outputs(Functional)
keras_model, keras_history = two_outputs(keras.Model)
path = os.path.join(tempfile.mkdtemp(), "model.keras")
ours.save(path)
loaded = keras.models.load_model(path)
for model in (ours, loaded):
    model.fit(x, [y, y2], batch_size=16, epochs=1, shuffle=False, verbose=0)
runs["two_outputs"] = dict(
    history=ours_history, keras_history=keras_history,
    weights=[w.tolist() for w in ours.get_weights()],
    loaded=[w.tolist() for w in loaded.get_weights()],
    loaded_route=loaded.optimizer._device_route is not None)
print("RESULT", json.dumps(runs))
"""
)


@pytest.fixture(scope="module")
def runs():
    return _run(TRAIN_SCRIPT)


def _max_difference(ours, theirs):
    return max(float(np.max(np.abs(np.subtract(a, b)))) for a, b in zip(ours, theirs, strict=True))


def test_gradient_accumulation_per_device_is_the_big_batch(runs):
    route = runs["ga_route"]
    assert route["route"]
    assert not [w for w in route["warnings"] if "PerDeviceGradients" in w or "kappa" in w]
    assert _max_difference(route["weights"], runs["adam_64"]["weights"]) < 1e-5
    assert _max_difference(route["weights"], runs["ga_today"]["weights"]) < 1e-5
    # The loss and the metrics see the whole batch, as Keras's step does.
    for name, values in runs["ga_today"]["history"].items():
        np.testing.assert_allclose(route["history"][name], values, rtol=1e-6)


def test_weigh_micro_batches_counts_each_devices_items(runs):
    route, big = runs["weighed_route"], runs["weighed_big_batch"]
    assert route["route"]
    assert _max_difference(route["weights"], big["weights"]) < 1e-5
    # Keras's step (no mixin) under DataParallel: `weigh_micro_batches`
    # traced the train function before `fit` built the optimizer, whose
    # shardings it then lacked, and failed; now the same big batch.
    assert _max_difference(runs["weighed_keras_step"]["weights"], big["weights"]) < 1e-5
    # Without the counts the window is the mean of its micro-batches' means:
    # the control, which the big batch tells apart.
    unweighed = runs["unweighed_route"]
    assert unweighed["route"]
    assert _max_difference(unweighed["weights"], big["weights"]) > 1e-4


def test_update_accumulation_adam_under_the_mixin_is_keras_step(runs):
    mixin = runs["uaa_mixin"]
    assert not mixin["route"]
    assert _max_difference(mixin["weights"], runs["uaa_today"]["weights"]) == 0.0


def _linear_gradient(params, x, y):
    kernel, bias = params
    residual = x @ kernel + bias - y
    return [2.0 * x.T @ residual / len(x), 2.0 * residual.mean(0)]


def test_invariant_adam_per_device_counts_each_device_as_a_micro_batch(runs):
    route = runs["ia_route"]
    assert route["route"]
    assert not [w for w in route["warnings"] if "kappa" in w]
    # kappa = steps x devices = 4 micro-batches of 8: each device's half of
    # each global batch of 16, in order, as one device with steps=4 sees them.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 5)).astype("float32").astype("float64")
    y = rng.normal(size=(64, 1)).astype("float32").astype("float64")
    params = [np.asarray(w, "float64") for w in route["initial"]]
    reference = references.InvariantAdam(0.01, kappa=4)
    for _ in range(2):
        for start in range(0, 64, 8):
            half = slice(start, start + 8)
            params = reference.apply(params, _linear_gradient(params, x[half], y[half]))
    assert _max_difference(route["weights"], params) < 1e-5
    assert _max_difference(route["weights"], runs["ia_one_device"]["weights"]) < 1e-6
    # With scaling_rule="invariant" (lr and betas of kappa = 4), EMA and
    # weight decay: as one device with steps=4.
    scaled = runs["ia_scaled_route"]
    assert scaled["route"]
    assert _max_difference(scaled["weights"], runs["ia_scaled_one_device"]["weights"]) < 1e-6


@pytest.mark.parametrize("clip", ["clipnorm", "global_clipnorm", "clipvalue"])
def test_invariant_adam_clips_each_devices_micro_batch(runs, clip):
    route = runs[f"ia_{clip}_route"]
    assert route["route"]
    assert not [w for w in route["warnings"] if "clip" in w or "kappa" in w], route["warnings"]
    assert _max_difference(route["weights"], runs[f"ia_{clip}_one_device"]["weights"]) < 1e-6
    # The clip bites: unclipped, the route ends elsewhere.
    assert _max_difference(route["weights"], runs["ia_unclipped_route"]["weights"]) > 1e-4


def test_each_device_draws_its_own_dropout_mask(runs):
    (rows,) = runs["dropout"]["rows"]  # [devices, 32, 1]: 3 micro-batches of 2 items each
    rows = np.asarray(rows)[:, :, 0]
    assert rows.shape == (2, 32) and np.any(rows[0] != rows[1])
    (seed,) = runs["dropout"]["seed"]
    assert seed[1] == 3  # one draw per step, as on one device


def test_two_outputs_log_as_keras_and_resume_from_a_saved_model(runs):
    run = runs["two_outputs"]
    assert set(run["history"]) == set(run["keras_history"])
    for name, values in run["keras_history"].items():
        np.testing.assert_allclose(run["history"][name], values, rtol=1e-6, err_msg=name)
    # Saved mid-window (8 micro-batches, steps=3), loaded with its per-device
    # sums, trained one more epoch: as the model that never stopped.
    assert run["loaded_route"]
    assert _max_difference(run["loaded"], run["weights"]) == 0.0


# -- ModelParallel: a batch axis and a model axis ------------------------------

MODEL_PARALLEL = (
    PRELUDE
    + """
assert len(devices) == 4
def model_parallel(batch_axis_too=False):
    # 2 x 2: the batch split over 'batch', the hidden layer over 'model'.
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    # Keys match with or without the model's name: a loaded Sequential's
    # variables have no "net/" in their paths.
    layout_map[".*hidden/kernel"] = (None, "model")
    layout_map[".*hidden/bias"] = ("batch",) if batch_axis_too else ("model",)
    layout_map[".*out/kernel"] = ("model", None)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
OPTIMIZERS = {
    "adam": lambda steps: keras.optimizers.Adam(0.01),
    "ga": lambda steps: ka.GradientAccumulation(keras.optimizers.Adam(0.01), steps=steps),
    "ia": lambda steps: ka.InvariantAdam(0.01, steps=steps),
}
def fit(distribution, arm, steps, batch_size):
    keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(0)
    model = Net(name="net", layers=[
        keras.Input((5,)), keras.layers.Dense(64, activation="tanh", name="hidden"),
        keras.layers.Dense(1, name="out")])
    optimizer = OPTIMIZERS[arm](steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    return model, optimizer, [str(w.message) for w in caught]
def spec(variable):
    return [list(a) if isinstance(a, tuple) else a for a in variable.value.sharding.spec]
mode = sys.argv[1]
if mode == "hlo":
    model, optimizer, _ = fit(model_parallel(), sys.argv[2], 4, 16)
    import jax
    first = jax.devices()[0]
    shard = sum(s.data.size for v in model.trainable_variables
                for s in v.value.addressable_shards if s.device == first)
    result = dict(shard=shard, route=getattr(optimizer, "_device_route", None) is not None)
else:
    result = {}
    for arm, steps, reference_steps, reference_batch in (("ga", 4, 1, 64), ("ia", 2, 4, 8)):
        model, optimizer, caught = fit(model_parallel(), arm, steps, 16)
        reference, _, _ = fit(None, arm, reference_steps, reference_batch)
        rows = {v.path: spec(v) for v in optimizer.variables if optimizer._device_route.holds(v)}
        result[arm] = dict(
            route=optimizer._device_route is not None, warnings=caught, rows=rows,
            parameters={v.path: spec(v) for v in model.trainable_variables},
            difference=max(float(np.max(np.abs(a - b)))
                           for a, b in zip(model.get_weights(), reference.get_weights())))
    # Saved mid-window (8 micro-batches, steps=3), loaded under the same
    # mesh and trained one more epoch: as the model that never stopped.
    import os, tempfile
    model, _, _ = fit(model_parallel(), "ga", 3, 16)
    path = os.path.join(tempfile.mkdtemp(), "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    for m in (model, loaded):
        m.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    result["resumed"] = dict(
        route=loaded.optimizer._device_route is not None,
        rows={v.path: spec(v) for v in loaded.optimizer.variables
              if loaded.optimizer._device_route.holds(v)},
        difference=max(float(np.max(np.abs(a - b)))
                       for a, b in zip(model.get_weights(), loaded.get_weights())),
        state=max(float(np.max(np.abs(np.asarray(a.value) - np.asarray(b.value))))
                  for a, b in zip(model.optimizer.variables, loaded.optimizer.variables)))
    try:
        fit(model_parallel(batch_axis_too=True), "ga", 4, 16)
        result["error"] = None
    except ValueError as e:
        result["error"] = str(e)
print("RESULT", json.dumps(result))
"""
)


def replica_groups(line):
    """The device groups an all-reduce line reduces over, as a set of
    frozensets, from any of XLA's three spellings: explicit
    ``{{0,2},{1,3}}``, iota ``[2,2]<=[2,2]T(1,0)``, or the named mesh
    ``mesh['axis_0'=2,'axis_1'=2] {'axis_0'}``."""
    found = re.search(r"replica_groups=(\{\{[0-9,{}]*\}\})", line)
    if found:
        groups = re.findall(r"\{([0-9,]+)\}", found.group(1))
        return {frozenset(int(d) for d in g.split(",")) for g in groups}
    found = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", line)
    if found:
        shape, dims = [[int(d) for d in g.split(",")] for g in found.groups()[:2]]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if found.group(3):
            ids = ids.transpose([int(d) for d in found.group(3).split(",")])
        return {frozenset(row.tolist()) for row in ids.reshape(shape)}
    found = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    assert found, line  # a spelling this reader does not know fails here
    axes = re.findall(r"'(\w+)'=(\d+)", found.group(1))
    names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
    reduced = [names.index(a) for a in re.findall(r"'(\w+)'", found.group(2))]
    kept = [i for i in range(len(names)) if i not in reduced]
    ids = np.arange(math.prod(sizes)).reshape(sizes).transpose(kept + reduced)
    rows = ids.reshape(-1, math.prod(sizes[i] for i in reduced))
    return {frozenset(row.tolist()) for row in rows}


def test_the_replica_group_reader_reads_the_three_spellings():
    batch, model = {frozenset({0, 2}), frozenset({1, 3})}, {frozenset({0, 1}), frozenset({2, 3})}
    assert replica_groups("x = f32[] all-reduce(y), replica_groups={{0,2},{1,3}}, to") == batch
    assert replica_groups("replica_groups=[2,2]<=[4], use") == model
    assert replica_groups("replica_groups=[2,2]<=[2,2]T(1,0), use") == batch
    assert replica_groups("replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_0'}, u") == batch
    three = "replica_groups=mesh['axis_0'=2,'axis_1'={},'axis_2'={}] {{'{}'}}"
    assert replica_groups(three.format(1, 2, "axis_0")) == batch
    assert replica_groups(three.format(2, 1, "axis_1")) == model
    with pytest.raises(AssertionError):
        replica_groups("replica_groups=something_new")


BATCH_GROUPS = {frozenset({0, 2}), frozenset({1, 3})}  # mesh (2, 2): 'batch' first
MODEL_GROUPS = {frozenset({0, 1}), frozenset({2, 3})}


def model_parallel_reductions(arm, tmp_path):
    """(elements of each parameter on one device, the batch-axis all-reduce
    sizes on every call, those in the conditionals' branches) of the
    compiled train step of `arm` under ModelParallel on a 2 x 2 mesh; every
    all-reduce is over the batch axis or the model axis."""
    dump = tmp_path / arm
    flags = f"--xla_dump_to={dump} --xla_dump_hlo_as_text"
    result = _run(MODEL_PARALLEL, "hlo", arm, xla_flags=flags, devices=4)
    assert result["route"] == (arm != "adam")
    files = sorted(dump.glob("*jit_train_step*after_optimizations.txt"))
    assert len(files) == 1, files
    blocks, every_call, in_branches = step_parts(files[0])

    def batch_sizes(names):
        sizes = []
        for name in sorted(names):
            for line in blocks[name]:
                if not re.search(r"all-reduce(?:-start)?\(", line):
                    continue
                groups = replica_groups(line)
                assert groups in (BATCH_GROUPS, MODEL_GROUPS), line
                if groups == BATCH_GROUPS:
                    sizes += all_reduce_sizes([line])
        return sizes

    return result["shard"], batch_sizes(every_call), batch_sizes(in_branches)


@pytest.mark.parametrize("arm, moments", [("adam", 0), ("ga", 1), ("ia", 2)])
def test_model_parallel_reduces_over_the_batch_axis_once_per_window(arm, moments, tmp_path):
    shard, entry, in_branches = model_parallel_reductions(arm, tmp_path)
    # Per device: the hidden layer's half (5 x 32 + 32), out's kernel half
    # (32) and its whole bias (1).
    assert shard == 5 * 32 + 32 + 32 + 1
    if arm == "adam":  # the control: Keras's step reduces the gradients every step
        assert max(entry) >= shard, (shard, entry)
        return
    assert entry and max(entry) <= 8, (shard, entry)
    # One device's part of the sums (GA) or of m and v (IA), each sharded
    # over the model axis as its parameter.
    assert sum(in_branches) == moments * shard, (shard, in_branches)


def test_model_parallel_trains_as_one_device_with_rows_laid_out_as_parameters():
    result = _run(MODEL_PARALLEL, "train", devices=4)
    for arm in ("ga", "ia"):
        run = result[arm]
        assert run["route"] and not run["warnings"], run
        # GA: the big batch of 64; IA: kappa = steps x 2 devices = 4
        # micro-batches of 8, as one device with steps=4.
        assert run["difference"] < 1e-5, (arm, run["difference"])
        assert len(run["rows"]) == {"ga": 4, "ia": 8}[arm], run["rows"]
        for path, row_spec in run["rows"].items():
            parameter = next(p for p in run["parameters"] if p.replace("/", "_") in path)
            assert row_spec == ["batch", *run["parameters"][parameter]], (path, row_spec)
        # The layout map held: the hidden layer is split over 'model'.
        assert run["parameters"]["net/hidden/kernel"] == [None, "model"], run["parameters"]
    resumed = result["resumed"]
    assert resumed["route"] and resumed["difference"] == 0.0 and resumed["state"] == 0.0, resumed
    kernel_rows = [v for k, v in resumed["rows"].items() if k.endswith("hidden_kernel_accumulator")]
    assert kernel_rows == [["batch", None, "model"]], resumed["rows"]
    error = result["error"]
    assert error and "'batch'" in error and "net/hidden/bias" in error, error


BATCH_NORM = """
import json, numpy as np, keras, keras_accum as ka
keras.distribution.set_distribution(keras.distribution.DataParallel())
class Net(ka.PerDeviceGradients, keras.Sequential):
    pass
rng = np.random.default_rng(0)
x = rng.normal(1.0, 2.0, size=(48, 6, 2)).astype("float32")
y = rng.normal(size=(48, 1)).astype("float32")
def fitted(cls, layer, optimizer, batch_size):
    keras.utils.set_random_seed(0)
    m = cls([keras.Input((6, 2)), keras.layers.Conv1D(3, 3), layer,
             keras.layers.Flatten(), keras.layers.Dense(1)])
    m.compile(optimizer=optimizer, loss="mse")
    m.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return m
# Global micro-batches of 8 (4 per device), windows of 3: batches of 24.
ours = fitted(Net, ka.layers.BatchNormalization(momentum=0.5, momentum_unit="update"),
              ka.GradientAccumulation(keras.optimizers.SGD(0.0), steps=3), 8)
big = fitted(keras.Sequential, keras.layers.BatchNormalization(momentum=0.5),
             keras.optimizers.SGD(0.0), 24)
a, b = ours.layers[1], big.layers[1]
print("RESULT", json.dumps(dict(
    route=ours.optimizer._device_route is not None,
    relative=max(float(np.max(np.abs(np.asarray(getattr(a, n).value)
                                     - np.asarray(getattr(b, n).value))
                              / np.abs(np.asarray(getattr(b, n).value))))
                 for n in ("moving_mean", "moving_variance")))))
"""


def test_window_batch_norm_sums_every_devices_items():
    # Each device normalizes with its own statistics (as under
    # MirroredStrategy), but the window's moving statistics are those of all
    # its items: Keras's layer at the global big batch.
    result = _run(BATCH_NORM)
    assert result["route"]
    assert result["relative"] < 1e-5, result


@pytest.mark.parametrize("model_axis", [1, 2])
def test_the_bench_script_times_four_arms_and_counts_the_bytes(tmp_path, model_axis):
    # scripts/per_device_bench.py, tiny: every arm timed in every round, the
    # bytes per update from one device's part of the parameters (Keras's
    # step: `steps` gradients per update; ours: one; InvariantAdam: m and
    # v). With a model axis of 2 (4 devices) that part is about half.
    output = tmp_path / "bench.json"
    runner = (
        "import runpy, sys; sys.argv = sys.argv[1:]; "
        "runpy.run_path(sys.argv[0], run_name='__main__'); print('RESULT {}')"
    )
    _run(
        runner,
        os.path.join(ROOT, "scripts", "per_device_bench.py"),
        "--width=8",
        "--depth=1",
        "--micro_batch=8",
        "--micro_batches=8",
        "--rounds=2",
        f"--model_axis={model_axis}",
        f"--output={output}",
        devices=2 * model_axis,
    )
    result = json.loads(output.read_text())
    arms = {"adam", "ga_keras_step", "ga_per_device", "ia_per_device"}
    assert set(result["samples_ms"]) == arms
    assert all(len(v) == 2 and min(v) > 0 for v in result["samples_ms"].values())
    assert (result["devices"], result["model_axis"]) == (2, model_axis)
    # 8 -> 8 -> 1: hidden kernel and bias, out kernel split; out bias whole.
    assert result["params"] == 8 * 8 + 8 + 8 + 1
    assert result["params_per_device"] == (81 if model_axis == 1 else 32 + 4 + 4 + 1)
    size = result["params_per_device"] * 4
    assert result["bytes_all_reduced_per_update"] == {
        "adam": size,
        "ga_keras_step": 4 * size,
        "ga_per_device": size,
        "ia_per_device": 2 * size,
    }
    assert result["bytes_sent_per_device_per_update_ring"]["2"]["ga_keras_step"] == 4 * size
