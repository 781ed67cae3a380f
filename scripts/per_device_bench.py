"""Per micro-batch time of `model.fit` under JAX's `DataParallel`, side by
side in one process (issue #49): plain Adam, `GradientAccumulation` on
Keras's step (every gradient all-reduced every micro-batch), and
`GradientAccumulation` and `InvariantAdam` under `PerDeviceGradients`
(one reduction per window). Each round fits one epoch of every arm, the
arms' order rotating; each ratio is taken within its round.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 KERAS_BACKEND=jax \\
        python scripts/per_device_bench.py --output=per_device_bench.json

With `--model_axis=2` the mesh is (devices / 2, 2), 'batch' x 'model',
under `ModelParallel` (each hidden layer's kernel and bias split over
'model', the output kernel's rows too): the batch axis's all-reduces
then carry one device's part of each gradient.

It also writes the bytes each arm all-reduces per update (float32
gradients; ring all-reduce, each device sends and receives 2 (D - 1) / D
times the buffer), for 2 devices and projected for 8 and 64: arithmetic
from the parameter count and `steps`, what tests/backends/test_per_device.py
reads from the compiled HLO for 2 devices.
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def distribution(model_axis):
    import keras

    if model_axis == 1:
        return keras.distribution.DataParallel()
    devices = keras.distribution.list_devices()
    if len(devices) % model_axis:
        raise ValueError(f"--model_axis={model_axis} does not divide the {len(devices)} devices")
    shape = (len(devices) // model_axis, model_axis)
    mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[r".*hidden_\d+/kernel"] = (None, "model")
    layout_map[r".*hidden_\d+/bias"] = ("model",)
    layout_map[".*out/kernel"] = ("model", None)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def measure(width, depth, micro_batch, steps, micro_batches, rounds, model_axis=1):
    import jax
    import keras
    import numpy as np

    import keras_accum as ka

    devices = len(keras.distribution.list_devices()) // model_axis  # on the batch axis
    keras.distribution.set_distribution(distribution(model_axis))

    class Net(ka.PerDeviceGradients, keras.Sequential):
        pass

    def layers():
        hidden = [
            keras.layers.Dense(width, activation="tanh", name=f"hidden_{i}") for i in range(depth)
        ]
        return [keras.Input((width,)), *hidden, keras.layers.Dense(1, name="out")]

    arms = {
        "adam": (keras.Sequential, lambda: keras.optimizers.Adam(1e-3)),
        "ga_keras_step": (
            keras.Sequential,
            lambda: ka.GradientAccumulation(keras.optimizers.Adam(1e-3), steps=steps),
        ),
        "ga_per_device": (
            Net,
            lambda: ka.GradientAccumulation(keras.optimizers.Adam(1e-3), steps=steps),
        ),
        "ia_per_device": (Net, lambda: ka.InvariantAdam(1e-3, steps=steps)),
    }
    rng = np.random.default_rng(0)
    x = rng.normal(size=(micro_batch * micro_batches, width)).astype("float32")
    y = rng.normal(size=(micro_batch * micro_batches, 1)).astype("float32")
    models = {}
    for name, (cls, make) in arms.items():
        keras.utils.set_random_seed(0)
        model = cls(layers())
        model.compile(optimizer=make(), loss="mse")
        model.fit(x, y, batch_size=micro_batch, epochs=1, verbose=0)  # compiled, warm
        models[name] = model
    params = sum(int(np.prod(v.shape)) for v in models["adam"].trainable_variables)
    first = jax.devices()[0]  # one device's part of the parameters (all, without a model axis)
    shard = sum(
        s.data.size
        for v in models["adam"].trainable_variables
        for s in v.value.addressable_shards
        if s.device == first
    )
    samples = {name: [] for name in arms}
    names = list(arms)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            models[name].fit(x, y, batch_size=micro_batch, epochs=1, verbose=0)
            samples[name].append((time.perf_counter() - start) / micro_batches * 1e3)

    def summary(values):
        q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
        return {"median": statistics.median(values), "q1": q[0], "q3": q[2]}

    base = samples["adam"]
    # Bytes all-reduced per update of `steps` micro-batches (the big batch's
    # one update), per device, float32: plain Adam at the big batch sends
    # its gradient once; Keras's step every micro-batch; ours once.
    gradient = shard * 4
    per_update = {"adam": gradient, "ga_keras_step": steps * gradient, "ga_per_device": gradient}
    per_update["ia_per_device"] = 2 * gradient  # m and v
    traffic = {
        str(d): {name: 2 * (d - 1) / d * size for name, size in per_update.items()}
        for d in (devices, 8, 64)
    }
    return {
        "keras": keras.__version__,
        "devices": devices,
        "model_axis": model_axis,
        "params": params,
        "params_per_device": shard,
        "micro_batch": micro_batch,
        "steps": steps,
        "micro_batches_per_round": micro_batches,
        "ms_per_micro_batch": {name: summary(v) for name, v in samples.items()},
        "ratio_to_adam": {
            name: summary([a / b for a, b in zip(v, base)]) for name, v in samples.items()
        },
        "samples_ms": samples,
        "bytes_all_reduced_per_update": per_update,
        "bytes_sent_per_device_per_update_ring": traffic,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--micro_batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--micro_batches", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--model_axis", type=int, default=1)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    result = measure(
        args.width,
        args.depth,
        args.micro_batch,
        args.steps,
        args.micro_batches,
        args.rounds,
        args.model_axis,
    )
    text = json.dumps(result, indent=1)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
