"""The controller: the outer loop around `Trainer` (epochs, checkpoints,
logs, evaluation, resume)."""

import json
import os
import time
import warnings

import keras
import numpy as np
import tensorflow as tf

from keras_accum.gradient_accumulation import GradientAccumulation
from keras_accum.training.distribute import is_chief, peer_errors
from keras_accum.training.step import Trainer, peek_batch_size, window_steps
from keras_accum.validation import check_int


def _check_split(global_batch, replicas, opt_steps, steps, micro_batch_size):
    """Validates `steps` / `micro_batch_size` against the batch and the
    optimizer's window; returns the micro-batch size per replica."""
    if steps is not None and micro_batch_size is not None:
        raise ValueError(
            "Give `steps` or `micro_batch_size`, not both (one follows from "
            f"the other). Received: steps={steps!r}, "
            f"micro_batch_size={micro_batch_size!r}"
        )
    if global_batch % replicas:
        raise ValueError(
            f"The global batch size {global_batch} (first batch of `dataset`) "
            f"must be divisible by the {replicas} replicas in sync."
        )
    per_replica = global_batch // replicas
    if steps is not None:
        check_int("steps", steps)
        if steps != opt_steps:
            raise ValueError(
                f"`steps` must equal the optimizer's window ({opt_steps} "
                f"micro-batches per replica). Received: steps={steps!r}"
            )
    if micro_batch_size is not None:
        check_int("micro_batch_size", micro_batch_size)
        if per_replica % micro_batch_size:
            raise ValueError(
                "`micro_batch_size` must divide the per-replica batch size "
                f"{per_replica} (global batch {global_batch} / {replicas} "
                f"replicas). Received: micro_batch_size={micro_batch_size!r}"
            )
        if per_replica // micro_batch_size != opt_steps:
            raise ValueError(
                f"`micro_batch_size` gives {per_replica // micro_batch_size} "
                f"micro-batches per replica, but the optimizer's window has "
                f"steps={opt_steps}. Received: "
                f"micro_batch_size={micro_batch_size!r}"
            )
    if per_replica % opt_steps:
        raise ValueError(
            f"The per-replica batch size {per_replica} (global batch "
            f"{global_batch} / {replicas} replicas) is not divisible by the "
            f"optimizer's steps={opt_steps}: micro-batches would differ in "
            "size. Change the batch size or `steps`."
        )
    return per_replica // opt_steps


class _Log:
    """JSONL lines and TensorBoard scalars in the workdir (chief only)."""

    def __init__(self, workdir, chief, resume_batches, resume_epoch):
        self.path = workdir and os.path.join(workdir, "log.jsonl")
        self.writer = tf.summary.create_noop_writer()
        if not (workdir and chief):
            self.path = None
            return
        self.writer = tf.summary.create_file_writer(os.path.join(workdir, "tensorboard"))
        if os.path.exists(self.path):
            # A restart: drop what was logged after the restored checkpoint.
            with open(self.path) as f:
                lines = [json.loads(line) for line in f if line.strip()]
            kept = [
                line
                for line in lines
                if line.get("batches", 0) <= resume_batches and line.get("epoch", 0) <= resume_epoch
            ]
            with open(self.path, "w") as f:
                f.writelines(json.dumps(line) + "\n" for line in kept)

    def write(self, record, step, prefix=""):
        if self.path is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        with self.writer.as_default(step=step):
            for name, value in record.items():
                if isinstance(value, float) and name not in (
                    "time",
                    "epoch",
                    "batches",
                    "batch_in_epoch",
                ):
                    tf.summary.scalar(prefix + name, value)
        self.writer.flush()


