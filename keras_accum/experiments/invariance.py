"""Batch-size invariance study: training curves versus examples seen.

The claim tested (Wang & Aitchison 2024, arXiv:2402.18824; ALGORITHMS.md
sections 3 and 4): with the micro-batch size fixed, `InvariantAdam` with the
linear rule (lr x kappa, 1 - beta x kappa) gives the same training curve,
as a function of examples seen, whatever the number kappa of micro-batches
per update, for small enough learning rates; standard Adam on the averaged
gradient needs the square-root rule (Malladi et al. 2022), which holds only
when gradient noise dominates.

Every run of a seed starts from the same weights and sees the same stream of
micro-batches; only how the stream is grouped into updates changes. Methods,
from base hyperparameters tuned at kappa = 1:

| method                | optimizer                                            |
|-----------------------|------------------------------------------------------|
| `invariant`           | `InvariantAdam(steps=kappa, **scale(kappa, "invariant"))` |
| `sqrt`                | `GradientAccumulation(Adam(**scale(kappa, "sqrt")), kappa)` |
| `update_accumulation` | `UpdateAccumulationAdam(base_lr, steps=kappa)` (per-micro-batch rate) |
| `plain`               | `GradientAccumulation(Adam(base_lr), kappa)`, no rescaling |

At kappa = 1 all four are `keras.optimizers.Adam` (tests/test_invariance.py
checks they give identical numbers), so with `share_kappa1` that run is done
once per (learning rate, seed) and recorded under every method.

Evaluation points are multiples of `eval_every` examples, a multiple of the
largest window (max kappa x micro-batch size): every kappa sits at a window
end there. The *spread* at a point is max - min over kappa of a metric; a
run's spread is its mean over the evaluation points after the start
(examples > 0) and its value at the end.

Speed: one model and one compiled training loop (`tf.function` over a chunk
of micro-batches) per (method, kappa), reused for every learning rate and
seed by resetting the weights and the optimizer state.

Output folder (`run_study(config, workdir)`):

    config.json        the resolved config (re-run it with --config)
    runs.csv           a row per (method, learning_rate, kappa, seed, examples)
    noise_scale.csv    B_simple of the initial and of the trained models
    spread.md          the spread table (Markdown) and the noise scale
    spread_vs_lr.png   spread versus base learning rate, a line per method
    curves_lr_*.png    loss versus examples, a panel per method, a line per kappa
    summary.json       run time and counts
"""

import csv
import functools
import json
import math
import pathlib
import time

import keras
import numpy as np
import tensorflow as tf

import keras_accum as ka
from keras_accum import diagnostics
from keras_accum.experiments import data, experiment, models

METHODS = ("invariant", "sqrt", "update_accumulation", "plain")
METRICS = ("train_loss", "test_loss", "test_accuracy")

DEFAULTS = {
    "dataset": "mnist1d",
    "data_dir": None,
    "model": "mlp",
    "micro_batch_size": 32,
    "kappas": [1, 2, 4, 8],
    "methods": list(METHODS),
    # Base hyperparameters at kappa = 1; each method rescales them.
    "learning_rates": [3e-4, 1e-3, 3e-3],
    "beta_1": 0.9,
    "beta_2": 0.999,
    "epsilon": 1e-7,
    "seeds": [0, 1, 2],
    "train_examples": 16384,  # examples seen per run
    "eval_every": 1024,  # examples; a multiple of max(kappas) x micro batch
    "train_eval_examples": 1000,  # fixed train subset for the train loss
    "share_kappa1": True,
    "plot_learning_rates": [1e-3],  # one curves_lr_*.png each
    # B_simple probes: windows of `noise_scale_kappa` micro-batches.
    "noise_scale_windows": 32,
    "noise_scale_kappa": 8,
    # Bias-corrected EMA over probes of a fixed model: 0.99 weights the
    # windows nearly uniformly (the tracker is built for moving models).
    "noise_scale_ema": 0.99,
    "verbose": 1,
}


