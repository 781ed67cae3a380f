"""Config-driven training runs: `train_and_evaluate(config, workdir)`.

A config is a plain dict (saved_configs/*.py return one from `get_config()`);
keys missing from it take the values in `DEFAULTS`, unknown keys are an
error. A run folder holds everything needed to read or repeat the run:

    config.json      the resolved config (re-run: --config <folder>/config.json)
    metrics.csv      one row per epoch: loss, accuracy, val_*, learning rate,
                     updates, skipped micro-batches, noise scale
    tensorboard/     TensorBoard events
    checkpoints/     epoch_NNN.keras: model + optimizer state, for --resume
    final.json       test loss and accuracy of the final model
    curves.png       training and test curves

Batches: the training stream is `micro_batch_size * replicas` items per
call, `steps` calls per update, so kappa = steps * replicas micro-batches
make one update. An epoch is a whole number of windows
(floor(train examples / window examples) windows); the example stream
reshuffles every pass with a fixed seed and runs on across epoch ends, so no window
is ever partial, no example is systematically dropped, and a resumed run
sees exactly the batches the uninterrupted run would have seen.
"""

import json
import pathlib
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import keras_accum as ka
from keras_accum import diagnostics, training
from keras_accum.experiments import data, models
from keras_accum.training import checkpoints, fit

OPTIMIZERS = ("invariant_adam", "update_accumulation_adam", "gradient_accumulation")
INNER_OPTIMIZERS = ("adam", "adamw", "sgd")
STRATEGIES = ("default", "mirrored", "multi_worker")

DEFAULTS = {
    "dataset": "mnist1d",
    "data_dir": None,
    "model": "cnn",
    "model_kwargs": {},
    "optimizer": "invariant_adam",
    "inner_optimizer": "adam",  # for optimizer="gradient_accumulation"
    # Hyperparameters at kappa = 1; `scaling_rule` rescales them to kappa.
    "learning_rate": 1e-3,
    "beta_1": 0.9,
    "beta_2": 0.999,
    "epsilon": 1e-7,
    "weight_decay": None,
    "scaling_rule": None,  # None | "invariant" | "sqrt" | "power"
    # "constant" | "cosine" (decays to 0 over all updates; a schedule sees
    # the update count, not micro-steps)
    "lr_schedule": "constant",
    "micro_batch_size": 32,
    "steps": 4,
    "epochs": 10,
    "seed": 0,
    "strategy": "default",
    "mixed_precision": False,
    "jit_compile": False,
    "noise_scale_every": 0,  # batches between noise-scale probes; 0 = off
    "verbose": 1,
}


