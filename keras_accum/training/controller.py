"""The controller: epochs, checkpoints, logs, evaluation and resume around a
`Trainer` (`Controller`, and `train` over it). See docs/guides/custom_loop.md.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from keras_accum import _compat, nonfinite
from keras_accum.training import atomic, checks
from keras_accum.training import logs as run_logs
from keras_accum.training.distribute import is_chief, peer_errors
from keras_accum.training.trainer import Trainer

# Fields of a window's logs that are not TensorBoard scalars.
NOT_SCALARS = ("time", "epoch", "batches", "batch_in_epoch")


class _Log:
    """log.jsonl and TensorBoard scalars (chief), rewound to (`batches`, `epoch`)."""

    def __init__(self, workdir, chief, batches, epoch):
        self.path, self.writer, self.kept = None, tf.summary.create_noop_writer(), []
        if not (workdir and chief):
            return
        self.path = os.path.join(workdir, "log.jsonl")
        self.kept = run_logs.rewind_jsonl(
            self.path, lambda r: r.get("batches", 0) <= batches and r.get("epoch", 0) <= epoch
        )
        # Epoch-end scalars at step `batches` are kept only with their record.
        ended = any(r.get("epoch_end") and r.get("batches") == batches for r in self.kept)

        def keep(tag, step, _):
            return step < batches or (step == batches and (ended or not tag.startswith("epoch/")))

        tensorboard = os.path.join(workdir, "tensorboard")
        if os.path.isdir(tensorboard):
            run_logs.rewind_events(tensorboard, keep)
        self.writer = tf.summary.create_file_writer(tensorboard)

    def write(self, record, step, prefix=""):
        if self.path is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        with self.writer.as_default(step=step):
            for name, value in record.items():
                if isinstance(value, float) and name not in NOT_SCALARS:
                    tf.summary.scalar(prefix + name, value)
        self.writer.flush()


class Controller:
    """Epochs, checkpoints, logs, evaluation and resume around a `Trainer`.

    `resume()` restores the newest intact checkpoint of `workdir`;
    `run(dataset, epochs, global_batch)` trains and returns the history.

    Args:
        trainer: the `Trainer` of the model, optimizer and loss.
        workdir, checkpoint_every, eval_dataset, callbacks, verbose: as in
            `train`.
    """

    def __init__(
        self,
        trainer,
        *,
        workdir=None,
        checkpoint_every=100,
        eval_dataset=None,
        callbacks=(),
        verbose=1,
    ):
        self.trainer, self.workdir = trainer, workdir
        self.checkpoint_every, self.eval_dataset = checkpoint_every, eval_dataset
        self.callbacks, self.chief = list(callbacks), is_chief(trainer.strategy)
        self.verbose = verbose and self.chief
        self.directory = workdir and os.path.join(workdir, "checkpoints")
        self.shown = ["loss"] + trainer.metric_names
        with trainer.strategy.scope():
            # Running sums of the current epoch: [windows, loss, metrics...].
            self.epoch_sums = tf.Variable(
                tf.zeros([1 + len(self.shown)], tf.float64),
                trainable=False,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                name="epoch_sums",
            )
        trainer.track("epoch_sums", self.epoch_sums)
        self.history, self.bar, self.warned, self.log = {}, None, False, None
        self.saved = 0

    def resume(self):
        """Restores the newest intact checkpoint, rewinds the logs; returns its path or None."""
        trainer = self.trainer
        path = self.directory and trainer.restore(self.directory)
        if path and self.verbose:
            print(f"Resuming from {path} ({int(trainer.batches.numpy())} batches done)")
        optimizer, steps = trainer.optimizer, trainer.steps
        if steps > 1 and int(optimizer.micro_step.numpy()) % steps:
            raise ValueError(
                "`optimizer` is in the middle of a window (micro_step="
                f"{int(optimizer.micro_step.numpy())}, steps={steps}); finish "
                "it with `Trainer.micro_batch_step` before training whole windows."
            )
        self.saved = int(trainer.batches.numpy())
        self.log = _Log(self.workdir, self.chief, self.saved, int(trainer.epoch.numpy()))
        for record in self.log.kept:
            if record.get("epoch_end"):
                self._remember(record)
        return path

    def run(self, dataset, epochs, global_batch):
        """Trains to the end of epoch `epochs`; returns the history."""
        self.global_batch, self.target = global_batch, int(dataset.cardinality())
        trainer = self.trainer
        iterator = iter(trainer.distribute(dataset, epochs=epochs, global_batch_size=global_batch))
        while True:
            start = time.perf_counter()
            try:
                with nonfinite.explained():  # nonfinite="raise": one line
                    logs = trainer.train_step(iterator)
            except tf.errors.OutOfRangeError:
                break
            logs = {k: float(v) for k, v in logs.items()}
            logs["examples_per_second"] = logs["items"] / (time.perf_counter() - start)
            if logs["items"] == 0:  # the end-of-epoch marker
                self._end_of_epoch(logs)
            else:
                self._after_window(logs)
        return self.history

    def _save(self):
        if self.directory:
            self.saved = int(self.trainer.batches.numpy())
            self.trainer.save(self.directory)

    def _remember(self, record):
        for k, v in record.items():
            if k in self.shown or k.startswith("val_"):
                self.history.setdefault(k, []).append(v)

    def _end_of_epoch(self, logs):
        sums = self.epoch_sums.numpy()
        record = {k: float(sums[1 + i] / sums[0]) for i, k in enumerate(self.shown) if sums[0]}
        if self.eval_dataset is not None:
            evaluation = self.trainer.evaluate(self.eval_dataset)
            record.update({f"val_{k}": v for k, v in evaluation.items()})
        self._remember(record)
        self.log.write(
            {"epoch": logs["epoch"], "batches": logs["batches"], "epoch_end": True, **record},
            step=int(logs["batches"]),
            prefix="epoch/",
        )
        self.epoch_sums.assign(tf.zeros_like(self.epoch_sums))
        self._save()
        if self.bar is not None and _compat.progbar_seen(self.bar) != self.bar.target:
            self.bar.update(_compat.progbar_seen(self.bar), finalize=True)
        self.bar = None

    def _after_window(self, logs):
        self._warn_short_batch(logs)
        values = [1.0] + [logs[k] for k in self.shown]
        self.epoch_sums.assign(self.epoch_sums.numpy() + np.array(values))
        batch = int(logs["batches"])
        self.log.write(dict(logs, time=time.time()), step=batch)
        for callback in self.callbacks:
            callback(logs)
        if self.bar is None and self.verbose:
            target = self.target if self.target > 0 else None
            self.bar = keras.utils.Progbar(target, stateful_metrics=["examples/s"])
        if self.bar is not None:
            shown = [(k, logs[k]) for k in self.shown]
            self.bar.update(
                int(logs["batch_in_epoch"]), shown + [("examples/s", logs["examples_per_second"])]
            )
        if batch - self.saved >= self.checkpoint_every:
            self._save()

    def _warn_short_batch(self, logs):
        optimizer = self.trainer.optimizer
        if (
            logs["items"] < self.global_batch
            and self.trainer.steps > 1
            and not self.warned
            and not getattr(optimizer, "takes_weights", False)
        ):
            warnings.warn(
                f"A short batch ({int(logs['items'])} < {self.global_batch} "
                f"items) was trained with {type(optimizer).__name__}, which "
                "takes no item weights: its unequal micro-batches counted "
                "equally. Use last_batch='drop' to skip short batches.",
                stacklevel=4,
            )
            self.warned = True

    def write_config(self, **fields):
        """Writes `fields` and the trainer's setup to config.json (chief, atomically)."""
        if not (self.workdir and self.chief):
            return
        trainer = self.trainer
        fields.update(
            replicas=trainer.strategy.num_replicas_in_sync,
            optimizer=keras.optimizers.serialize(trainer.optimizer),
            metrics=self.shown[1:],
            model=trainer.model.name,
            parameters=int(trainer.model.count_params()),
            resumed_at_batch=int(trainer.batches.numpy()),
        )
        os.makedirs(self.workdir, exist_ok=True)
        text = json.dumps(fields, indent=1, default=repr)
        atomic.atomic_write_text(os.path.join(self.workdir, "config.json"), text)