def _is_int(value, low):
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def resolve_config(config):
    """DEFAULTS updated with `config`; refuses unknown keys and bad values."""
    unknown = sorted(set(config) - set(DEFAULTS))
    if unknown:
        raise ValueError(
            f"Unknown config key(s) {unknown}. Valid keys: {', '.join(sorted(DEFAULTS))}"
        )
    c = {**DEFAULTS, **config}
    for key in ("kappas", "methods", "learning_rates", "seeds", "plot_learning_rates"):
        c[key] = list(c[key])
    for key in (
        "micro_batch_size",
        "train_examples",
        "eval_every",
        "train_eval_examples",
        "noise_scale_windows",
    ):
        if not _is_int(c[key], 1):
            raise ValueError(f"`{key}` must be an integer >= 1. Received: {key}={c[key]!r}")
    if not _is_int(c["noise_scale_kappa"], 2):
        raise ValueError(
            "`noise_scale_kappa` must be an integer >= 2. "
            f"Received: noise_scale_kappa={c['noise_scale_kappa']!r}"
        )
    if not c["kappas"] or not all(_is_int(k, 1) for k in c["kappas"]):
        raise ValueError(
            f"`kappas` must be a non-empty list of integers >= 1. Received: kappas={c['kappas']!r}"
        )
    bad = [m for m in c["methods"] if m not in METHODS]
    if bad or not c["methods"]:
        raise ValueError(
            f"`methods` must be a non-empty subset of "
            f"{list(METHODS)}. Received: methods={c['methods']!r}"
        )
    if not c["learning_rates"] or not all(
        isinstance(lr, (int, float)) and lr > 0 for lr in c["learning_rates"]
    ):
        raise ValueError(
            "`learning_rates` must be a non-empty list of "
            f"numbers > 0. Received: "
            f"learning_rates={c['learning_rates']!r}"
        )
    if not c["seeds"] or not all(_is_int(s, 0) for s in c["seeds"]):
        raise ValueError(
            f"`seeds` must be a non-empty list of integers >= 0. Received: seeds={c['seeds']!r}"
        )
    missing = [lr for lr in c["plot_learning_rates"] if lr not in c["learning_rates"]]
    if missing:
        raise ValueError(
            "`plot_learning_rates` must be among "
            f"`learning_rates`. Received: "
            f"plot_learning_rates={c['plot_learning_rates']!r}"
        )
    window = max(c["kappas"]) * c["micro_batch_size"]
    if c["eval_every"] % window:
        raise ValueError(
            f"`eval_every` must be a multiple of the largest window "
            f"max(kappas) x micro_batch_size = {window}, so that every kappa "
            f"is at a window end. Received: eval_every={c['eval_every']}"
        )
    if c["train_examples"] % c["eval_every"]:
        raise ValueError(
            "`train_examples` must be a multiple of `eval_every`. Received: "
            f"train_examples={c['train_examples']}, "
            f"eval_every={c['eval_every']}"
        )
    for kappa in c["kappas"]:  # Fail now, not after an hour of runs.
        for method in c["methods"]:
            optimizer_hyperparameters(method, kappa, 1e-3, c["beta_1"], c["beta_2"], c["epsilon"])
    return c


def load_config_file(path, variant):
    """`get_config(variant)` of a saved_configs/*.py file, or a run
    folder's config.json (then `variant` is ignored)."""
    return experiment.load_config_file(path, variant)


# -- optimizers ---------------------------------------------------------------