def train(
    model,
    optimizer,
    loss_fn,
    dataset,
    *,
    epochs=1,
    steps=None,
    micro_batch_size=None,
    strategy=None,
    workdir=None,
    checkpoint_every=100,
    metrics=(),
    last_batch="weighted",
    eval_dataset=None,
    callbacks=(),
    verbose=1,
):
    """Trains `model` for `epochs` passes over `dataset`; one update per batch.

    Each global batch of `dataset` is one window: it is split over the
    replicas and, on each, into the optimizer's `steps` micro-batches, all in
    one compiled step (see the module docstring). With a `workdir`, a run
    that is killed resumes from its last checkpoint when called again with
    the same arguments, and ends with the same weights as an uninterrupted
    run (for a deterministic `dataset`).

    Args:
        model: a built Keras model created inside `strategy.scope()`.
        optimizer: a keras_accum optimizer (or any Keras optimizer: one
            update per global batch), created inside `strategy.scope()`.
        loss_fn: (y_true, y_pred) -> per-item losses, a keras Loss or name.
        dataset: a finite `tf.data.Dataset` of GLOBAL batches (x, y) or
            (x, y, sample_weight); sample_weight may be a token mask of the
            loss's shape. Must be deterministic for exact resumption.
        epochs: passes over `dataset`.
        steps: micro-batches per replica per update. The optimizer's `steps`
            decides it; this argument (or `micro_batch_size`, not both) only
            states it, and a mismatch is an error.
        micro_batch_size: items per micro-batch on one replica; must divide
            the per-replica batch into the optimizer's `steps` parts.
        strategy: a `tf.distribute` strategy; default: the one in scope.
        workdir: directory for checkpoints/, log.jsonl, tensorboard/ and
            config.json (written by the chief; every worker restores from
            it, so it must be shared); None: nothing written or resumed.
        checkpoint_every: save every this many updates (windows), and at
            the end of each epoch.
        metrics: names ("accuracy", ...) or per-item functions, logged as
            window means; loss, learning rate, updates and skipped
            micro-batches are always logged.
        last_batch: "weighted" (train a short last batch, weighted by its
            item count) or "drop" (skip batches smaller than the first).
        eval_dataset: optional dataset of global batches evaluated at the end
            of each epoch (keys prefixed with "val_").
        callbacks: callables `fn(logs)` run on every worker after each
            window, `logs` a dict of floats (loss, batches, epoch, ...).
        verbose: 1 for a progress bar on the chief, 0 for none.

    Returns:
        A dict name -> list of per-epoch means (over the windows this process
        trained in that epoch), with the evaluation results.
    """
    strategy = strategy or tf.distribute.get_strategy()
    check_int("epochs", epochs)
    check_int("checkpoint_every", checkpoint_every)
    if verbose not in (0, 1):
        raise ValueError(f"`verbose` must be 0 or 1. Received: verbose={verbose!r}")
    global_batch = peek_batch_size(dataset)
    opt_steps = window_steps(optimizer)
    if opt_steps is None:
        raise ValueError(
            "`train` needs a constant `steps`; with a schedule drive "
            "`Trainer.micro_step` over a dataset of micro-batches. "
            f"Received: steps={optimizer.steps!r}"
        )
    micro = _check_split(
        global_batch, strategy.num_replicas_in_sync, opt_steps, steps, micro_batch_size
    )
    trainer = Trainer(
        model, optimizer, loss_fn, strategy=strategy, metrics=metrics, last_batch=last_batch
    )
    chief = is_chief(strategy)
    checkpoints = workdir and os.path.join(workdir, "checkpoints")
    if checkpoints and trainer.restore(checkpoints) and verbose and chief:
        print(f"Resuming from {tf.train.latest_checkpoint(checkpoints)}")
    if opt_steps > 1 and int(optimizer.micro_step.numpy()) % opt_steps:
        raise ValueError(
            "`optimizer` is in the middle of a window (micro_step="
            f"{int(optimizer.micro_step.numpy())}, steps={opt_steps}); finish "
            "it with `Trainer.micro_step` before training whole windows."
        )
    done = int(trainer.batches.numpy())
    if workdir and chief:
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(
                dict(
                    epochs=epochs,
                    steps=opt_steps,
                    micro_batch_size=micro,
                    global_batch_size=global_batch,
                    last_batch=last_batch,
                    replicas=strategy.num_replicas_in_sync,
                    strategy=type(strategy).__name__,
                    checkpoint_every=checkpoint_every,
                    optimizer=keras.optimizers.serialize(optimizer),
                    loss=getattr(loss_fn, "__name__", repr(loss_fn)),
                    metrics=[name for name, _ in trainer._metrics],
                    model=model.name,
                    parameters=int(model.count_params()),
                    resumed_at_batch=done,
                ),
                f,
                indent=1,
                default=repr,
            )
    log = _Log(workdir, chief, done, int(trainer.epoch.numpy()))
    iterator = iter(trainer.distribute(dataset, epochs=epochs, global_batch_size=global_batch))
    target = int(dataset.cardinality())
    shown = ["loss"] + [name for name, _ in trainer._metrics]
    state = dict(history={}, epoch_logs=[], bar=None, warned=False, saved=done)

    def save(batch):
        if checkpoints:
            state["saved"] = batch
            trainer.save(checkpoints)

    def end_of_epoch(logs):
        epoch_logs, bar = state["epoch_logs"], state["bar"]
        record = {k: float(np.mean([r[k] for r in epoch_logs])) for k in shown if epoch_logs}
        if eval_dataset is not None:
            record.update({f"val_{k}": v for k, v in trainer.evaluate(eval_dataset).items()})
        for k, v in record.items():
            state["history"].setdefault(k, []).append(v)
        log.write(
            {"epoch": logs["epoch"], "batches": logs["batches"], "epoch_end": True, **record},
            step=int(logs["batches"]),
            prefix="epoch/",
        )
        save(int(logs["batches"]))
        if bar is not None and bar._seen_so_far != bar.target:
            bar.update(bar._seen_so_far, finalize=True)
        state.update(bar=None, epoch_logs=[])

    def after_window(logs):
        batch = int(logs["batches"])
        if (
            logs["items"] < global_batch
            and opt_steps > 1
            and not state["warned"]
            and not isinstance(optimizer, GradientAccumulation)
        ):
            warnings.warn(
                f"A short batch ({int(logs['items'])} < {global_batch} "
                f"items) was trained with {type(optimizer).__name__}, which "
                "takes no item weights: its unequal micro-batches counted "
                "equally. Use last_batch='drop' to skip short batches.",
                stacklevel=2,
            )
            state["warned"] = True
        state["epoch_logs"].append(logs)
        log.write(dict(logs, time=time.time()), step=batch)
        for callback in callbacks:
            callback(logs)
        if state["bar"] is None and verbose and chief:
            state["bar"] = keras.utils.Progbar(
                target if target > 0 else None, stateful_metrics=["examples/s"]
            )
        if state["bar"] is not None:
            state["bar"].update(
                int(logs["batch_in_epoch"]),
                [(k, logs[k]) for k in shown] + [("examples/s", logs["examples_per_second"])],
            )
        if batch - state["saved"] >= checkpoint_every:
            save(batch)

    # Steps, saves and evaluations all communicate: a dead peer can surface
    # in any of them.
    with peer_errors():
        while True:
            start = time.perf_counter()
            try:
                logs = trainer.train_step(iterator)
            except tf.errors.OutOfRangeError:
                break
            logs = {k: float(v) for k, v in logs.items()}
            logs["examples_per_second"] = logs["items"] / (time.perf_counter() - start)
            if logs["items"] == 0:  # the end-of-epoch marker
                end_of_epoch(logs)
            else:
                after_window(logs)
    return state["history"]
