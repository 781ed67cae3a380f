"""What `keras_accum.layers.BatchNormalization` changes, on MNIST-1D.

A small CNN with three batch-normalized convolutions, trained with Adam on
the 4000 MNIST-1D training examples (offline, `data.make_mnist1d`), in four
arms that see the same examples per update:

* `big_batch`: batches of b * kappa, `keras.optimizers.Adam`, Keras's layer;
* `keras_bn`: micro-batches of b, `GradientAccumulation(Adam, kappa)`,
  Keras's layer (moving statistics moved per micro-batch);
* `window_bn`: the same with `keras_accum.layers.BatchNormalization`,
  momentum 0.99 per update (`momentum_unit="update"`, the default of
  keras_accum 0.3.0);
* `window_renorm`: `window_bn` with `renorm=True` (clipping rmax 3, dmax 5);
* `window_bn_rescaled`: the layer's default, momentum 0.99 per micro-step
  (`momentum_unit="micro_step"`: 0.99 ** kappa per update), the horizon in
  examples of Keras's layer moved per micro-batch. (Measured first as
  `momentum=0.99 ** kappa` per update, the same numbers.)

Per run: test accuracy (inference: moving statistics), and how far each
layer's moving statistics are from the population statistics of its inputs
(the trained network in inference mode, over the training set): the mean
over channels of |moving mean - mean| / std and of |log(moving variance /
variance)|, averaged over the three layers, and the mean ratio moving
variance / variance. `scripts/batch_norm_study.py` runs the grid and prints
the table of docs/BATCH_NORM.md.
"""

from __future__ import annotations

import time

import keras
import numpy as np

import keras_accum as ka
from keras_accum.experiments import data

ARMS = ("big_batch", "keras_bn", "window_bn", "window_renorm", "window_bn_rescaled")
MOMENTUM = 0.99  # Keras's default
RENORM = {"renorm": True, "renorm_clipping": {"rmax": 3.0, "rmin": 1 / 3, "dmax": 5.0}}


def cnn(arm, kappa, channels=32):
    """Conv1D(5, 3, 3 stride 2) -> BN -> ReLU, three times; pooling; Dense."""
    layer = keras.layers.BatchNormalization
    kwargs = {"momentum": MOMENTUM}
    if arm.startswith("window_"):
        layer = ka.layers.BatchNormalization
        kwargs["momentum_unit"] = "micro_step" if arm == "window_bn_rescaled" else "update"
    if arm == "window_renorm":
        kwargs.update(RENORM)
    inputs = keras.Input((40,))
    x = keras.layers.Reshape((40, 1))(inputs)
    for kernel in (5, 3, 3):
        x = keras.layers.Conv1D(channels, kernel, strides=2, padding="same", use_bias=False)(x)
        x = layer(**kwargs)(x)
        x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x))


def statistics_gap(model, x):
    """(|mean gap| / std, |log variance ratio|, variance ratio), averaged
    over channels and layers: moving statistics against those of each
    layer's inputs over `x`, the network in inference mode."""
    layers = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    probe = keras.Model(model.inputs, [layer.input for layer in layers])
    activations = probe.predict(x, batch_size=500, verbose=0)
    mean_gaps, log_gaps, ratios = [], [], []
    for layer, a in zip(layers, activations):
        a = a.reshape(-1, a.shape[-1]).astype("float64")
        mean, variance = a.mean(0), a.var(0)
        moving_mean = layer.moving_mean.numpy().astype("float64")
        moving_variance = layer.moving_variance.numpy().astype("float64")
        mean_gaps.append(np.mean(np.abs(moving_mean - mean) / np.sqrt(variance)))
        log_gaps.append(np.mean(np.abs(np.log(moving_variance / variance))))
        ratios.append(np.mean(moving_variance / variance))
    return float(np.mean(mean_gaps)), float(np.mean(log_gaps)), float(np.mean(ratios))


