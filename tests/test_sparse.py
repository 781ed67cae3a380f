"""An Embedding's gradient (`tf.IndexedSlices`) stays sparse in
GradientAccumulation and InvariantAdam: its rows are added to the window's
sum, or folded into m and v, where they fall; no parameter-sized gradient
is built, and the result is the dense one's (numpy reference with repeated
rows, graph mode and XLA, weighted, non-finite policies, two replicas)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import mirrored_strategy

import keras_accum as ka
from keras_accum.drivers.tensorflow import _execution

# A variable at keras_accum's threshold for keeping its gradient sparse
# (smaller ones are made dense, as before).
WIDTH, STEPS = 3, 3
ROWS = -(-_execution.SPARSE_MIN_ELEMENTS // WIDTH)
RNG = np.random.default_rng(7)
# Per micro-batch: 4 rows touched, one of them twice.
INDICES = [np.array([0, 2, 2, ROWS - 1]), np.array([1, 1, 4, 0]), np.array([3, 5, 5, 5])] * 2
VALUES = [RNG.normal(size=(4, WIDTH)).astype("float32") for _ in INDICES]


def slices(j, values=None):
    values = VALUES[j] if values is None else values
    return tf.IndexedSlices(
        tf.constant(values), tf.constant(INDICES[j]), tf.constant([ROWS, WIDTH])
    )


def dense_of(j, values=None):
    out = np.zeros((ROWS, WIDTH), "float32")
    np.add.at(out, INDICES[j], VALUES[j] if values is None else values)
    return out


def sgd_reference(weights=None):
    """theta after SGD(1.0) on each window's weighted mean (numpy)."""
    theta = np.ones((ROWS, WIDTH), "float64")
    weights = [1.0] * len(INDICES) if weights is None else weights
    for start in range(0, len(INDICES), STEPS):
        window = range(start, start + STEPS)
        total = sum(weights[j] * dense_of(j).astype("float64") for j in window)
        theta -= total / sum(weights[j] for j in window)
    return theta


def run(opt, feed, jit_compile=False):
    """Applies `feed(j)` = (gradient, weight) for every micro-batch through
    one `tf.function` (XLA with `jit_compile`)."""
    var = keras.Variable(np.ones((ROWS, WIDTH), "float32"))
    opt.build([var])

    takes_weights = getattr(opt, "takes_weights", False)

    @tf.function(jit_compile=jit_compile)
    def step(values, indices, weight):
        grad = tf.IndexedSlices(values, indices, tf.constant([ROWS, WIDTH]))
        opt.apply([grad], [var], weight=weight if takes_weights else None)

    for j in range(len(INDICES)):
        grad, weight = feed(j)
        step(grad.values, grad.indices, tf.constant(weight, "float32"))
    return var.numpy()


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unit", "weighted"])
def test_sparse_window_mean_matches_numpy(jit_compile, weighted):
    weights = [1.0 + (j % 3) for j in range(len(INDICES))] if weighted else None
    opt = ka.GradientAccumulation(keras.optimizers.SGD(1.0), steps=STEPS)
    feed = lambda j: (slices(j), 1.0 if weights is None else weights[j])
    got = run(opt, feed, jit_compile)
    np.testing.assert_allclose(got, sgd_reference(weights), rtol=1e-6, atol=1e-6)


