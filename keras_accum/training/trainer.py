"""The Trainer: one compiled step per window (orbit style); the outer loop is
`controller.py`. One `train_step` splits a global batch over the replicas and
on each into `steps` micro-batches, one `optimizer.apply` each, in a graph
loop traced once. Loss scaling, short batches, checkpoints: see
docs/guides/custom_loop.md.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from keras_accum import base
from keras_accum import layers as layers_lib
from keras_accum import remat as remat_lib
from keras_accum.training import checkpoints, checks
from keras_accum.training.checks import steps_per_update
from keras_accum.training.distribute import data_sharded, is_chief
from keras_accum.training.losses import resolve_loss, resolve_metrics, weighted
from keras_accum.training.stream import batch_size, peek_batch_size, replay, split_batch

#: Short last batch policies: "weighted" (trained, weighted by its size) or "drop".
LAST_BATCH_POLICIES = ("weighted", "drop")


class Trainer:
    """Compiled window steps, evaluation and checkpoints for one model.

    Args:
        model: a built Keras model, created inside `strategy.scope()`.
        optimizer: a keras_accum optimizer (a window: `steps` micro-batches
            per replica) or any Keras optimizer (one update per global batch),
            created inside `strategy.scope()`.
        loss_fn: (y_true, y_pred) -> per-item losses, a `keras.losses.Loss`
            (unreduced) or a loss name.
        strategy: the `tf.distribute` strategy; default: the one in scope.
        metrics: names ("accuracy", "mae", ...) or per-item functions, each
            logged as its sample-weighted window mean.
        last_batch: one of `LAST_BATCH_POLICIES`.
        remat: one of `keras_accum.remat.MODES`; not "none": trains
            `rematerialize(model, remat)` (the `model` attribute), which
            shares `model`'s variables; checkpoints hold `model` as given.

    `train_step(iterator)` (one window) and `micro_batch_step(iterator)` (one
    micro-batch per replica; a window then spans `steps` calls and `save` may
    fall inside it) are `tf.function`s over `distribute(dataset)` returning
    scalar logs. Counters: `batches` (non-empty elements trained), `epoch`,
    `batch_in_epoch`; `checkpoint` holds them with model and optimizer.
    """

    def __init__(
        self,
        model: keras.Model,
        optimizer: keras.optimizers.Optimizer,
        loss_fn: Any,
        *,
        strategy: tf.distribute.Strategy | None = None,
        metrics: Sequence[Any] = (),
        last_batch: str = "weighted",
        remat: str = "none",
    ):
        self.strategy = strategy or tf.distribute.get_strategy()
        if last_batch not in LAST_BATCH_POLICIES:
            raise ValueError(
                f"`last_batch` must be one of {LAST_BATCH_POLICIES}. "
                f"Received: last_batch={last_batch!r}"
            )
        self.last_batch = last_batch
        remat_lib.check_mode(remat, "remat")
        checks.check_scope(self.strategy, model, optimizer)
        self.model, self.optimizer = model, optimizer
        # Its keras_accum BatchNormalization layers follow this optimizer's windows.
        layers_lib.attach(model, optimizer)
        if remat != "none":
            # In the scope: a compiled model's copy is compiled (its metrics).
            with self.strategy.scope():
                self.model = remat_lib.rematerialize(model, remat)
        self.steps = steps_per_update(optimizer)
        self._loss_fn = resolve_loss(loss_fn)
        self._metric_fns = resolve_metrics(metrics)
        with self.strategy.scope():
            if not optimizer.built:
                optimizer.build(model.trainable_variables)
            counter = dict(
                dtype=tf.int64,
                trainable=False,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )
            self.batches = tf.Variable(0, name="batches", **counter)
            self.epoch = tf.Variable(0, name="epoch", **counter)
            self.batch_in_epoch = tf.Variable(0, name="batch_in_epoch", **counter)
            # Replica-local sums of the window's logs, reduced once per window.
            self._sums = tf.Variable(
                tf.zeros([2 + len(self._metric_fns)]),
                trainable=False,
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.SUM,
                name="log_sums",
            )
        self.checkpoint = tf.train.Checkpoint(
            # `model` as given: the checkpoint does not depend on `remat`.
            model=model,
            optimizer=optimizer,
            # Dropout's SeedGenerator states are reachable only through this list.
            model_variables=list(model.variables),
            batches=self.batches,
            epoch=self.epoch,
            batch_in_epoch=self.batch_in_epoch,
        )
        self.train_step = tf.function(lambda it: self._run(it, self.steps))
        self.micro_batch_step = tf.function(lambda it: self._run(it, 1))
        self._eval_step = tf.function(self._evaluate_batch)

    def track(self, name, trackable):
        """Adds `trackable` (e.g. a controller's variable) to `checkpoint`."""
        setattr(self.checkpoint, name, trackable)

    # -- data -----------------------------------------------------------------

    def distribute(
        self, dataset: tf.data.Dataset, *, epochs: int = 1, global_batch_size: int | None = None
    ) -> tf.distribute.DistributedDataset:
        """The distributed stream of `epochs` passes over `dataset` from `position`;
        `global_batch_size` (for "drop") defaults to the first batch's."""
        full = None
        if self.last_batch == "drop":
            full = global_batch_size or peek_batch_size(
                dataset.filter(lambda *b: batch_size(b) > 0)
            )
        return replay(
            dataset, self.strategy, position=self.position, epochs=epochs, full_batch=full
        )

    @property
    def metric_names(self) -> list[str]:
        """Names of the metrics logged beside the loss, in order."""
        return [name for name, _ in self._metric_fns]

    @property
    def position(self):
        """Stream elements consumed (batches plus epoch markers): the checkpoint number."""
        return int(self.batches.numpy()) + int(self.epoch.numpy())

    # -- the step -------------------------------------------------------------

    def _run(self, iterator, parts):
        """One dataset element: `parts` micro-batches per replica."""
        if parts is None:
            raise ValueError(
                "The optimizer's `steps` is a schedule: its windows change size, "
                "so feed a dataset of micro-batches to `Trainer.micro_batch_step` "
                f"instead of `train_step`. Received: steps={self.optimizer.steps!r}"
            )
        batch = next(iterator)
        totals = self.strategy.run(self._count, args=(batch, parts))
        self.strategy.run(lambda: self._sums.assign(tf.zeros_like(self._sums)))
        items = self.strategy.experimental_local_results(totals)[0][parts]
        # An empty element is the end-of-epoch marker: nothing to train.
        for part in tf.range(tf.where(items > 0, parts, 0)):
            self.strategy.run(self._micro, args=(batch, part, parts, totals))
        sums = self.strategy.experimental_local_results(self.strategy.run(self._reduce_logs))[0]
        opt = self.optimizer
        logs = {
            "loss": tf.math.divide_no_nan(sums[0], sums[1]),
            **{
                name: tf.math.divide_no_nan(sums[2 + i], sums[1])
                for i, (name, _) in enumerate(self._metric_fns)
            },
            "items": items,
            "updates": tf.cast(opt.iterations, tf.float32),
            "skipped_micro_batches": sums[-1],
            "learning_rate": tf.cast(opt.learning_rate, tf.float32),
        }
        if isinstance(opt, base.AccumulationOptimizer):
            logs["micro_step"] = tf.cast(opt.micro_step, tf.float32)
            logs["skipped_updates"] = tf.cast(opt.skipped_updates, tf.float32)
        with tf.control_dependencies(list(logs.values())):
            trained = tf.cast(items > 0, tf.int64)
            updates = [
                self.batches.assign_add(trained),
                self.epoch.assign_add(1 - trained),
                self.batch_in_epoch.assign((self.batch_in_epoch + 1) * trained),
            ]
        with tf.control_dependencies(updates):
            for name in ("batches", "epoch", "batch_in_epoch"):
                logs[name] = tf.cast(getattr(self, name).read_value(), tf.float32)
        return logs

    def _count(self, batch, parts):
        """Replica context: global item counts per part (sample weight sums),
        then the batch's items; one all-reduce."""
        _, _, sample_weight = split_batch(batch)
        n = batch_size(batch)
        bounds = (tf.range(parts + 1) * n) // parts
        if sample_weight is None:
            counts = tf.cast(bounds[1:] - bounds[:-1], tf.float32)
        else:
            weights = tf.cast(sample_weight, tf.float32)
            per_item = tf.reduce_sum(tf.reshape(weights, [n, -1]), axis=1)
            part_of = tf.searchsorted(bounds[1:], tf.range(n), side="right")
            counts = tf.math.unsorted_segment_sum(per_item, part_of, parts)
        local = tf.concat([counts, [tf.cast(n, tf.float32)]], axis=0)
        return tf.distribute.get_replica_context().all_reduce("sum", local)

    def _micro(self, batch, part, parts, totals):
        """Replica context: one micro-batch, one `optimizer.apply`."""
        n = batch_size(batch)
        lo, hi = (part * n) // parts, ((part + 1) * n) // parts
        x, y, sample_weight = tf.nest.map_structure(
            lambda t: None if t is None else t[lo:hi], split_batch(batch)
        )
        count = totals[part]
        model = self.model
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            sums = self._sums_of(y, y_pred, sample_weight)
            # Summed loss / GLOBAL count: summed over replicas, the global mean's
            # gradient, the convention the optimizers (all-reduce SUM) use.
            loss = tf.math.divide_no_nan(sums[0], count)
            if model.losses:
                replicas = self.strategy.num_replicas_in_sync
                loss += tf.add_n(model.losses) / replicas
        variables = model.trainable_variables
        grads = tape.gradient(loss, variables)
        if getattr(self.optimizer, "takes_weights", False):
            self.optimizer.apply(grads, variables, weight=count)
        else:
            self.optimizer.apply(grads, variables)
        self._sums.assign_add(sums)

    def _sums_of(self, y, y_pred, sample_weight):
        """[sum w loss, sum w, sum w metric, ...] over one replica's items."""
        per_item, weights = weighted(self._loss_fn, y, y_pred, sample_weight)
        metrics = [weighted(fn, y, y_pred, sample_weight)[0] for _, fn in self._metric_fns]
        return tf.stack(
            [tf.reduce_sum(v * weights) for v in [per_item, tf.ones_like(per_item)] + metrics]
        )

    def _reduce_logs(self):
        """Replica context: log sums and skipped micro-batches, one all-reduce."""
        skipped = getattr(self.optimizer, "skipped_micro_batches", None)
        skipped = 0.0 if skipped is None else tf.cast(skipped.value, tf.float32)
        local = tf.concat([tf.convert_to_tensor(self._sums), [skipped]], 0)
        return tf.distribute.get_replica_context().all_reduce("sum", local)

    # -- evaluation -----------------------------------------------------------

    def _evaluate_batch(self, iterator):
        def replica_fn(batch):
            x, y, sample_weight = split_batch(batch)
            sums = self._sums_of(y, self.model(x, training=False), sample_weight)
            return tf.distribute.get_replica_context().all_reduce("sum", sums)

        result = self.strategy.run(replica_fn, args=(next(iterator),))
        return self.strategy.experimental_local_results(result)[0]

    def evaluate(self, dataset: tf.data.Dataset) -> dict[str, float]:
        """Sample-weighted mean loss and metrics over global batches (every worker)."""
        iterator = iter(self.strategy.experimental_distribute_dataset(data_sharded(dataset)))
        total = np.zeros(2 + len(self._metric_fns))
        while True:
            try:
                total += self._eval_step(iterator).numpy()
            except tf.errors.OutOfRangeError:
                break
        names = ["loss"] + [name for name, _ in self._metric_fns]
        means = np.concatenate([total[:1], total[2:]]) / (total[1] or np.nan)
        return dict(zip(names, map(float, means)))

    # -- checkpoints ----------------------------------------------------------

    def save(self, directory: str, max_to_keep: int = 3) -> str:
        """Saves `directory/ckpt-<position>` atomically, keeping `max_to_keep`;
        every worker calls it (a collective), only the chief keeps the files."""
        chief = is_chief(self.strategy)
        target = directory if chief else tempfile.mkdtemp(prefix="ckpt_worker")
        path = checkpoints.write_tf(
            self.checkpoint, target, self.position, max_to_keep, self.optimizer.variables
        )
        if not chief:
            shutil.rmtree(target, ignore_errors=True)
        return path

    def restore(self, directory: str) -> str | None:
        """Restores the newest intact checkpoint in `directory`; returns its path
        or None. `CheckpointError` if none is intact or it does not match."""
        path = checkpoints.newest_tf(directory)
        if path is not None:
            checkpoints.restore_tf(self.checkpoint, path, self.optimizer.variables)
        return path
