"""What per-device gradients would cost `InvariantAdam` under JAX's
`DataParallel`, measured on --devices JAX CPU devices.

Keras's JAX trainer differentiates the loss of the whole (sharded) batch
inside one `jax.jit` (keras/src/backend/jax/trainer.py, `train_step`): XLA
all-reduces each device's partial gradient before the optimizer sees it, so
`InvariantAdam` squares the average of the devices' gradients, not each one
(kappa = steps, not steps x devices). Getting each device's gradient takes
`jax.shard_map` around the differentiation, in a `train_step` of one's own,
and one more all-reduce per step, of the squares. Three jitted gradient
computations of the same Keras MLP (`model.stateless_call`, mean squared
error) on a batch split over the devices:

    keras_like   grad of the batch's mean loss under jit (what `fit` runs):
                 one all-reduce, the mean gradient
    shard_mean   shard_map: each device's gradient, `pmean` of it (the
                 same result as keras_like: the cost of shard_map alone)
    shard_both   shard_map: `pmean` of each device's gradient and of its
                 square (what InvariantAdam would need: two all-reduces)

The script checks that the three mean gradients agree (and the mean of the
squares against numpy), then times each (median and quartiles of
--rounds rounds of --calls calls, the three interleaved within a round,
each ratio taken within its round).

    python scripts/jax_per_device_grads.py --output=per_device.json
"""

import argparse
import json
import os
import statistics
import sys
import time


def measure(width, depth, batch, rounds, calls, devices_wanted):
    import jax
    import jax.numpy as jnp
    import keras
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.devices()
    if len(devices) != devices_wanted:
        raise SystemExit(f"expected {devices_wanted} JAX devices, found {len(devices)}")
    mesh = jax.sharding.Mesh(np.array(devices), ("batch",))
    keras.utils.set_random_seed(0)
    layers = [keras.Input((width,))]
    layers += [keras.layers.Dense(width, activation="tanh") for _ in range(depth)]
    model = keras.Sequential([*layers, keras.layers.Dense(1)])
    params = [v.value for v in model.trainable_variables]
    n_params = sum(int(np.prod(p.shape)) for p in params)

    def loss(trainable, x, y):
        y_pred, _ = model.stateless_call(trainable, [], x)
        return jnp.mean(jnp.square(y_pred - y))

    grad = jax.grad(loss)
    replicated = NamedSharding(mesh, P())
    split = NamedSharding(mesh, P("batch"))
    params = jax.device_put(params, replicated)
    rng = np.random.default_rng(0)
    x = jax.device_put(rng.normal(size=(batch, width)).astype("float32"), split)
    y = jax.device_put(rng.normal(size=(batch, 1)).astype("float32"), split)

    keras_like = jax.jit(grad, out_shardings=replicated)

    def per_device(both):
        def body(trainable, x, y):
            # Varying over "batch" before differentiating: the gradient of a
            # replicated (invariant) input would come back already summed.
            trainable = jax.tree.map(lambda p: jax.lax.pcast(p, "batch", to="varying"), trainable)
            g = grad(trainable, x, y)
            mean = jax.lax.pmean(g, "batch")
            if not both:
                return mean
            return mean, jax.lax.pmean(jax.tree.map(jnp.square, g), "batch")

        out_specs = (P(), P()) if both else P()
        mapped = jax.shard_map(
            body, mesh=mesh, in_specs=(P(), P("batch"), P("batch")), out_specs=out_specs
        )
        return jax.jit(mapped)

    arms = {
        "keras_like": keras_like,
        "shard_mean": per_device(False),
        "shard_both": per_device(True),
    }

    # The prototype is right: the same mean gradient three ways, and the
    # mean over devices of each device's squared gradient.
    reference = keras_like(params, x, y)
    mean_only = arms["shard_mean"](params, x, y)
    mean, squares = arms["shard_both"](params, x, y)
    local = batch // devices_wanted
    xs, ys = np.asarray(x), np.asarray(y)
    expected_squares = [
        np.mean(
            [
                np.square(
                    np.asarray(
                        grad(
                            params, xs[i * local : (i + 1) * local], ys[i * local : (i + 1) * local]
                        )[k]
                    )
                )
                for i in range(devices_wanted)
            ],
            axis=0,
        )
        for k in range(len(params))
    ]
    agreement = 0.0
    for a, b, c, s, e in zip(reference, mean_only, mean, squares, expected_squares):
        for other in (b, c):
            agreement = max(agreement, float(np.max(np.abs(np.asarray(a) - np.asarray(other)))))
        agreement = max(
            agreement, float(np.max(np.abs(np.asarray(s) - e)) / (np.max(np.abs(e)) + 1e-30))
        )
    if agreement > 1e-4:
        raise SystemExit(f"the three gradients disagree: max difference {agreement}")

    for fn in arms.values():  # compiled and warm
        jax.block_until_ready(fn(params, x, y))
    samples = {name: [] for name in arms}
    for r in range(rounds):
        names = list(arms)
        names = names[r % len(names) :] + names[: r % len(names)]
        for name in names:
            fn = arms[name]
            start = time.perf_counter()
            for _ in range(calls):
                out = fn(params, x, y)
            jax.block_until_ready(out)
            samples[name].append((time.perf_counter() - start) / calls * 1e3)

    def summary(values):
        q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
        return {"median": statistics.median(values), "q1": q[0], "q3": q[2]}

    base = samples["keras_like"]
    result = {
        "jax": jax.__version__,
        "keras": keras.__version__,
        "devices": devices_wanted,
        "platform": devices[0].platform,
        "params": n_params,
        "batch": batch,
        "max_disagreement": agreement,
        "ms_per_call": {name: summary(v) for name, v in samples.items()},
        "ratio_to_keras_like": {
            name: summary([a / b for a, b in zip(v, base)]) for name, v in samples.items()
        },
        # The squares' all-reduce alone: shard_both against shard_mean.
        "both_to_mean": summary(
            [a / b for a, b in zip(samples["shard_both"], samples["shard_mean"])]
        ),
        "samples_ms": samples,
    }
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--output", help="where to write the JSON result")
    args = parser.parse_args(argv)
    for name in ("width", "depth", "batch", "rounds", "calls", "devices"):
        if getattr(args, name) < 1:
            raise SystemExit(
                f"`--{name}` must be an integer >= 1. Received: --{name}={getattr(args, name)}"
            )
    if args.batch % args.devices:
        raise SystemExit(
            f"`--batch` must be a multiple of --devices={args.devices}. "
            f"Received: --batch={args.batch}"
        )
    flag = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    result = measure(args.width, args.depth, args.batch, args.rounds, args.calls, args.devices)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)
    print(f"params {result['params']:,}  batch {result['batch']}  devices {result['devices']}")
    for name, ms in result["ms_per_call"].items():
        ratio = result["ratio_to_keras_like"][name]
        print(
            f"{name:11s} {ms['median']:8.3f} ms [{ms['q1']:.3f}, {ms['q3']:.3f}]  "
            f"x{ratio['median']:.3f} [{ratio['q1']:.3f}, {ratio['q3']:.3f}]"
        )
    both = result["both_to_mean"]
    print(f"shard_both / shard_mean x{both['median']:.3f} [{both['q1']:.3f}, {both['q3']:.3f}]")


if __name__ == "__main__":
    sys.exit(main())
