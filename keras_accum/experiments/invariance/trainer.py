"""A fast direct-gradient trainer for the study: one model and one compiled
loop per (method, kappa), reused across learning rates and seeds."""

import functools

import keras
import numpy as np
import tensorflow as tf

from keras_accum import diagnostics
from keras_accum.experiments import data, models
from keras_accum.experiments.invariance.config import make_optimizer, optimizer_hyperparameters
from keras_accum.experiments.invariance.report import METRICS


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