def resolve_config(config):
    """DEFAULTS updated with `config`; refuses unknown keys and bad values."""
    unknown = sorted(set(config) - set(DEFAULTS))
    if unknown:
        raise ValueError(
            f"Unknown config key(s) {unknown}. Valid keys: {', '.join(sorted(DEFAULTS))}"
        )
    resolved = {**DEFAULTS, **config}
    choices = {
        "optimizer": OPTIMIZERS,
        "inner_optimizer": INNER_OPTIMIZERS,
        "strategy": STRATEGIES,
        "scaling_rule": (None,) + ka.scaling.RULES,
        "lr_schedule": ("constant", "cosine"),
        "model": tuple(models.MODELS),
    }
    for key, valid in choices.items():
        if resolved[key] not in valid:
            raise ValueError(
                f"`{key}` must be one of {list(valid)}. Received: {key}={resolved[key]!r}"
            )
    for key in ("micro_batch_size", "steps", "epochs"):
        value = resolved[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{key}` must be an integer >= 1. Received: {key}={value!r}")
    return resolved


def make_strategy(name):
    if name == "mirrored":
        return tf.distribute.MirroredStrategy()
    if name == "multi_worker":
        # MultiWorkerMirroredStrategy from TF_CONFIG (a single process when
        # it names one task). model.fit is broken under it in Keras 3.15
        # (keras-team/keras#20585): these runs use keras_accum.training.
        return training.strategy_from_environment()
    return tf.distribute.get_strategy()


def make_optimizer(config, kappa, total_updates):
    """The configured optimizer, hyperparameters scaled to `kappa`."""
    hyper = {k: config[k] for k in ("learning_rate", "beta_1", "beta_2", "epsilon")}
    if config["scaling_rule"]:
        hyper = ka.scale_hyperparameters(kappa, config["scaling_rule"], **hyper)
    if config["lr_schedule"] == "cosine":
        hyper["learning_rate"] = keras.optimizers.schedules.CosineDecay(
            hyper["learning_rate"], decay_steps=total_updates
        )
    steps, wd = config["steps"], config["weight_decay"]
    if config["optimizer"] == "invariant_adam":
        return ka.InvariantAdam(**hyper, steps=steps, weight_decay=wd)
    if config["optimizer"] == "update_accumulation_adam":
        return ka.UpdateAccumulationAdam(**hyper, steps=steps, weight_decay=wd)
    if config["inner_optimizer"] == "sgd":
        inner = keras.optimizers.SGD(
            hyper["learning_rate"], momentum=hyper["beta_1"], weight_decay=wd
        )
    else:
        inner_cls = (
            keras.optimizers.AdamW
            if config["inner_optimizer"] == "adamw"
            else keras.optimizers.Adam
        )
        kwargs = {} if wd is None else {"weight_decay": wd}
        inner = inner_cls(**hyper, **kwargs)
    return ka.GradientAccumulation(inner, steps=steps)


def training_stream(config, global_micro_batch, start_batch):
    """Global micro-batches of an endless, seeded reshuffling stream.

    A fresh stream with the same seed replays the same order, so skipping
    `start_batch` batches resumes exactly where a run stopped.
    """
    examples = data.load(config["dataset"], "train", data_dir=config["data_dir"])
    stream = examples.shuffle(
        examples.cardinality(), seed=config["seed"], reshuffle_each_iteration=True
    ).repeat()
    stream = stream.batch(global_micro_batch, drop_remainder=True)
    return stream.skip(start_batch).prefetch(tf.data.AUTOTUNE)


class AccumulationLogger(keras.callbacks.Callback):
    """Adds learning rate, update count and skipped micro-batches to logs."""

    def on_epoch_end(self, epoch, logs=None):
        optimizer = self.model.optimizer
        while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            optimizer = optimizer.inner_optimizer
        logs["learning_rate"] = float(np.asarray(optimizer.learning_rate))
        logs["updates"] = int(np.asarray(optimizer.iterations))
        logs["skipped_micro_batches"] = int(np.asarray(optimizer.skipped_micro_batches))


def latest_checkpoint(workdir):
    """(path, epochs done) of the newest intact epoch checkpoint of the run
    folder, or (None, 0); see `keras_accum.training.fit.find_resume`."""
    point = fit.find_resume(pathlib.Path(workdir, "checkpoints"))
    return (pathlib.Path(point.path), point.epoch) if point else (None, 0)


def train_and_evaluate(config, workdir, resume=False):
    """Trains and evaluates `config`; writes the run folder `workdir`.

    With `resume`, continues from the folder's latest checkpoint using the
    folder's own config.json (then `config` must be None or equal to it).
    Returns the final evaluation dict.
    """
    workdir = pathlib.Path(workdir)
    config_path = workdir / "config.json"
    if resume:
        if not config_path.exists():
            raise FileNotFoundError(f"--resume: no run folder at {workdir} (config.json missing).")
        saved = json.loads(config_path.read_text())
        if config is not None and resolve_config(config) != saved:
            raise ValueError(
                "--resume continues the folder's own config; drop the other config or overrides."
            )
        config = saved
    else:
        config = resolve_config(config)
    keras.utils.set_random_seed(config["seed"])
    if config["mixed_precision"]:
        keras.mixed_precision.set_global_policy("mixed_float16")
    strategy = make_strategy(config["strategy"])
    # Multi-worker: every worker runs this; only the chief owns the folder.
    if not resume and training.is_chief(strategy):
        if workdir.exists() and any(workdir.iterdir()):
            raise FileExistsError(
                f"workdir={str(workdir)!r} is not empty; pass --resume to "
                "continue that run or choose a new folder."
            )
        workdir.mkdir(parents=True, exist_ok=True)
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
    replicas = strategy.num_replicas_in_sync
    kappa = config["steps"] * replicas
    info = data.dataset_info(config["dataset"], config["data_dir"])
    global_micro_batch = config["micro_batch_size"] * replicas
    window_examples = global_micro_batch * config["steps"]
    windows_per_epoch = info.num_train_examples // window_examples
    if windows_per_epoch < 1:
        raise ValueError(
            f"One window (micro_batch_size x steps x replicas = "
            f"{window_examples}) is larger than the training set "
            f"({info.num_train_examples} examples)."
        )
    steps_per_epoch = windows_per_epoch * config["steps"]

    point = fit.find_resume(workdir / "checkpoints") if resume else None
    initial_epoch = point.epoch if point else 0
    with strategy.scope():
        if point is not None:
            if training.is_chief(strategy):
                print(f"Resuming from {point.path} ({point.epoch} epochs done)", flush=True)
            model = fit.load_resume(point)
        else:
            model_kwargs = dict(config["model_kwargs"])
            if info.vocab_size is not None:
                model_kwargs.setdefault("vocab_size", info.vocab_size)
            model = models.build_model(
                config["model"], info.input_shape, info.num_classes, **model_kwargs
            )
            model.compile(
                optimizer=make_optimizer(config, kappa, config["epochs"] * windows_per_epoch),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
                jit_compile=config["jit_compile"],
            )

    if config["strategy"] == "multi_worker":
        return _train_custom_loop(config, workdir, strategy, model, info, window_examples, kappa)
    train = training_stream(config, global_micro_batch, initial_epoch * steps_per_epoch)
    test = data.load(config["dataset"], "test", data_dir=config["data_dir"], batch_size=1000)
    callbacks = [AccumulationLogger()]
    if config["noise_scale_every"]:
        probe = data.load(
            config["dataset"],
            "train",
            data_dir=config["data_dir"],
            batch_size=config["micro_batch_size"] * kappa,
            shuffle_seed=config["seed"],
            drop_remainder=True,
        ).repeat()
        callbacks.append(
            diagnostics.NoiseScaleCallback(
                probe,
                micro_batch_size=config["micro_batch_size"],
                kappa=kappa,
                every_n_batches=config["noise_scale_every"],
            )
        )
    callbacks += [
        keras.callbacks.CSVLogger(str(workdir / "metrics.csv"), append=True),
        fit.FlushingTensorBoard(str(workdir / "tensorboard")),
    ]
    callbacks += _resumable(callbacks, workdir, point, resume)
    (workdir / "checkpoints").mkdir(exist_ok=True)
    verbose = config["verbose"]
    if verbose == 1 and not sys.stdout.isatty():
        verbose = 2  # one line per epoch in logs instead of redrawn bars
    start = time.time()
    if initial_epoch < config["epochs"]:
        model.fit(
            train,
            epochs=config["epochs"],
            initial_epoch=initial_epoch,
            steps_per_epoch=steps_per_epoch,
            validation_data=test,
            shuffle=False,  # the stream is shuffled, seeded
            callbacks=callbacks,
            verbose=verbose,
        )
    test_loss, test_accuracy = model.evaluate(test, verbose=0)
    final = {
        "test_loss": float(test_loss),
        "test_accuracy": float(test_accuracy),
        "epochs": config["epochs"],
        "kappa": kappa,
        "updates": int(np.asarray(model.optimizer.iterations)),
        "train_seconds_this_session": round(time.time() - start, 1),
    }
    (workdir / "final.json").write_text(json.dumps(final, indent=2))
    plot_curves(workdir / "metrics.csv", workdir / "curves.png")
    return final


def _resumable(callbacks, workdir, point, resume):
    """Checkpointing for the fit path: on resume, the stateful callbacks get
    their saved state and the logs rewind to the checkpoint; returns the
    checkpoint callback to run after the loggers."""
    stateful = [c for c in callbacks if hasattr(c, "get_state")]
    if resume:
        if point is not None:
            fit.restore_state(point, stateful)
        tensorboard = [workdir / "tensorboard" / name for name in ("train", "validation")]
        fit.rewind_logs(workdir / "metrics.csv", tensorboard, point.epoch if point else 0)
    return [
        fit.EpochCheckpoint(
            workdir / "checkpoints", stateful=stateful, sync=[workdir / "metrics.csv"]
        )
    ]


def _train_custom_loop(config, workdir, strategy, model, info, window_examples, kappa):
    """The multi-worker path: keras_accum.training's compiled window step.

    Each global batch of the seeded stream is one whole window; the loop
    keeps its checkpoints, per-window log and summaries in workdir/loop and
    resumes from them by itself. Only the chief writes the run folder.
    """
    train = data.load(
        config["dataset"],
        "train",
        data_dir=config["data_dir"],
        shuffle_seed=config["seed"],
        batch_size=window_examples,
        drop_remainder=True,
    )
    test = data.load(config["dataset"], "test", data_dir=config["data_dir"], batch_size=1000)
    start = time.time()
    resume_hint = f"python scripts/train.py --workdir {workdir} --resume"
    with training.distribute.peer_errors(resume_hint):
        history, evaluation = _loop_and_evaluate(config, workdir, strategy, model, train, test)
    final = {
        "test_loss": float(evaluation["loss"]),
        "test_accuracy": float(evaluation["accuracy"]),
        "epochs": config["epochs"],
        "kappa": kappa,
        "updates": int(np.asarray(model.optimizer.iterations)),
        "train_seconds_this_session": round(time.time() - start, 1),
    }
    if training.is_chief(strategy):
        _write_metrics(workdir / "metrics.csv", history)
        (workdir / "final.json").write_text(json.dumps(final, indent=2))
        plot_curves(workdir / "metrics.csv", workdir / "curves.png")
    return final


def _loop_and_evaluate(config, workdir, strategy, model, train, test):
    """`training.train` on the seeded stream, then the test evaluation."""
    history = training.train(
        model,
        model.optimizer,
        model.loss,
        train,
        epochs=config["epochs"],
        strategy=strategy,
        workdir=str(workdir / "loop"),
        metrics=["accuracy"],
        eval_dataset=test,
        resume_hint=f"python scripts/train.py --workdir {workdir} --resume",
        verbose=1 if config["verbose"] else 0,
    )
    evaluation = training.Trainer(
        model, model.optimizer, model.loss, strategy=strategy, metrics=["accuracy"]
    ).evaluate(test)
    return history, evaluation


def _write_metrics(metrics_csv, history):
    """Per-epoch means from `training.train` (all epochs, also across a
    resume) as CSV rows, epoch from 0; written atomically."""
    import csv
    import io

    keys = sorted(history)
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(["epoch"] + keys)
    for e in range(len(history.get("loss", []))):
        writer.writerow([e] + [history[k][e] for k in keys])
    checkpoints.atomic_write_text(str(metrics_csv), text.getvalue())


def plot_curves(metrics_csv, png):
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(metrics_csv) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return
    epochs = [int(r["epoch"]) + 1 for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, ("loss", "accuracy")):
        for prefix, label in (("", "train"), ("val_", "test")):
            if prefix + metric in rows[0]:
                ax.plot(epochs, [float(r[prefix + metric]) for r in rows], label=label)
        ax.set_xlabel("epoch")
        ax.set_title(metric)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def load_config_file(path, *args):
    """A config from a saved_configs/*.py file (its `get_config(*args)`) or
    from a run folder's config.json (then `args` are ignored)."""
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"--config: no such file {str(path)!r}")
    if path.suffix == ".json":
        return json.loads(path.read_text())
    namespace = {"__file__": str(path)}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    if "get_config" not in namespace:
        raise ValueError(f"{path} defines no get_config().")
    return namespace["get_config"](*args)