def run_one(arm, micro_batch, kappa, seed, epochs, learning_rate, arrays):
    """One training run; returns its row (a dict)."""
    if arm not in ARMS:
        raise ValueError(f"`arm` must be one of {ARMS}. Received: arm={arm!r}")
    keras.utils.set_random_seed(seed)
    model = cnn(arm, kappa)
    adam = keras.optimizers.Adam(learning_rate)
    if arm == "big_batch":
        optimizer, batch_size = adam, micro_batch * kappa
    else:
        optimizer, batch_size = ka.GradientAccumulation(adam, steps=kappa), micro_batch
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        steps_per_execution=max(1, 256 // batch_size),  # fewer calls from Python
    )
    start = time.perf_counter()
    x, y = arrays["x"].astype("float32"), arrays["y"]
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=True, verbose=0)
    x_test = arrays["x_test"].astype("float32")
    _, accuracy = model.evaluate(x_test, arrays["y_test"], batch_size=500, verbose=0)
    mean_gap, log_gap, ratio = statistics_gap(model, x)
    return {
        "arm": arm,
        "micro_batch": micro_batch,
        "kappa": kappa,
        "seed": seed,
        "test_accuracy": float(accuracy),
        "mean_gap": mean_gap,
        "log_variance_gap": log_gap,
        "variance_ratio": ratio,
        "seconds": time.perf_counter() - start,
    }


def run(micro_batches, kappas, seeds, arms=ARMS, epochs=6, learning_rate=3e-3, log=print):
    """Every (micro-batch, kappa, seed, arm); returns the rows."""
    arrays = data.make_mnist1d()
    rows = []
    for micro_batch in micro_batches:
        for kappa in kappas:
            for seed in seeds:
                for arm in arms:
                    row = run_one(arm, micro_batch, kappa, seed, epochs, learning_rate, arrays)
                    log(row)
                    rows.append(row)
    return rows


def table(rows):
    """Markdown: mean (and spread over seeds) per (micro-batch, kappa, arm)."""
    lines = [
        "| b | kappa | arm | test accuracy | mean gap / std | abs log variance ratio "
        "| moving / true variance | seeds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r["micro_batch"], r["kappa"]) for r in rows})
    for micro_batch, kappa in keys:
        for arm in ARMS:
            group = [
                r
                for r in rows
                if (r["micro_batch"], r["kappa"], r["arm"]) == (micro_batch, kappa, arm)
            ]
            if not group:
                continue

            def cell(key, digits=3, group=group):
                values = np.array([r[key] for r in group])
                return f"{values.mean():.{digits}f} ± {values.std():.{digits}f}"

            lines.append(
                f"| {micro_batch} | {kappa} | {arm} | {cell('test_accuracy')} "
                f"| {cell('mean_gap')} | {cell('log_variance_gap')} "
                f"| {cell('variance_ratio')} | {len(group)} |"
            )
    return "\n".join(lines)


def plot(rows, png, epochs=6):
    """Test accuracy and moving / true variance per arm and (b, kappa), with
    the updates `epochs` gave; mean and seed std as error bars."""
    from keras_accum.experiments.invariance.report import mean_std, pyplot, save_figure

    plt = pyplot()
    groups = sorted({(r["micro_batch"], r["kappa"]) for r in rows})
    arms = [arm for arm in ARMS if any(r["arm"] == arm for r in rows)]
    fig, axes = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        for ax, key in zip(axes, ("test_accuracy", "variance_ratio")):
            stats = []
            for b, kappa in groups:
                cell = (arm, b, kappa)
                values = [r[key] for r in rows if (r["arm"], r["micro_batch"], r["kappa"]) == cell]
                stats.append(mean_std(values) if values else (float("nan"), 0.0))
            positions = [g + (i - (len(arms) - 1) / 2) * width for g in range(len(groups))]
            ax.bar(positions, [m for m, _ in stats], width, yerr=[s for _, s in stats], label=arm)
    axes[0].set_ylabel("test accuracy")
    axes[0].set_ylim(0.0, 1.15)
    axes[1].set_ylabel("moving / true variance")
    axes[1].set_yscale("log")
    axes[1].axhline(1.0, color="black", linewidth=0.8)
    updates = [epochs * 4000 // (b * kappa) for b, kappa in groups]
    axes[1].set_xticks(range(len(groups)))
    axes[1].set_xticklabels(
        [f"b={b}, kappa={k}\n{u} updates" for (b, k), u in zip(groups, updates)]
    )
    axes[0].legend(fontsize=8, ncol=len(arms))
    fig.suptitle(f"MNIST-1D CNN with 3 BatchNormalization layers, {epochs} epochs")
    fig.tight_layout()
    save_figure(fig, png)
    plt.close(fig)
