"""The one training loop of the studies: direct gradients, compiled once.

Both studies (`invariance`, `schedules_study`) train one model many times:
over methods, window sizes, learning rates and seeds, every run of a seed
from the same weights and the same stream of micro-batches. `StudyRunner`
keeps one model and, per optimizer configuration, one optimizer and its
compiled loops; a run restores the optimizer's initial state and the
model's initial weights, so a trace serves every learning rate and seed.
"""

import functools

import keras
import numpy as np
import tensorflow as tf

from keras_accum import diagnostics
from keras_accum.experiments import data, models

METRICS = ("train_loss", "test_loss", "test_accuracy")


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


def window_size(optimizer):
    """The window size in force (before the first window: the first one's)."""
    if isinstance(optimizer.steps, int):
        return optimizer.steps
    if int(optimizer.micro_step.numpy()) == 0:
        return int(optimizer.steps(0).numpy())
    return int(optimizer.window_steps.numpy())


def _train_chunk(gradient_fn, optimizer, variables, xs, ys):
    # One apply per micro-batch; the optimizer decides when a window ends.
    # A graph loop: no Python overhead per micro-batch.
    for i in tf.range(tf.shape(xs)[0]):
        optimizer.apply(gradient_fn(xs[i], ys[i]), variables)


class StudyRunner:
    """One model; per optimizer configuration one optimizer and its loops.

    Args:
        model_name, input_shape, num_classes: for `models.build_model`.
        eval_data: dict with `train` and `test`, each (x, y) numpy arrays:
            the train loss is measured on `train`, loss and accuracy on
            `test`, all with `training=False`; optionally `validation`
            (its loss is `val_loss`).
        build: optional model builder replacing `models.build_model` (the
            character LM).
    """

    def __init__(self, model_name, input_shape, num_classes, eval_data, build=None):
        self._build = build or (lambda: models.build_model(model_name, input_shape, num_classes))
        self.model = self._build()
        self._loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self._eval_data = {k: tuple(tf.constant(a) for a in v) for k, v in eval_data.items()}
        self._evaluate = tf.function(self._evaluate_fn)
        self._loops, self._probes = {}, {}

    @classmethod
    def for_config(cls, config):
        """(runner, x_train, y_train) for a study config's `dataset` (the
        character LM for `charlm.CharCorpus.name`), `data_dir`, `model` and
        `train_eval_examples` (the first ones of train measure its loss)."""
        from keras_accum.experiments import charlm

        dataset, data_dir, n = config["dataset"], config["data_dir"], config["train_eval_examples"]
        if dataset == charlm.CharCorpus.name:
            load = lambda split: charlm.load_arrays(split, data_dir)  # noqa: E731
            shape, classes, build = (charlm.SEQ_LEN,), charlm.VOCAB_SIZE, charlm.build_lm
        else:
            load = lambda split: load_arrays(dataset, split, data_dir)  # noqa: E731
            info = data.dataset_info(dataset, data_dir)
            shape, classes, build = info.input_shape, info.num_classes, None
        (x, y), test = load("train"), load("test")
        eval_data = {"train": (x[:n], y[:n]), "test": test}
        return cls(config["model"], shape, classes, eval_data, build=build), x, y

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
        out = (train_loss, test_loss, tf.reduce_mean(tf.cast(correct, tf.float32)))
        if "validation" in self._eval_data:  # a split held out of train for tuning
            xv, yv = self._eval_data["validation"]
            out += (self._loss(yv, self.model(xv, training=False)),)
        return out

    def evaluate(self):
        """METRICS (and `val_loss` with a `validation` split) as floats."""
        names = METRICS + ("val_loss",) * ("validation" in self._eval_data)
        return dict(zip(names, (float(v) for v in self._evaluate())))

    def gradient(self, x, y):
        """The gradient of the mean loss over one micro-batch (g_j)."""
        with tf.GradientTape() as tape:
            loss = self._loss(y, self.model(x, training=True))
        return tape.gradient(loss, self.model.trainable_variables)

    def loops(self, key, make, phases=()):
        """(optimizer, one compiled loop per phase, pending changes, initial
        variable values) of configuration `key`, built with `make()` on
        first use. `phases[i]` changes the optimizer before the loop of
        phase i + 1 is first traced: Python hyperparameters are baked into
        a trace, so each phase keeps its own."""
        if key not in self._loops:
            optimizer = make()
            variables = self.model.trainable_variables
            optimizer.build(variables)
            # A partial, not a closure: TensorFlow then counts each loop's
            # (single) trace on its own instead of warning about retracing.
            loop = functools.partial(_train_chunk, self.gradient, optimizer, variables)
            fns = [tf.function(loop) for _ in range(len(phases) + 1)]
            pending = dict(enumerate(phases, start=1))
            initial = [v.numpy() for v in optimizer.variables]
            self._loops[key] = (optimizer, fns, pending, initial)
        return self._loops[key]

    def forget(self, key):
        """Drops configuration `key` (an optimizer with per-run state that
        its initial values do not reset, such as a schedule object)."""
        self._loops.pop(key, None)

    def run_segments(self, key, make, segments, weights, xs, ys, chunk, phases=(), probe=None):
        """Trains from `weights` on the micro-batches `xs`, `ys` (shapes
        [n, b, ...], [n, b]); `segments` = [(micro_batches, phase, lr)].
        Evaluates at the start and every `chunk` micro-batches;
        `probe(optimizer)` runs after each chunk. Returns a list of dicts:
        examples, updates, kappa (the window size in force), metrics."""
        optimizer, loops, pending, initial = self.loops(key, make, phases)
        for variable, value in zip(optimizer.variables, initial):
            variable.assign(value)
        for variable, value in zip(self.model.weights, weights):
            variable.assign(value)
        b = int(xs.shape[1])
        points = [{"examples": 0, "updates": 0, "kappa": window_size(optimizer), **self.evaluate()}]
        start = 0
        for length, phase, lr in segments:
            optimizer.learning_rate = lr
            for lo in range(start, start + length, chunk):
                if phase in pending:  # before its loop's first (only) trace
                    pending.pop(phase)(optimizer)
                loops[phase](xs[lo : lo + chunk], ys[lo : lo + chunk])
                if probe is not None:
                    probe(optimizer)
                points.append(
                    {
                        "examples": (lo + chunk) * b,
                        "updates": int(optimizer.iterations.numpy()),
                        "kappa": window_size(optimizer),
                        **self.evaluate(),
                    }
                )
            start += length
        return points

    def fresh_noise_probe(self, micro_batch_size, kappa, ema):
        """(tracker, probe): `probe(xw, yw)` ([kappa, b, ...], one window,
        compiled once per arguments) feeds the window's micro-batch
        gradients to a `diagnostics.GradientNoiseScale(ema)` tracker, its
        state zeroed (as new)."""
        key = (micro_batch_size, kappa, ema)
        if key not in self._probes:
            tracker = diagnostics.GradientNoiseScale(ema)

            @tf.function(autograph=False)  # no control flow to convert
            def probe(xw, yw):
                micro = [self.gradient(xw[j], yw[j]) for j in range(kappa)]
                tracker.update_from_micro_grads(micro, micro_batch_size)

            self._probes[key] = (tracker, probe)
        tracker, probe = self._probes[key]
        for variable in tracker.variables:  # A fresh estimate: zero state.
            variable.assign(tf.zeros_like(variable))
        return tracker, probe

    def noise_scale(self, x, y, micro_batch_size, kappa, windows, seed, ema=0.99):
        """B_simple of the model as it is, from `windows` probe windows of
        `kappa` micro-batches drawn from (x, y) without replacement
        (`fresh_noise_probe`). Returns the tracker's `result()` as floats
        (B_simple is inf when the smoothed |G|^2 estimate is <= 0: signal
        not resolved)."""
        tracker, probe = self.fresh_noise_probe(micro_batch_size, kappa, ema)
        rng = np.random.default_rng([seed, 2])
        for _ in range(windows):
            idx = rng.choice(len(x), kappa * micro_batch_size, replace=False)
            idx = idx.reshape(kappa, micro_batch_size)
            probe(tf.constant(x[idx]), tf.constant(y[idx]))
        return {k: float(v) for k, v in tracker.result().items()}