def trace_ops(opt, jit_compile):
    var = keras.Variable(np.ones((ROWS, WIDTH), "float32"))
    opt.build([var])

    @tf.function(jit_compile=jit_compile)
    def step(values, indices):
        opt.apply([tf.IndexedSlices(values, indices, tf.constant([ROWS, WIDTH]))], [var])

    graph = step.get_concrete_function(
        tf.TensorSpec([None, WIDTH], "float32"), tf.TensorSpec([None], "int32")
    ).graph.as_graph_def()
    ops = [n.op for n in graph.node]
    for function in graph.library.function:
        ops += [n.op for n in function.node_def]
    return ops


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_sparse_gradient_is_never_made_dense(jit_compile):
    # tf.convert_to_tensor(IndexedSlices) is an UnsortedSegmentSum into a
    # parameter-sized zeros; the rows go in with a scatter instead.
    opt = ka.GradientAccumulation(keras.optimizers.SGD(1.0), steps=STEPS)
    ops = trace_ops(opt, jit_compile)
    assert "ResourceScatterAdd" in ops
    assert "UnsortedSegmentSum" not in ops


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
@pytest.mark.parametrize("nonfinite", ["skip_window", "skip_micro_batch"])
def test_nan_in_sparse_rows_is_caught(jit_compile, nonfinite):
    # Micro-batch 1 (in the first window) carries a NaN in one row only.
    bad = VALUES[1].copy()
    bad[2, 0] = np.nan
    opt = ka.GradientAccumulation(keras.optimizers.SGD(1.0), steps=STEPS, nonfinite=nonfinite)
    feed = lambda j: (slices(j, bad if j == 1 else None), 1.0)
    got = run(opt, feed, jit_compile)
    theta = np.ones((ROWS, WIDTH), "float64")
    if nonfinite == "skip_micro_batch":  # the window's mean over its other two
        theta -= (dense_of(0) + dense_of(2)) / 2.0
    # skip_window: the first window is dropped whole.
    theta -= sum(dense_of(j).astype("float64") for j in range(3, 6)) / 3.0
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, theta, rtol=1e-6, atol=1e-6)
    skipped = opt.skipped_updates if nonfinite == "skip_window" else opt.skipped_micro_batches
    assert int(skipped) == 1


def test_nonfinite_raise_on_a_sparse_gradient():
    opt = ka.GradientAccumulation(keras.optimizers.SGD(1.0), steps=STEPS, nonfinite="raise")
    var = keras.Variable(np.ones((ROWS, WIDTH), "float32"))
    bad = VALUES[0].copy()
    bad[0, 0] = np.inf
    with pytest.raises(tf.errors.InvalidArgumentError, match="non-finite gradient"):
        opt.apply([slices(0, bad)], [var])


