"""Config-driven training runs: `train_and_evaluate(config, workdir)`.

A config is a plain dict (saved_configs/*.py return one from `get_config()`);
keys missing from it take the values in `DEFAULTS`; every key and value is
checked by the run's schema (run_config.py) before anything is written, and
a bad one is a one-line `ConfigError`. A run folder holds everything needed
to read or repeat the run:

    config.json      the resolved config (re-run: --config <folder>/config.json)
    metrics.csv      one row per epoch: loss, accuracy, val_* (the held-out
                     start of train, with validation_split > 0) or test_*
                     (the test split, without), learning rate, updates,
                     skipped micro-batches, noise scale
    tensorboard/     TensorBoard events
    checkpoints/     epoch_NNN.keras: model + optimizer state, for --resume;
                     config.json: the config they were made with
    final.json       test (and validation) loss and accuracy of the final model
    curves.png       training, validation and test curves

Every whole file is written atomically (`keras_accum.training.atomic`), the
checkpoints' config first. A run killed before its first checkpoint leaves
nothing to protect: the plain command clears and restarts its folder, and
--resume starts it from the beginning (`run_folder`).

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
from keras_accum import diagnostics, nonfinite, remat, training
from keras_accum.experiments import child, data, models, optimizers, run_config, run_folder
from keras_accum.experiments import fit_resume as fit
from keras_accum.experiments.callbacks import AccumulationLogger, CSVLogger, SplitLabels
from keras_accum.experiments.run_config import (  # noqa: F401 (the run's config API)
    DEFAULTS,
    SCHEMA,
    load_config_file,
    resolve_config,
    validation_examples,
)
from keras_accum.training import atomic


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
    # A steps schedule: InvariantAdam rescales per window itself, and its lr
    # schedule counts micro-batches over all replicas (kappa per update).
    scheduled = config["steps_boundaries"] is not None
    weight_decay = config["weight_decay"]
    if config["scaling_rule"] and not scheduled:
        # The weight decay per example stays that of kappa = 1 (x sqrt(kappa)
        # under "sqrt", unchanged where lr scales with kappa).
        hyper = ka.scale_hyperparameters(
            kappa, config["scaling_rule"], **hyper, weight_decay=weight_decay
        )
        weight_decay = hyper.pop("weight_decay", None)
    if config["lr_schedule"] == "cosine":
        hyper["learning_rate"] = keras.optimizers.schedules.CosineDecay(
            hyper["learning_rate"], decay_steps=total_updates * (kappa if scheduled else 1)
        )
    steps, rule = config["steps"], None
    if scheduled:
        steps = ka.PiecewiseSteps(config["steps_boundaries"], config["steps_values"])
        rule = config["scaling_rule"]  # invariant_adam only (run_config checks)
    return optimizers.build(
        config["optimizer"],
        steps,
        hyper,
        inner=config["inner_optimizer"],
        weight_decay=weight_decay,
        scaling_rule=rule,
    )


def training_stream(config, global_micro_batch, start_batch, held_out=0):
    """Global micro-batches of an endless, seeded reshuffling stream.

    Every iterator replays the same order from the seed, so skipping
    `start_batch` batches resumes exactly where a run stopped. The shuffle is
    built inside `flat_map` so that each iterator gets its own reshuffle
    state: a shuffle's seed generator is otherwise shared by all iterators of
    the dataset, and `model.fit` under a distribution strategy opens one
    iterator to peek at a batch before training; the training iterator then
    began one reshuffle later, by how many passes the peek skipped.
    """
    examples = data.load(
        config["dataset"], "train", data_dir=config["data_dir"], validation_examples=held_out
    )

    def passes(_):
        return examples.shuffle(
            examples.cardinality(), seed=config["seed"], reshuffle_each_iteration=True
        ).repeat()

    stream = tf.data.Dataset.range(1).flat_map(passes)
    stream = stream.batch(global_micro_batch, drop_remainder=True)
    return stream.skip(start_batch).prefetch(tf.data.AUTOTUNE)


def latest_checkpoint(workdir):
    """(path, epochs done) of the newest intact epoch checkpoint of the run
    folder, or (None, 0); see `keras_accum.experiments.fit_resume.find_resume`."""
    point = fit.find_resume(pathlib.Path(workdir, "checkpoints"))
    return (pathlib.Path(point.path), point.epoch) if point else (None, 0)


def train_and_evaluate(config, workdir, resume=False):
    """Trains and evaluates `config`; writes the run folder `workdir`.

    With `resume`, continues from the folder's latest checkpoint using the
    folder's own config.json (then `config` must be None or equal to it).
    Returns the final evaluation dict.
    """
    workdir = pathlib.Path(workdir)
    config, strategy, info, held_out, windows_per_epoch = _checked_run(config, workdir, resume)
    replicas = strategy.num_replicas_in_sync
    kappa = config["steps"] * replicas
    keras.utils.set_random_seed(config["seed"])
    keras.mixed_precision.set_global_policy(
        "mixed_float16" if config["mixed_precision"] else "float32"
    )
    global_micro_batch = config["micro_batch_size"] * replicas
    window_examples = global_micro_batch * config["steps"]
    steps_per_epoch = windows_per_epoch * config["steps"]

    point = fit.find_resume(workdir / "checkpoints") if resume else None
    initial_epoch = point.epoch if point else 0
    with strategy.scope():
        if point is not None:
            if training.is_chief(strategy):
                print(f"Resuming from {point.path} ({point.epoch} epochs done)", flush=True)
            model = fit.load_resume(point)
            if config["remat"] != "none":
                # Also a checkpoint saved before `Rematerialized` existed.
                model = remat.rematerialize(model, config["remat"])
        else:
            model = _build_model(config, info, kappa, config["epochs"] * windows_per_epoch)
    if config["strategy"] == "multi_worker":
        return _train_custom_loop(
            config, workdir, strategy, model, window_examples, kappa, held_out
        )
    train = training_stream(config, global_micro_batch, initial_epoch * steps_per_epoch, held_out)
    test = data.load(config["dataset"], "test", data_dir=config["data_dir"], batch_size=1000)
    watched = _validation_split(config, held_out) if held_out else test
    callbacks = [
        AccumulationLogger(),
        SplitLabels("validation" if held_out else "test"),
        *_noise_scale_callbacks(config, kappa, held_out),
        CSVLogger(str(workdir / "metrics.csv"), append=True),
        fit.FlushingTensorBoard(str(workdir / "tensorboard")),
    ]
    callbacks += _resumable(callbacks, workdir, point, resume)
    (workdir / "checkpoints").mkdir(exist_ok=True)
    verbose = config["verbose"]
    if verbose == 1 and not sys.stdout.isatty():
        verbose = 2  # one line per epoch in logs instead of redrawn bars
    start = time.time()
    child.reset_peak()
    if initial_epoch < config["epochs"]:
        with nonfinite.explained():  # nonfinite="raise": one line
            model.fit(
                train,
                epochs=config["epochs"],
                initial_epoch=initial_epoch,
                steps_per_epoch=steps_per_epoch,
                validation_data=watched,
                shuffle=False,  # the stream is shuffled, seeded
                callbacks=callbacks,
                verbose=verbose,
            )
    test_loss, test_accuracy = model.evaluate(test, verbose=0)
    final = {
        "test_loss": float(test_loss),
        "test_accuracy": float(test_accuracy),
        **_validation_results(model, watched if held_out else None),
        "epochs": config["epochs"],
        "kappa": kappa,
        "updates": int(np.asarray(model.optimizer.iterations)),
        "train_seconds_this_session": round(time.time() - start, 1),
        "peak_tensor_memory_mb": _peak_memory(verbose),
    }
    atomic.atomic_write_text(str(workdir / "final.json"), json.dumps(final, indent=2))
    plot_run_curves(workdir / "metrics.csv", workdir / "curves.png")
    return final


def _peak_memory(verbose):
    """The allocator's peak over this session's training and evaluation, in
    MB: weights, optimizer state, data buffers and the step's activations
    (None unless it reports one: a GPU, or TF_CPU_ALLOCATOR_USE_BFC=true,
    which scripts/train.py sets); printed when `verbose`."""
    peak = child.peak_mb()
    if verbose and peak is not None:
        print(f"Peak tensor memory: {peak:.1f} MB", flush=True)
    return peak


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


def _checked_run(config, workdir, resume):
    """Checks the whole run, then (chief) writes the config files.

    Returns (config, strategy, DatasetInfo, held-out examples, windows per
    epoch). Every check comes before the first write, so a refused run
    leaves the folder usable by the corrected command. A folder killed
    before its first checkpoint is started again (`run_folder`).
    """
    if resume:
        config = run_config.resume_config(config, workdir)
        fresh = not run_folder.has_checkpoint(workdir)
    else:
        config = resolve_config(config)
        run_folder.check_new(workdir)
        fresh = True
    strategy = make_strategy(config["strategy"])
    replicas = strategy.num_replicas_in_sync
    run_config.check_scaling(config, replicas)
    info, held_out, windows_per_epoch = run_config.check_data(config, replicas)
    # Multi-worker: every worker runs this; only the chief owns the folder.
    if fresh and training.is_chief(strategy):
        if workdir.exists():
            # Logs of a run killed before its first checkpoint (and, for a
            # new run, its config files): nothing of value.
            run_folder.clear(workdir, configs=not resume)
        run_folder.write_configs(workdir, json.dumps(config, indent=2, sort_keys=True))
    return config, strategy, info, held_out, windows_per_epoch


def _build_model(config, info, kappa, total_updates):
    """The configured model, compiled with the configured optimizer."""
    model_kwargs = dict(config["model_kwargs"])
    if info.vocab_size is not None:
        model_kwargs.setdefault("vocab_size", info.vocab_size)
    model = models.build_model(config["model"], info.input_shape, info.num_classes, **model_kwargs)
    if config["remat"] != "none":
        model = remat.rematerialize(model, config["remat"])
    model.compile(
        optimizer=make_optimizer(config, kappa, total_updates),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=config["jit_compile"],
    )
    return model


def _validation_split(config, held_out):
    return data.load(
        config["dataset"],
        "validation",
        data_dir=config["data_dir"],
        # At most one batch per pass: a partial batch under MirroredStrategy
        # is split by the full size, leaving a replica an empty part.
        batch_size=min(1000, held_out),
        validation_examples=held_out,
    )


def _noise_scale_callbacks(config, kappa, held_out):
    """[NoiseScaleCallback] on its own seeded train stream, or []."""
    if not config["noise_scale_every"]:
        return []
    probe = data.load(
        config["dataset"],
        "train",
        data_dir=config["data_dir"],
        batch_size=config["micro_batch_size"] * kappa,
        shuffle_seed=config["seed"],
        drop_remainder=True,
        validation_examples=held_out,
    ).repeat()
    return [
        diagnostics.NoiseScaleCallback(
            probe,
            micro_batch_size=config["micro_batch_size"],
            kappa=kappa,
            every_n_batches=config["noise_scale_every"],
        )
    ]


def _validation_results(model, validation):
    """Final loss and accuracy on the held-out part of train ({} if none)."""
    if validation is None:
        return {}
    loss, accuracy = model.evaluate(validation, verbose=0)
    return {"validation_loss": float(loss), "validation_accuracy": float(accuracy)}


def _train_custom_loop(config, workdir, strategy, model, window_examples, kappa, held_out):
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
        validation_examples=held_out,
    )
    test = data.load(config["dataset"], "test", data_dir=config["data_dir"], batch_size=1000)
    start = time.time()
    child.reset_peak()
    resume_hint = f"python scripts/train.py --workdir {workdir} --resume"
    with training.distribute.peer_errors(resume_hint):
        history, evaluation = _loop_and_evaluate(
            config, workdir, strategy, model, train, test, held_out
        )
    final = {
        "test_loss": float(evaluation["loss"]),
        "test_accuracy": float(evaluation["accuracy"]),
        "epochs": config["epochs"],
        "kappa": kappa,
        "updates": int(np.asarray(model.optimizer.iterations)),
        "train_seconds_this_session": round(time.time() - start, 1),
        "peak_tensor_memory_mb": _peak_memory(config["verbose"] and training.is_chief(strategy)),
    }
    if training.is_chief(strategy):
        _write_metrics(workdir / "metrics.csv", history)
        atomic.atomic_write_text(str(workdir / "final.json"), json.dumps(final, indent=2))
        plot_run_curves(workdir / "metrics.csv", workdir / "curves.png")
    return final


def _loop_and_evaluate(config, workdir, strategy, model, train, test, held_out):
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
        eval_dataset=_validation_split(config, held_out) if held_out else test,
        resume_hint=f"python scripts/train.py --workdir {workdir} --resume",
        verbose=1 if config["verbose"] else 0,
        remat=config["remat"],
    )
    if not held_out:  # The loop says val_*; it was the test split.
        history = {("test_" + k[4:] if k.startswith("val_") else k): v for k, v in history.items()}
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
    atomic.atomic_write_text(str(metrics_csv), text.getvalue())


def plot_run_curves(metrics_csv, png):
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
        for prefix, label in (("", "train"), ("val_", "validation"), ("test_", "test")):
            if prefix + metric in rows[0]:
                ax.plot(epochs, [float(r[prefix + metric]) for r in rows], label=label)
        ax.set_xlabel("epoch")
        ax.set_title(metric)
        ax.legend()
    fig.tight_layout()
    with atomic.replacing(png, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