def optimizer_hyperparameters(method, kappa, base_lr, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
    """The Adam hyperparameters `method` uses at `kappa` from the base ones."""
    base = {"learning_rate": base_lr, "beta_1": beta_1, "beta_2": beta_2, "epsilon": epsilon}
    if method in ("invariant", "sqrt"):
        return ka.scale_hyperparameters(kappa, method, **base)
    if method in ("update_accumulation", "plain"):
        # update_accumulation: lr is a per-micro-batch rate, unscaled by
        # design; plain: no rescaling at all (the naive baseline).
        return base
    raise ValueError(f"`method` must be one of {list(METHODS)}. Received: method={method!r}")


def make_optimizer(method, kappa, base_lr, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
    """The optimizer of `method` for kappa micro-batches per update."""
    h = optimizer_hyperparameters(method, kappa, base_lr, beta_1, beta_2, epsilon)
    if method == "invariant":
        return ka.InvariantAdam(steps=kappa, **h)
    if method == "update_accumulation":
        return ka.UpdateAccumulationAdam(steps=kappa, **h)
    # sqrt (Malladi) and plain: standard accumulation of the mean gradient.
    return ka.GradientAccumulation(keras.optimizers.Adam(**h), steps=kappa)


# -- data ---------------------------------------------------------------------


def load_arrays(dataset, split, data_dir=None):
    """The whole split as numpy (features, labels)."""
    xs, ys = [], []
    for x, y in data.load(dataset, split, data_dir=data_dir, batch_size=4096):
        xs.append(x.numpy())
        ys.append(y.numpy())
    return np.concatenate(xs), np.concatenate(ys)


def micro_batch_indices(num_examples, micro_batch_size, num_micro_batches, seed):
    """[num_micro_batches, micro_batch_size] example indices: a seeded
    stream of epochs, each a fresh permutation, cut into micro-batches
    (a micro-batch may straddle an epoch end). The same stream serves
    every kappa of a seed."""
    rng = np.random.default_rng([seed, 1])
    need = num_micro_batches * micro_batch_size
    epochs = -(-need // num_examples)
    stream = np.concatenate([rng.permutation(num_examples) for _ in range(epochs)])
    return stream[:need].reshape(num_micro_batches, micro_batch_size)


# -- training -----------------------------------------------------------------


class Trainer:
    """One model; one compiled training loop per (method, kappa), reused.

    `run(...)` sets the model's weights, zeroes the optimizer's state (all
    its variables: moments, accumulators, counters), sets its learning rate
    and trains; betas and epsilon depend on (method, kappa) only, so the
    compiled loop of a (method, kappa) serves every base learning rate.

    Args:
        model_name, input_shape, num_classes: for `models.build_model`.
        eval_data: dict with `train` and `test`, each (x, y) numpy arrays:
            the train loss is measured on `train`, loss and accuracy on
            `test`, all with `training=False`.
        beta_1, beta_2, epsilon: base Adam hyperparameters (kappa = 1).
    """

    def __init__(
        self,
        model_name,
        input_shape,
        num_classes,
        eval_data,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-7,
    ):
        self._build = lambda: models.build_model(model_name, input_shape, num_classes)
        self.model = self._build()
        self.betas_epsilon = (beta_1, beta_2, epsilon)
        self._loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self._eval_data = {k: tuple(tf.constant(a) for a in v) for k, v in eval_data.items()}
        self._evaluate = tf.function(self._evaluate_fn)
        self._gradient = tf.function(self._gradient_fn)
        self._runners, self._probes = {}, {}

    def initial_weights(self, seed):
        """Weights of a model built after `keras.utils.set_random_seed`."""
        keras.utils.set_random_seed(seed)
        return self._build().get_weights()

    def _evaluate_fn(self):
        (xtr, ytr), (xte, yte) = self._eval_data["train"], self._eval_data["test"]
        train_loss = self._loss(ytr, self.model(xtr, training=False))
        logits = self.model(xte, training=False)
        test_loss = self._loss(yte, logits)
        correct = tf.equal(tf.argmax(logits, -1, output_type=tf.int32), yte)
        return train_loss, test_loss, tf.reduce_mean(tf.cast(correct, tf.float32))

    def evaluate(self):
        return dict(zip(METRICS, (float(v) for v in self._evaluate())))

    def _gradient_fn(self, x, y):
        # Mean loss over the micro-batch: a micro-batch mean gradient g_j.
        with tf.GradientTape() as tape:
            loss = self._loss(y, self.model(x, training=True))
        return tape.gradient(loss, self.model.trainable_variables)

    def _runner(self, method, kappa):
        key = (method, kappa)
        if key not in self._runners:
            optimizer = make_optimizer(method, kappa, 1e-3, *self.betas_epsilon)
            variables = self.model.trainable_variables
            optimizer.build(variables)

            # A partial, not a closure: TensorFlow then counts each loop's
            # (single) trace on its own instead of warning about retracing.
            train_chunk = tf.function(
                functools.partial(_train_chunk, self._gradient_fn, optimizer, variables)
            )
            h = optimizer_hyperparameters(method, kappa, 1e-3, *self.betas_epsilon)
            built_with = {k: v for k, v in h.items() if k != "learning_rate"}
            self._runners[key] = (optimizer, train_chunk, built_with)
        return self._runners[key]

    def run(self, method, kappa, base_lr, weights, xs, ys, chunk):
        """Trains from `weights` on the micro-batches `xs`, `ys` (shapes
        [n, b, ...], [n, b]), evaluating at the start and every `chunk`
        micro-batches. Returns a list of dicts: examples, updates, metrics."""
        optimizer, train_chunk, built_with = self._runner(method, kappa)
        h = optimizer_hyperparameters(method, kappa, base_lr, *self.betas_epsilon)
        fixed = {k: v for k, v in h.items() if k != "learning_rate"}
        if fixed != built_with:  # Betas compiled in must not depend on lr.
            raise ValueError(
                f"{method} at kappa={kappa}: {fixed} differ from the compiled {built_with}."
            )
        for variable in optimizer.variables:
            variable.assign(tf.zeros(variable.shape, variable.dtype))
        optimizer.learning_rate = h["learning_rate"]
        for variable, value in zip(self.model.weights, weights):
            variable.assign(value)
        b = int(xs.shape[1])
        points = [{"examples": 0, "updates": 0, **self.evaluate()}]
        for start in range(0, int(xs.shape[0]), chunk):
            train_chunk(xs[start : start + chunk], ys[start : start + chunk])
            points.append(
                {
                    "examples": (start + chunk) * b,
                    "updates": int(optimizer.iterations.numpy()),
                    **self.evaluate(),
                }
            )
        return points

    def noise_scale(self, x, y, micro_batch_size, kappa, windows, seed, ema=0.99):
        """B_simple of the model as it is, from `windows` probe windows of
        `kappa` micro-batches drawn from (x, y) without replacement, each
        fed to `diagnostics.GradientNoiseScale.update_from_micro_grads`.
        Returns the tracker's `result()` as floats (B_simple is inf when the
        smoothed |G|^2 estimate is <= 0: signal not resolved)."""
        key = (micro_batch_size, kappa, ema)
        if key not in self._probes:
            tracker = diagnostics.GradientNoiseScale(ema)

            @tf.function(autograph=False)  # no control flow to convert
            def probe(xw, yw):  # [kappa, b, ...]: one window, compiled
                micro = [self._gradient_fn(xw[j], yw[j]) for j in range(kappa)]
                tracker.update_from_micro_grads(micro, micro_batch_size)

            self._probes[key] = (tracker, probe)
        tracker, probe = self._probes[key]
        for variable in tracker.variables:  # A fresh estimate: zero state.
            variable.assign(tf.zeros_like(variable))
        rng = np.random.default_rng([seed, 2])
        for _ in range(windows):
            idx = rng.choice(len(x), kappa * micro_batch_size, replace=False)
            idx = idx.reshape(kappa, micro_batch_size)
            probe(tf.constant(x[idx]), tf.constant(y[idx]))
        return {k: float(v) for k, v in tracker.result().items()}


def _train_chunk(gradient_fn, optimizer, variables, xs, ys):
    # One apply per micro-batch; the optimizer decides when a window ends.
    # A graph loop: no Python overhead per micro-batch.
    for i in tf.range(tf.shape(xs)[0]):
        optimizer.apply(gradient_fn(xs[i], ys[i]), variables)


# -- the study ----------------------------------------------------------------


def _log(config, message):
    if config["verbose"]:
        print(message, flush=True)


def run_study(config, workdir):
    """Runs the study of `config` and writes the output folder `workdir`
    (see the module docstring). Returns the summary dict."""
    config = resolve_config(config)
    workdir = pathlib.Path(workdir)
    if workdir.exists() and any(workdir.iterdir()):
        raise FileExistsError(f"workdir={str(workdir)!r} is not empty; choose a new folder.")
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    started, cpu_started = time.time(), time.process_time()

    info = data.dataset_info(config["dataset"], config["data_dir"])
    x_train, y_train = load_arrays(config["dataset"], "train", config["data_dir"])
    test = load_arrays(config["dataset"], "test", config["data_dir"])
    n_eval = config["train_eval_examples"]
    trainer = Trainer(
        config["model"],
        info.input_shape,
        info.num_classes,
        {"train": (x_train[:n_eval], y_train[:n_eval]), "test": test},
        config["beta_1"],
        config["beta_2"],
        config["epsilon"],
    )

    b = config["micro_batch_size"]
    num_micro = config["train_examples"] // b
    chunk = config["eval_every"] // b
    kappas, methods = config["kappas"], config["methods"]
    share = config["share_kappa1"]
    per_seed = len(config["learning_rates"]) * sum(
        1 if (k == 1 and share) else len(methods) for k in kappas
    )
    total = per_seed * len(config["seeds"])
    _log(
        config,
        f"{total} runs of {config['train_examples']} examples "
        f"({num_micro} micro-batches of {b}); {len(config['seeds'])} seeds "
        f"x {len(config['learning_rates'])} learning rates x kappa {kappas} "
        f"x {methods}",
    )

    rows, noise_rows, done = [], [], 0
    noise_args = (b, config["noise_scale_kappa"], config["noise_scale_windows"])
    for seed in config["seeds"]:
        weights = trainer.initial_weights(seed)
        idx = micro_batch_indices(len(x_train), b, num_micro, seed)
        xs, ys = tf.constant(x_train[idx]), tf.constant(y_train[idx])
        for variable, value in zip(trainer.model.weights, weights):
            variable.assign(value)
        noise_rows.append(
            {
                "seed": seed,
                "model": "initial",
                "learning_rate": "",
                **trainer.noise_scale(
                    x_train, y_train, *noise_args, seed=seed, ema=config["noise_scale_ema"]
                ),
            }
        )
        for lr in config["learning_rates"]:
            for kappa in kappas:
                # At kappa = 1 every method is Adam: run it once, record it
                # under each method.
                shared = kappa == 1 and share
                ran = methods[:1] if shared else methods
                for method in ran:
                    t = time.time()
                    points = trainer.run(method, kappa, lr, weights, xs, ys, chunk)
                    done += 1
                    h = optimizer_hyperparameters(
                        method, kappa, lr, config["beta_1"], config["beta_2"], config["epsilon"]
                    )
                    recorded = methods if shared else [method]
                    for as_method in recorded:
                        for p in points:
                            rows.append(
                                {
                                    "method": as_method,
                                    "learning_rate": lr,
                                    "kappa": kappa,
                                    "seed": seed,
                                    **p,
                                    "ran_as": method,
                                    "optimizer_learning_rate": h["learning_rate"],
                                    "beta_1": h["beta_1"],
                                    "beta_2": h["beta_2"],
                                    "epsilon": h["epsilon"],
                                }
                            )
                    elapsed = time.time() - started
                    end = points[-1]
                    _log(
                        config,
                        (
                            f"[{done:4d}/{total}] seed {seed} lr {lr:g} kappa "
                            f"{kappa} {'all (Adam)' if shared else method}"
                            f": train loss {end['train_loss']:.4f} test acc "
                            f"{end['test_accuracy']:.3f} ({time.time() - t:.1f}s;"
                            f" elapsed {elapsed / 60:.1f} min, eta "
                            f"{elapsed / done * (total - done) / 60:.1f} min)"
                        ),
                    )
                    if kappa == 1 and method == ran[0]:
                        noise_rows.append(
                            {
                                "seed": seed,
                                "model": "trained, kappa=1",
                                "learning_rate": lr,
                                **trainer.noise_scale(
                                    x_train,
                                    y_train,
                                    *noise_args,
                                    seed=seed,
                                    ema=config["noise_scale_ema"],
                                ),
                            }
                        )

    write_csv(workdir / "runs.csv", rows)
    write_csv(workdir / "noise_scale.csv", noise_rows)
    train_seconds = time.time() - started
    cpu_seconds = time.process_time() - cpu_started
    summary_rows = summarize(rows, config)
    (workdir / "spread.md").write_text(
        markdown_report(summary_rows, noise_rows, config, train_seconds, cpu_seconds, rows)
    )
    plot_spread(summary_rows, config, workdir / "spread_vs_lr.png")
    for lr in config["plot_learning_rates"]:
        plot_curves(rows, config, lr, workdir / f"curves_lr_{lr:g}.png")
    summary = {
        "runs": done,
        "rows": len(rows),
        "seconds": round(time.time() - started, 1),
        "seconds_training": round(train_seconds, 1),
        "cpu_seconds_training": round(cpu_seconds, 1),
    }
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    _log(
        config,
        f"Done in {summary['seconds'] / 60:.1f} min: {workdir}/ "
        "(runs.csv, spread.md, spread_vs_lr.png, curves_lr_*.png, "
        "noise_scale.csv, config.json)",
    )
    return summary


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


# -- analysis -----------------------------------------------------------------


def spreads(rows, kappas):
    """{(method, lr, seed): {metric: (mean over points, at end)}}: max - min
    over `kappas` at matched examples, points with examples > 0."""
    table = {}
    for r in rows:
        if r["examples"] > 0 and r["kappa"] in kappas:
            key = (r["method"], r["learning_rate"], r["seed"])
            table.setdefault(key, {}).setdefault(r["examples"], {})[r["kappa"]] = r
    result = {}
    for key, by_examples in table.items():
        examples = sorted(by_examples)
        for e in examples:
            if set(by_examples[e]) != set(kappas):
                raise ValueError(
                    f"{key} at {e} examples has kappas {sorted(by_examples[e])}, not {kappas}"
                )
        result[key] = {}
        for metric in METRICS:
            per_point = [np.ptp([by_examples[e][k][metric] for k in kappas]) for e in examples]
            result[key][metric] = (float(np.mean(per_point)), float(per_point[-1]))
    return result


def _mean_std(values):
    values = np.asarray(values, dtype=float)
    std = values.std(ddof=1) if len(values) > 1 else float("nan")
    return float(values.mean()), float(std)


def summarize(rows, config):
    """A dict per (method, lr): spread mean and seed std of each metric
    (over the run and at the end), and at the smallest kappa the train loss
    at the start and the end and the final test accuracy (context: how far
    training went)."""
    s = spreads(rows, config["kappas"])
    k1 = min(config["kappas"])
    curves = {}
    for r in rows:
        if r["kappa"] == k1:
            curves.setdefault((r["method"], r["learning_rate"], r["seed"]), {})[r["examples"]] = r
    out = []
    for method in config["methods"]:
        for lr in config["learning_rates"]:
            entry = {"method": method, "learning_rate": lr}
            keys = [(method, lr, seed) for seed in config["seeds"]]
            for metric in METRICS:
                for i, when in enumerate(("mean", "end")):
                    entry[f"{metric}_{when}"] = _mean_std([s[k][metric][i] for k in keys])
            ends = [curves[k][max(curves[k])] for k in keys]
            entry["start_loss"] = float(np.mean([curves[k][0]["train_loss"] for k in keys]))
            entry["end_loss"] = float(np.mean([e["train_loss"] for e in ends]))
            entry["end_accuracy"] = float(np.mean([e["test_accuracy"] for e in ends]))
            out.append(entry)
    return out


def _fmt(mean_std):
    mean, std = mean_std
    return f"{mean:.2e}" if math.isnan(std) else f"{mean:.2e} ± {std:.1e}"


def markdown_report(summary_rows, noise_rows, config, seconds, cpu_seconds, rows):
    """The spread tables and the noise scale, in Markdown."""
    k1 = min(config["kappas"])
    lines = [
        f"Spread across kappa = {config['kappas']} (max - min over kappa at "
        f"matched examples seen), micro-batch {config['micro_batch_size']}, "
        f"model `{config['model']}` on `{config['dataset']}`, "
        f"{config['train_examples']} examples per run, evaluated every "
        f"{config['eval_every']} examples; mean over "
        f"{len(config['seeds'])} seeds ± seed-to-seed std (ddof=1). "
        "'run' = averaged over the evaluation points after the start, "
        f"'end' = at the last one. Train loss on {config['train_eval_examples']}"
        " fixed training examples. Run time "
        f"{seconds / 60:.1f} min wall clock, {cpu_seconds / 60:.1f} min CPU"
        " (all threads).",
        "",
        "| method | base lr | train loss, run | train loss, end | "
        "test loss, run | test loss, end | test acc, run | test acc, end | "
        f"kappa={k1} train loss start → end |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in summary_rows:
        cells = [e["method"], f"{e['learning_rate']:g}"]
        cells += [_fmt(e[f"{m}_{w}"]) for m in METRICS for w in ("mean", "end")]
        cells.append(f"{e['start_loss']:.3f} → {e['end_loss']:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    # Compact view: the figure's numbers, one column per method.
    methods, lrs = config["methods"], config["learning_rates"]
    by = {(e["method"], e["learning_rate"]): e for e in summary_rows}
    pair = {"invariant", "sqrt"} <= set(methods)
    lines += [
        "",
        "Train-loss spread averaged over the run (the y axis of "
        f"spread_vs_lr.png), and the kappa={k1} test accuracy at the "
        "end (which base lr one would pick at kappa = 1):",
        "",
        "| base lr | "
        + " | ".join(methods)
        + " |"
        + (" invariant / sqrt |" if pair else "")
        + f" kappa={k1} test acc |",
        "|---" * (len(methods) + 2 + pair) + "|",
    ]
    for lr in lrs:
        cells = [f"{lr:g}"] + [f"{by[m, lr]['train_loss_mean'][0]:.2e}" for m in methods]
        if pair:
            inv = by["invariant", lr]["train_loss_mean"][0]
            sq = by["sqrt", lr]["train_loss_mean"][0]
            cells.append(f"{inv / sq:.3f}" if sq > 0 else "n/a")
        cells.append(f"{by[methods[0], lr]['end_accuracy']:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    # Where does invariance break: the same spread over kappa <= K.
    kappas = sorted(config["kappas"])
    if len(kappas) > 2:
        subsets = [kappas[:i] for i in range(2, len(kappas) + 1)]
        by_subset = [spreads(rows, sub) for sub in subsets]
        lines += [
            "",
            "Train-loss spread (mean over the run and the seeds) "
            "over the kappas up to K only, per method:",
            "",
            "| base lr | method | " + " | ".join(f"K={sub[-1]}" for sub in subsets) + " |",
            "|---|---" + "|---" * len(subsets) + "|",
        ]
        for lr in lrs:
            for m in methods:
                cells = [f"{lr:g}", m] + [
                    f"{np.mean([sp[m, lr, seed]['train_loss'][0] for seed in config['seeds']]):.2e}"
                    for sp in by_subset
                ]
                lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Gradient noise scale B_simple (`GradientNoiseScale`, "
        f"{config['noise_scale_windows']} probe windows of "
        f"{config['noise_scale_kappa']} x {config['micro_batch_size']}"
        f" training examples, EMA {config['noise_scale_ema']}), mean ± "
        "std over seeds; windows here are kappa x "
        f"{config['micro_batch_size']} = "
        f"{', '.join(str(k * config['micro_batch_size']) for k in config['kappas'])}"
        " examples:",
        "",
        "| model | B_simple | tr(Sigma) | abs(G)^2 |",
        "|---|---|---|---|",
    ]
    groups = {}
    for r in noise_rows:
        label = r["model"] + (f", lr {r['learning_rate']:g}" if r["learning_rate"] != "" else "")
        groups.setdefault(label, []).append(r)
    for label, rs in groups.items():
        cells = [label] + [
            _fmt(_mean_std([r[k] for r in rs])).replace("e+", "e")
            for k in ("noise_scale", "trace_sigma", "grad_sq_norm")
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# -- plots --------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_spread(summary_rows, config, png):
    """Spread (mean over the run) versus base lr, a line per method."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(METRICS), figsize=(15, 4.2))
    for ax, metric in zip(axes, METRICS):
        for method in config["methods"]:
            es = [e for e in summary_rows if e["method"] == method]
            mean = np.array([e[f"{metric}_mean"][0] for e in es])
            std = np.nan_to_num([e[f"{metric}_mean"][1] for e in es])
            lrs = [e["learning_rate"] for e in es]
            ax.errorbar(lrs, mean, yerr=std, marker="o", capsize=3, label=method)
        ax.set_xscale("log")
        ax.set_xticks(config["learning_rates"], [f"{lr:g}" for lr in config["learning_rates"]])
        ax.xaxis.set_minor_formatter("")
        if all(e[f"{metric}_mean"][0] > 0 for e in summary_rows):
            ax.set_yscale("log")
        ax.set_xlabel("base learning rate (kappa = 1)")
        ax.set_ylabel(f"spread of {metric.replace('_', ' ')} across kappa")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"max - min over kappa = {config['kappas']}, mean over the "
        f"run and over {len(config['seeds'])} seeds (bars: seed std)"
    )
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def plot_curves(rows, config, lr, png):
    """Train loss and test accuracy versus examples seen at base lr `lr`:
    a column per method, a line per kappa (mean over seeds)."""
    plt = _pyplot()
    methods = config["methods"]
    fig, axes = plt.subplots(
        2, len(methods), figsize=(4 * len(methods), 7), sharey="row", squeeze=False
    )
    for col, method in enumerate(methods):
        for kappa in config["kappas"]:
            curve = {}
            for r in rows:
                if (r["method"], r["learning_rate"], r["kappa"]) == (method, lr, kappa):
                    curve.setdefault(r["examples"], []).append(r)
            examples = sorted(curve)
            for row, metric in enumerate(("train_loss", "test_accuracy")):
                axes[row, col].plot(
                    examples,
                    [np.mean([r[metric] for r in curve[e]]) for e in examples],
                    label=f"kappa={kappa}",
                )
        axes[0, col].set_title(method)
        for row in range(2):
            axes[row, col].set_xlabel("examples seen")
            axes[row, col].grid(True, alpha=0.3)
        axes[0, col].legend()
    axes[0, 0].set_ylabel("train loss")
    axes[1, 0].set_ylabel("test accuracy")
    fig.suptitle(
        f"base lr {lr:g} (tuned at kappa = 1), micro-batch "
        f"{config['micro_batch_size']}, mean over "
        f"{len(config['seeds'])} seeds"
    )
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