def test_two_replicas_sparse_equals_numpy():
    # Each replica adds its own rows to its own replica-local sum; the window
    # mean is the mean over both replicas' micro-batches.
    strategy = mirrored_strategy()
    with strategy.scope():
        var = keras.Variable(np.ones((ROWS, WIDTH), "float32"))
        opt = ka.GradientAccumulation(keras.optimizers.SGD(1.0), steps=STEPS)
        opt.build([var])

    all_values, all_indices = tf.constant(np.stack(VALUES)), tf.constant(np.stack(INDICES))
    step = mirrored_step(strategy, opt, var, False, all_values, all_indices)
    for j in range(STEPS):
        step(tf.constant(j))
    expected = np.ones((ROWS, WIDTH)) - sum(dense_of(j) for j in range(6)) / 6.0
    np.testing.assert_allclose(var.numpy(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["InvariantAdam", "UpdateAccumulationAdam"])
def test_loss_scale_factor_with_sparse_gradient(name):
    # `g / loss_scale_factor` on a tf.IndexedSlices raised a TypeError.
    variables = [keras.Variable(np.ones((ROWS, WIDTH), "float32")) for _ in range(2)]
    scaled = getattr(ka, name)(0.1, steps=2, loss_scale_factor=8.0)
    plain = getattr(ka, name)(0.1, steps=2)
    for j in range(4):
        scaled.apply([slices(j, VALUES[j] * 8.0)], [variables[0]])
        plain.apply([slices(j)], [variables[1]])
    np.testing.assert_allclose(variables[0].numpy(), variables[1].numpy(), rtol=1e-6)


def _small_transformer(length=8, vocab=64, dim=16):
    """Token and position Embeddings, one attention block, a classifier."""
    tokens = keras.Input((length,), dtype="int32")
    x = keras.layers.Embedding(vocab, dim)(tokens)
    x = x + keras.layers.Embedding(length, dim)(keras.ops.arange(length))
    x = x + keras.layers.MultiHeadAttention(2, dim // 2)(x, x)
    x = keras.layers.Dense(32, activation="relu")(keras.layers.LayerNormalization()(x))
    return keras.Model(tokens, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(x)))


@pytest.mark.parametrize(
    "name, jit_compile",
    [("GradientAccumulation", False), ("InvariantAdam", True)],
    ids=["graph-GradientAccumulation", "xla-InvariantAdam"],
)
def test_fit_on_a_transformer_matches_dense_gradients(name, jit_compile, monkeypatch):
    # Through `fit` on a small transformer (token and position Embeddings),
    # every sparse gradient kept sparse (threshold lowered), against the
    # same optimizer handed the dense gradients.
    monkeypatch.setattr(_execution, "SPARSE_MIN_ELEMENTS", 1)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 8, (24, 8)).astype("int32")  # tokens repeat
    y = (x[:, 0] > 3).astype("int32")
    cls = getattr(ka, name)

    def densify(self, grads, trainable_variables=None, weight=None):
        grads = [tf.convert_to_tensor(g) for g in grads]
        cls.apply(self, grads, trainable_variables, weight)

    weights = []
    for kind in (cls, type("Densified" + name, (cls,), {"apply": densify})):
        keras.utils.set_random_seed(0)
        model = _small_transformer()
        # epsilon 1e-3: the attention key bias's gradient is zero up to
        # rounding (softmax ignores it), and Adam would scale that noise,
        # which the order of additions changes, up to learning-rate steps.
        adam = {"learning_rate": 0.05, "epsilon": 1e-3}
        if name == "GradientAccumulation":
            optimizer = kind(keras.optimizers.Adam(**adam), steps=3)
        else:
            optimizer = kind(**adam, steps=3)
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=jit_compile,
        )
        model.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False)
        weights.append(model.get_weights())
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


class Densified:
    """The same optimizer, handed the dense form of every gradient."""

    def __init__(self, opt):
        self.opt = opt

    def build(self, variables):
        self.opt.build(variables)

    def apply(self, grads, variables, weight=None):
        self.opt.apply([tf.convert_to_tensor(g) for g in grads], variables)