def train(
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer,
    loss_fn: Any,
    dataset: tf.data.Dataset,
    *,
    epochs: int = 1,
    steps: int | None = None,
    micro_batch_size: int | None = None,
    strategy: tf.distribute.Strategy | None = None,
    workdir: str | None = None,
    checkpoint_every: int = 100,
    metrics: Sequence[Any] = (),
    last_batch: str = "weighted",
    eval_dataset: tf.data.Dataset | None = None,
    callbacks: Sequence[Callable[[dict], None]] = (),
    verbose: int = 1,
    resume_hint: str | None = None,
    remat: str = "none",
) -> dict[str, list[float]]:
    """Trains `model` for `epochs` passes over `dataset`; one update per batch.

    Each global batch is one window, split over the replicas and on each into
    the optimizer's `steps` micro-batches, in one compiled step. With a
    `workdir`, a killed run called again resumes to the weights of an
    uninterrupted one (deterministic `dataset`). See docs/guides/custom_loop.md.

    Args:
        model: a built Keras model created inside `strategy.scope()`.
        optimizer: a keras_accum optimizer (or any Keras optimizer: one
            update per global batch), created inside `strategy.scope()`.
        loss_fn: (y_true, y_pred) -> per-item losses, a keras Loss or name.
        dataset: a finite, deterministic `tf.data.Dataset` of GLOBAL batches
            (x, y) or (x, y, sample_weight); sample_weight may be a token mask.
        epochs: passes over `dataset`.
        steps: micro-batches per replica per update; only states the
            optimizer's `steps` (a mismatch is an error).
        micro_batch_size: items per micro-batch per replica (or `steps`).
        strategy: a `tf.distribute` strategy; default: the one in scope.
        workdir: shared folder for checkpoints/, log.jsonl, tensorboard/ and
            config.json (written by the chief); None: nothing written or resumed.
        checkpoint_every: save every this many updates, and at each epoch end.
        metrics: names ("accuracy", ...) or per-item functions, logged as
            window means beside loss, learning rate, updates and skips.
        last_batch: "weighted" (train a short last batch, weighted by its
            item count) or "drop" (skip batches smaller than the first).
        eval_dataset: global batches evaluated at each epoch end (``val_`` keys).
        callbacks: `fn(logs)` run on every worker after each window.
        verbose: 1 for a progress bar on the chief, 0 for none.
        resume_hint: how to resume, added to a lost peer's `WorkerLostError`.
        remat: "none", "full" or "larger_than": trains
            `keras_accum.remat.rematerialize(model, remat)` (less activation
            memory, same variables, weights and checkpoints).

    Returns:
        name -> per-epoch means (with evaluation results; on the chief of a
        resumed run, the epochs before the resume too).
    """
    strategy = strategy or tf.distribute.get_strategy()
    global_batch, opt_steps, micro = checks.check_run(
        optimizer, dataset, strategy, epochs, steps, micro_batch_size, checkpoint_every, verbose
    )
    trainer = Trainer(
        model,
        optimizer,
        loss_fn,
        strategy=strategy,
        metrics=metrics,
        last_batch=last_batch,
        remat=remat,
    )
    controller = Controller(
        trainer,
        workdir=workdir,
        checkpoint_every=checkpoint_every,
        eval_dataset=eval_dataset,
        callbacks=callbacks,
        verbose=verbose,
    )
    # Steps, saves, restores and evaluations all communicate: a lost peer can surface anywhere.
    with peer_errors(resume_hint):
        controller.resume()
        split = {"steps": opt_steps, "micro_batch_size": micro, "global_batch_size": global_batch}
        controller.write_config(
            epochs=epochs,
            **split,
            last_batch=last_batch,
            remat=remat,
            strategy=type(strategy).__name__,
            checkpoint_every=checkpoint_every,
            loss=getattr(loss_fn, "__name__", repr(loss_fn)),
        )
        return controller.run(dataset, epochs, global_batch)
