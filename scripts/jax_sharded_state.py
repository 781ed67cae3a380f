"""Bytes of optimizer state per device under `keras.distribution` (JAX).

An MLP (Input(D) -> Dense(4D, "hidden") -> Dense(D, "out"), D = --width)
trains 8 micro-batches of 16 with each optimizer on --devices JAX CPU
devices in three settings:

    one_device      no distribution
    data_parallel   DataParallel over every device
    model_parallel  ModelParallel, mesh (1, devices) ("batch", "model"); the
                    LayoutMap shards net/hidden/kernel (None, "model"),
                    net/hidden/bias ("model",), net/out/kernel ("model", None)

and reports, per optimizer and setting, the bytes on device 0 of the
parameters and of the optimizer state (the sum over `optimizer.variables`
of each variable's addressable shards on that device), and how many state
variables with a parameter's shape are not sharded as that parameter.

    python scripts/jax_sharded_state.py --output=after.json
    PYTHONPATH=<another checkout> python scripts/jax_sharded_state.py --output=before.json
    python scripts/jax_sharded_state.py --render=before.json,after.json

`--render` prints a Markdown table of one or more runs without measuring,
each run's columns named after the last "_"-separated part of its file
name (`..._before.json` -> "before").
"""

import argparse
import json
import os
import sys

OPTIMIZERS = ("adam", "grad_accum", "update_adam", "invariant")
SETTINGS = ("one_device", "data_parallel", "model_parallel")


def measure(width, devices_wanted):
    import jax
    import keras
    import numpy as np

    import keras_accum as ka

    devices = keras.distribution.list_devices()
    if len(devices) != devices_wanted:
        raise SystemExit(f"expected {devices_wanted} JAX devices, found {len(devices)}")
    factories = {
        "adam": lambda: keras.optimizers.Adam(1e-3),
        "grad_accum": lambda: ka.GradientAccumulation(keras.optimizers.Adam(1e-3), steps=4),
        "update_adam": lambda: ka.UpdateAccumulationAdam(1e-3, steps=4),
        "invariant": lambda: ka.InvariantAdam(1e-3, steps=4),
    }

    def distribution(setting):
        if setting == "one_device":
            return None
        if setting == "data_parallel":
            return keras.distribution.DataParallel(devices=devices)
        mesh = keras.distribution.DeviceMesh((1, len(devices)), ["batch", "model"], devices)
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map["net/hidden/kernel"] = (None, "model")
        layout_map["net/hidden/bias"] = ("model",)
        layout_map["net/out/kernel"] = ("model", None)
        return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")

    device = jax.devices()[0]

    def on_device(variables):
        return sum(
            shard.data.nbytes
            for v in variables
            for shard in v.value.addressable_shards
            if shard.device == device
        )

    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, width)).astype("float32")
    rows = []
    for setting in SETTINGS:
        for name in OPTIMIZERS:
            keras.distribution.set_distribution(distribution(setting))
            keras.utils.set_random_seed(0)
            model = keras.Sequential(
                name="net",
                layers=[
                    keras.Input((width,)),
                    keras.layers.Dense(4 * width, activation="tanh", name="hidden"),
                    keras.layers.Dense(width, name="out"),
                ],
            )
            optimizer = factories[name]()
            model.compile(optimizer=optimizer, loss="mse")
            model.fit(x, x, batch_size=16, epochs=1, shuffle=False, verbose=0)
            unlike = 0
            if setting != "one_device":
                for parameter in model.trainable_variables:
                    prefix = parameter.path.replace("/", "_") + "_"
                    for v in optimizer.variables:
                        if v.name.startswith(prefix) and v.value.sharding.spec != (
                            parameter.value.sharding.spec
                        ):
                            unlike += 1
            rows.append(
                {
                    "optimizer": name,
                    "setting": setting,
                    "param_bytes_device0": on_device(model.trainable_variables),
                    "state_bytes_device0": on_device(optimizer.variables),
                    "slots_unlike_parameter": unlike,
                }
            )
    keras.distribution.set_distribution(None)
    return {
        "keras_accum": ka.__file__,
        "keras": keras.__version__,
        "jax": jax.__version__,
        "width": width,
        "devices": devices_wanted,
        "rows": rows,
    }


def render(paths):
    runs = [json.load(open(path)) for path in paths]
    # A file's label: the last "_"-separated part of its name (x_before.json -> before).
    labels = [os.path.splitext(os.path.basename(path))[0].rsplit("_", 1)[-1] for path in paths]
    head = ["optimizer", "setting", "params on device 0 (bytes)"]
    for label in labels:
        head += [
            f"state on device 0, {label} (bytes)",
            f"slots not sharded as their parameter, {label}",
        ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, row in enumerate(runs[0]["rows"]):
        cells = [row["optimizer"], row["setting"], f"{row['param_bytes_device0']:,}"]
        for run in runs:
            other = run["rows"][i]
            if (other["optimizer"], other["setting"]) != (row["optimizer"], row["setting"]):
                raise SystemExit(f"runs differ in their rows. Received: {paths}")
            cells += [f"{other['state_bytes_device0']:,}", str(other["slots_unlike_parameter"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--output", help="where to write the JSON result")
    parser.add_argument("--render", help="comma-separated JSON results to tabulate")
    args = parser.parse_args(argv)
    if args.render:
        print(render(args.render.split(",")))
        return
    if args.width < 1:
        raise SystemExit(f"`--width` must be an integer >= 1. Received: --width={args.width}")
    # Before JAX is imported: the host platform's device count.
    flag = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    os.environ["KERAS_BACKEND"] = "jax"
    result = measure(args.width, args.devices)
    text = json.dumps(result, indent=1)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    print(render_rows(result))


def render_rows(result):
    return "\n".join(
        f"{r['optimizer']:12s} {r['setting']:15s} params {r['param_bytes_device0']:>10,} "
        f"state {r['state_bytes_device0']:>10,} unlike {r['slots_unlike_parameter']}"
        for r in result["rows"]
    )


if __name__ == "__main__":
    sys.exit(main())