INVARIANT = {
    "default": {},
    "skip_micro_batch_nan": {"nonfinite": "skip_micro_batch"},
    "scaling_rule": {"scaling_rule": "invariant"},
    "steps_schedule": {"steps": ka.PiecewiseSteps([3], [3, 2])},
    # Clipped micro-batches take the dense path: Keras would clip the
    # uncombined rows of a sparse gradient, not the gradient.
    "global_clipnorm": {"global_clipnorm": 0.5},
}


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
@pytest.mark.parametrize("case", INVARIANT)
def test_invariant_adam_sparse_equals_dense(jit_compile, case):
    kwargs = dict({"steps": STEPS}, **INVARIANT[case])
    bad = VALUES[1].copy()
    if case == "skip_micro_batch_nan":
        bad[2, 0] = np.nan
    feed = lambda j: (slices(j, bad if j == 1 else None), 1.0)
    sparse = run(ka.InvariantAdam(0.1, **kwargs), feed, jit_compile)
    dense = run(Densified(ka.InvariantAdam(0.1, **kwargs)), feed, jit_compile)
    assert np.all(np.isfinite(sparse))
    np.testing.assert_allclose(sparse, dense, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_invariant_adam_folds_rows_without_a_dense_gradient(jit_compile, monkeypatch):
    made_dense = []
    dense = _execution.dense

    def recording(grad):
        made_dense.append(isinstance(grad, tf.IndexedSlices))
        return dense(grad)

    monkeypatch.setattr(_execution, "dense", recording)
    ops = trace_ops(ka.InvariantAdam(0.1, steps=STEPS), jit_compile)
    assert "ResourceScatterAdd" in ops
    assert not any(made_dense)


def mirrored_step(strategy, opt, var, densify, all_values, all_indices):
    """A step of two replicas: replica r feeds micro-batch 2j + r."""

    @tf.function
    def step(j):
        def replica_fn():
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
            pick = lambda a, b: tf.where(tf.equal(r, 0), a, b)
            values = pick(tf.gather(all_values, 2 * j), tf.gather(all_values, 2 * j + 1))
            indices = pick(tf.gather(all_indices, 2 * j), tf.gather(all_indices, 2 * j + 1))
            # Keras convention: each replica's share of the global mean.
            grad = tf.IndexedSlices(values / 2.0, indices, tf.constant([ROWS, WIDTH]))
            opt.apply([tf.convert_to_tensor(grad) if densify else grad], [var])

        strategy.run(replica_fn)

    return step


def test_invariant_adam_two_replicas_sparse_equals_dense():
    strategy = mirrored_strategy()
    results = []
    all_values, all_indices = tf.constant(np.stack(VALUES)), tf.constant(np.stack(INDICES))
    for densify in (False, True):
        with strategy.scope():
            var = keras.Variable(np.ones((ROWS, WIDTH), "float32"))
            opt = ka.InvariantAdam(0.1, steps=STEPS)
            opt.build([var])

        step = mirrored_step(strategy, opt, var, densify, all_values, all_indices)
        for j in range(STEPS):
            step(tf.constant(j))
        results.append(var.numpy())
    np.testing.assert_allclose(results[0], results[1], rtol=1e-6, atol=1e-7)


def test_combine_rows_sums_repeated_rows():
    got_rows, got_values = _execution.combine_rows(slices(2))  # rows 3, 5, 5, 5
    expected = dense_of(2)
    dense = np.zeros((ROWS, WIDTH), "float32")
    np.add.at(dense, got_rows.numpy(), got_values.numpy())
    np.testing.assert_allclose(dense, expected, rtol=1e-6)
    assert sorted(set(got_rows.numpy()[:2])) == [3, 5]
    np.testing.assert_array_equal(got_values.numpy()[2:], 0.0)


@pytest.mark.parametrize("name", ["GradientAccumulation", "InvariantAdam"])
def test_small_variable_gradient_is_made_dense(name, monkeypatch):
    # Below the threshold the dense fold is cheaper: the old path, exactly.
    monkeypatch.setattr(_execution, "SPARSE_MIN_ELEMENTS", ROWS * WIDTH + 1)
    opt = (
        ka.GradientAccumulation(keras.optimizers.SGD(1.0), steps=STEPS)
        if name == "GradientAccumulation"
        else ka.InvariantAdam(0.1, steps=STEPS)
    )
    assert "ResourceScatterAdd" not in trace_ops(opt, jit_compile=False)


@pytest.mark.parametrize("name", ["invariant", "update"])
def test_steps_1_is_keras_adam_on_the_dense_gradient_not_on_the_rows(name):
    # The README's claim: with steps=1 the Adam variants equal Keras's Adam
    # given the dense gradient of an Embedding whose token repeats; Keras's
    # Adam given the IndexedSlices squares the repeated rows one by one.
    tokens = np.array([[1, 1, 1, 2]])

    def step(optimizer, dense):
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((4,), dtype="int32"),
                keras.layers.Embedding(10, 3),
                keras.layers.Flatten(),
                keras.layers.Dense(1),
            ]
        )
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(tokens) - 1.0) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        assert isinstance(grads[0], tf.IndexedSlices)
        if dense:
            grads = [tf.convert_to_tensor(g) for g in grads]
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return model.layers[0].get_weights()[0]

    ours = {"invariant": ka.InvariantAdam, "update": ka.UpdateAccumulationAdam}[name]
    result = step(ours(0.1, steps=1), dense=False)
    np.testing.assert_array_equal(result, step(keras.optimizers.Adam(0.1), dense=True))
    assert not np.allclose(result, step(keras.optimizers.Adam(0.1), dense=False), atol=1e-3)
