"""Rematerialization (`keras_accum.remat`): the same gradients and weights
with and without it (model.fit, the custom loop, MirroredStrategy, XLA),
nothing changed in Keras or on the model given, a saved rematerialized
model that loads, the run's files and the loop's checkpoints those of the
run without it, a bad mode or a subclassed model refused in one line, and
the memory probe measuring a lower peak with it.

Tolerance: recomputed activations are the same float32 ops, but the
backward pass sums in another order; after a few Adam updates the weights
agree to about 1e-6 (a parameter whose gradient is zero in exact
arithmetic, the attention's key bias, moves by Adam's normalised rounding
noise), so atol=1e-5.
"""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import mirrored_strategy

import keras_accum as ka
from keras_accum import remat, training
from keras_accum.experiments import charlm, experiment, fit_memory, models
from keras_accum.experiments import config as cfg

ATOL = 1e-5
MODES = ("full", "larger_than")


def cnn():
    return models.cnn((40,), 10)


def lm():
    return charlm.build_lm(seq_len=32)


def data(builder, items=16):
    rng = np.random.default_rng(0)
    if builder is cnn:
        return rng.normal(size=(items, 40)).astype("float32"), rng.integers(0, 10, items)
    x = rng.integers(0, charlm.VOCAB_SIZE, (items, 32)).astype("int32")
    return x, rng.integers(0, charlm.VOCAB_SIZE, (items, 32)).astype("int32")


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def fit_weights(builder, mode, jit_compile=False, optimizer=None, strategy=None):
    keras.utils.set_random_seed(0)
    with (strategy or tf.distribute.get_strategy()).scope():
        model = remat.rematerialize(builder(), mode)
        optimizer = optimizer or ka.InvariantAdam(1e-3, steps=2)
        model.compile(optimizer, LOSS, jit_compile=jit_compile)
    x, y = data(builder)
    model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0)  # 4 windows
    return model.get_weights()


def assert_same(a, b):
    assert len(a) == len(b)
    for p, q in zip(a, b):
        np.testing.assert_allclose(p, q, rtol=0, atol=ATOL)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("builder", [cnn, lm], ids=["cnn", "lm"])
def test_fit_same_weights(builder, mode):
    assert_same(fit_weights(builder, "none"), fit_weights(builder, mode))


def test_fit_same_weights_under_xla():
    assert_same(fit_weights(lm, "none", True), fit_weights(lm, "full", True))


def test_fit_under_mirrored_same_weights():
    strategy = mirrored_strategy()
    plain = fit_weights(lm, "none", strategy=strategy)
    assert_same(plain, fit_weights(lm, "full", strategy=strategy))


def test_mixed_precision_recomputes_in_float16():
    # The recomputation casts the variables as the layer's call did (it
    # failed with a float16/float32 MatMul before). Float16 activations:
    # float16 rounding, which Adam would blow up to its step size on the
    # attention's key bias (zero gradient in exact arithmetic): SGD.
    def sgd():
        return ka.GradientAccumulation(keras.optimizers.SGD(0.1), steps=2)

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        plain = fit_weights(lm, "none", optimizer=sgd())
        rematerialized = fit_weights(lm, "full", optimizer=sgd())
    finally:
        keras.mixed_precision.set_global_policy("float32")
    for p, q in zip(plain, rematerialized):
        np.testing.assert_allclose(p, q, rtol=0, atol=1e-3)


def test_dropout_is_left_alone_and_trains_the_same():
    def with_dropout():
        inputs = keras.Input((40,))
        x = keras.layers.Dense(64, activation="gelu")(inputs)
        x = keras.layers.Dropout(0.5)(x)
        return keras.Model(inputs, keras.layers.Dense(10)(x))

    model = remat.rematerialize(with_dropout(), "full")
    wrapped = {type(unwrapped(layer)).__name__: wraps(layer) for layer in model.layers}
    assert not wrapped["Dropout"] and wrapped["Dense"]
    x, y = data(cnn)

    def trained(mode):
        keras.utils.set_random_seed(0)
        model = remat.rematerialize(with_dropout(), mode)
        model.compile(ka.InvariantAdam(1e-3, steps=2), LOSS)
        model.fit(x, y, batch_size=2, shuffle=False, verbose=0)
        return model.get_weights()

    assert_same(trained("none"), trained("full"))


def wraps(layer):
    return isinstance(layer, remat.Rematerialized)


def unwrapped(layer):
    return layer.layer if wraps(layer) else layer


def loop_weights(builder, mode, strategy):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = builder()
        optimizer = ka.GradientAccumulation(keras.optimizers.Adam(1e-3), steps=2)
    x, y = data(builder)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)  # 2 windows
    training.train(
        model, optimizer, LOSS, dataset, epochs=2, strategy=strategy, verbose=0, remat=mode
    )
    return model.get_weights()


@pytest.mark.parametrize("builder", [cnn, lm], ids=["cnn", "lm"])
def test_custom_loop_same_weights(builder):
    strategy = tf.distribute.get_strategy()
    assert_same(loop_weights(builder, "none", strategy), loop_weights(builder, "full", strategy))


def test_mirrored_same_weights():
    strategy = mirrored_strategy()
    assert_same(loop_weights(lm, "none", strategy), loop_weights(lm, "full", strategy))


LEFT = (keras.layers.Embedding, keras.layers.InputLayer)


def test_which_layers_are_wrapped():
    plain = lm()
    model = remat.rematerialize(plain, "full")
    assert model is not plain and not wraps(model)  # The outermost model is not wrapped.
    assert [unwrapped(layer) for layer in model.layers[1:]] == plain.layers[1:]  # The same.
    for layer in model.layers:
        assert wraps(layer) != isinstance(layer, LEFT)
    threshold = 32 * 32  # The LM's residual stream: 32 positions x 32.
    model = remat.rematerialize(plain, "larger_than", output_size_threshold=threshold)
    wrapped = {layer.name for layer in model.layers if wraps(layer)}
    large = {
        layer.name
        for layer in plain.layers
        if remat._output_size(layer) > threshold and not isinstance(layer, LEFT)
    }
    # Only the MLP's hidden layers (32 x 64) are above it.
    hidden = {layer.name for layer in plain.layers if getattr(layer, "units", 0) == 64}
    assert wrapped == large == hidden and len(hidden) == 2
    assert remat.mode_of(model) == "larger_than" and remat.mode_of(plain) == "none"
    # A rematerialized model is decided again: "none" unwraps it.
    assert remat.mode_of(remat.rematerialize(model, "full")) == "full"
    unwrapped_model = remat.rematerialize(model, "none")
    assert remat.mode_of(unwrapped_model) == "none"
    assert unwrapped_model.layers[1:] == plain.layers[1:]  # All but the new InputLayer.


def test_nested_models_count_as_their_layers():
    # A nested Sequential and a nested Functional model: cloned around the
    # same layers, each wrapped but the Dropout; a Sequential gives a
    # Functional model.
    inner = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(16), keras.layers.Dropout(0.5)], name="inner"
    )
    x = keras.Input((16,))
    block = keras.Model(x, keras.layers.Dense(4)(keras.layers.Dense(16)(x)), name="block")
    inputs = keras.Input((8,))
    plain = keras.Model(inputs, block(inner(keras.layers.Dense(16)(inputs))))
    model = remat.rematerialize(plain, "full")
    assert remat.mode_of(model) == "full"
    kinds = [[type(layer).__name__ for layer in m.layers] for m in model.layers[2:]]
    assert kinds == [["Rematerialized", "Dropout"], ["InputLayer"] + 2 * ["Rematerialized"]]
    assert {id(v) for v in model.weights} == {id(v) for v in plain.weights}
    x = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")
    np.testing.assert_array_equal(model(x), plain(x))
    sequential = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
    model = remat.rematerialize(sequential, "full")
    assert [type(layer).__name__ for layer in model.layers] == ["InputLayer", "Rematerialized"]
    np.testing.assert_array_equal(model(x), sequential(x))


def test_nothing_global_or_on_the_model_changes():
    from keras.src.backend.tensorflow import core

    keras_remat = core.remat
    plain = lm()
    layers = list(plain.layers)
    attributes = [sorted(vars(layer)) for layer in layers]
    weights = plain.get_weights()
    model = remat.rematerialize(plain, "full")
    assert core.remat is keras_remat
    assert plain.layers == layers and all(a is b for a, b in zip(plain.layers, layers))
    assert [sorted(vars(layer)) for layer in plain.layers] == attributes
    assert not any(wraps(layer) for layer in plain.layers)
    # The new model holds the same variables, not copies.
    assert all(a is b for a, b in zip(model.weights, plain.weights))
    assert_same(model.get_weights(), weights)


def test_a_model_not_rematerialized_trains_bit_identically():
    # Two identical models, a third one rematerialized (and trained) in
    # between: the other two end with exactly the same weights.
    def trained():
        keras.utils.set_random_seed(0)
        model = lm()
        model.compile(ka.InvariantAdam(1e-3, steps=2), LOSS)
        model.fit(*data(lm), batch_size=2, shuffle=False, verbose=0)
        return model.get_weights()

    before = trained()
    other = remat.rematerialize(lm(), "full")
    other.compile(ka.InvariantAdam(1e-3, steps=2), LOSS)
    other.fit(*data(lm), batch_size=2, shuffle=False, verbose=0)
    for p, q in zip(before, trained()):
        np.testing.assert_array_equal(p, q)


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_gradients_are_those_of_the_model(jit_compile):
    plain = lm()
    model = remat.rematerialize(plain, "full")
    x, y = data(lm, items=4)

    @tf.function(jit_compile=jit_compile)
    def gradients(m):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(LOSS(y, m(x, training=True)))
        return tape.gradient(loss, m.trainable_variables)

    for p, q in zip(gradients(plain), gradients(model)):
        np.testing.assert_allclose(tf.convert_to_tensor(p), tf.convert_to_tensor(q), atol=1e-6)


def test_wrapping_a_sublayer_of_a_subclassed_model():
    # The advice for a subclassed model, with a masked input: the mask
    # reaches the recomputation (it differs from an unmasked mean).
    class Pooled(keras.Model):
        def __init__(self, wrap):
            super().__init__()
            self.embed = keras.layers.Embedding(10, 8, mask_zero=True)
            self.hidden = keras.layers.Dense(8, activation="gelu")
            self.pool = keras.layers.GlobalAveragePooling1D()
            if wrap:
                self.hidden = remat.Rematerialized(self.hidden)
                self.pool = remat.Rematerialized(self.pool)
            self.out = keras.layers.Dense(2)

        def call(self, x):
            return self.out(self.pool(self.hidden(self.embed(x))))

    x = np.random.default_rng(0).integers(1, 10, (4, 6)).astype("int32")
    x[:, 3:] = 0

    def gradients(wrap):
        keras.utils.set_random_seed(0)
        model = Pooled(wrap)

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(x, training=True) ** 2)
            return tape.gradient(loss, model.trainable_variables)

        return [tf.convert_to_tensor(g) for g in step()]

    for p, q in zip(gradients(False), gradients(True)):
        np.testing.assert_allclose(p, q, atol=1e-6)


def test_subclassed_model_is_refused():
    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__(name="subclassed")
            self.dense = keras.layers.Dense(3)

        def call(self, x):
            return self.dense(x)

    model = Subclassed()
    model(np.zeros((1, 4), "float32"))
    with pytest.raises(ValueError) as error:
        remat.rematerialize(model, "full")
    message = str(error.value)
    assert "\n" not in message and "Functional" in message and "Rematerialized" in message
    assert message.endswith("Received: model='subclassed' of type Subclassed")


def test_saved_model_loads(tmp_path):
    plain = lm()
    plain.compile(ka.InvariantAdam(steps=2), LOSS)
    model = remat.rematerialize(plain, "full")
    # Compiled as `plain`, with its optimizer object.
    assert model.compiled and model.optimizer is plain.optimizer and model.loss is plain.loss
    x, y = data(lm)
    model.fit(x, y, batch_size=4, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")  # keras_accum is imported
    assert remat.mode_of(loaded) == "full"  # The file holds the wrappers.
    assert [v.path for v in loaded.weights] == [v.path for v in plain.weights]
    assert_same(loaded.get_weights(), model.get_weights())
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations) == 2


def test_loop_checkpoint_is_that_of_the_run_without_remat(tmp_path):
    # Written with remat, restored without it (and the other way round).
    x, y = data(lm, items=8)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)

    def trainer(mode):
        keras.utils.set_random_seed(0)
        optimizer = ka.GradientAccumulation(keras.optimizers.Adam(1e-3), steps=2)
        return training.Trainer(lm(), optimizer, LOSS, remat=mode)

    for saved, restored in (("full", "none"), ("none", "full")):
        writer = trainer(saved)
        writer.train_step(iter(writer.distribute(dataset)))
        writer.save(str(tmp_path / saved))
        reader = trainer(restored)
        assert reader.restore(str(tmp_path / saved)) is not None
        assert_same(reader.model.get_weights(), writer.model.get_weights())
        assert remat.mode_of(reader.model) == restored


BAD = "`remat` must be one of 'none', 'full', 'larger_than'. Received: remat='ful'"


def test_bad_mode_is_one_line():
    # Each error names the argument as its signature spells it: `mode` in
    # `rematerialize(model, mode)`, `remat` in the loop's and the config's.
    with pytest.raises(ValueError) as error:
        remat.rematerialize(cnn(), "ful")
    assert str(error.value) == BAD.replace("remat", "mode")
    with pytest.raises(ValueError) as error:
        remat.rematerialize(cnn(), mode="ful")
    assert str(error.value) == BAD.replace("remat", "mode")
    with pytest.raises(ValueError) as error:
        training.Trainer(cnn(), ka.InvariantAdam(steps=2), LOSS, remat="ful")
    assert str(error.value) == BAD
    with pytest.raises(cfg.ConfigError) as error:
        experiment.resolve_config({"remat": "ful"})
    assert str(error.value) == BAD


def test_run_records_remat_and_peak_memory(tmp_path):
    # The run's own files: config.json has the mode; final.json the peak
    # (None here: this process's CPU allocator is not BFC) and the same
    # results as the run without remat.
    config = {
        "dataset": "synthetic_tokens",
        "model": "transformer",
        "micro_batch_size": 16,
        "steps": 2,
        "epochs": 1,
        "verbose": 0,
    }
    plain = experiment.train_and_evaluate(config, tmp_path / "plain")
    final = experiment.train_and_evaluate({**config, "remat": "full"}, tmp_path / "remat")
    assert json.loads((tmp_path / "remat" / "config.json").read_text())["remat"] == "full"
    assert "peak_tensor_memory_mb" in json.loads((tmp_path / "remat" / "final.json").read_text())
    assert final["test_loss"] == pytest.approx(plain["test_loss"], abs=ATOL)
    # Resuming loads the checkpoint and rematerializes it again; a folder
    # from before the `remat` key resumes too (the key takes its default).
    resumed = experiment.train_and_evaluate(None, tmp_path / "remat", resume=True)
    assert resumed["test_loss"] == pytest.approx(final["test_loss"], abs=ATOL)
    for path in (tmp_path / "plain").glob("**/config.json"):
        old = json.loads(path.read_text())
        del old["remat"]
        path.write_text(json.dumps(old))
    resumed = experiment.train_and_evaluate(None, tmp_path / "plain", resume=True)
    assert resumed["test_loss"] == pytest.approx(plain["test_loss"], abs=ATOL)


def test_memory_probe_measures_less_with_remat():
    # A transformer whose activations dwarf its weights (micro-batch 256 of
    # 32 tokens, a 512-wide MLP): each measured in a fresh BFC process.
    config = {
        "dataset": "synthetic_tokens",
        "model": "transformer",
        "model_kwargs": {"dim": 64, "mlp_dim": 512},
    }
    plain = fit_memory.measure(config, 256, "none")["peak_mb"]
    rematerialized = fit_memory.measure(config, 256, "full")["peak_mb"]
    assert rematerialized < 0.8 * plain, (plain, rematerialized)


def test_plan_takes_the_largest_measured_micro_batch_that_fits(monkeypatch):
    # The search, with a stand-in for the measured step: 10 MB + 1 MB per
    # item without remat, 10 MB + 0.25 MB per item with it.
    calls = []

    def measure(config, micro_batch, mode):
        calls.append((micro_batch, mode))
        return {"peak_mb": 10 + micro_batch * (1 if mode == "none" else 0.25)}

    monkeypatch.setattr(fit_memory, "measure", measure)
    plan = fit_memory.plan({}, budget_mb=30, batch=96, report=lambda line: None)
    assert plan["none"]["micro_batch"] == 16 and plan["none"]["steps"] == 6
    assert plan["full"]["micro_batch"] == 32 and plan["full"]["steps"] == 3
    assert plan["full"]["tried"] == {1: 10.25, 2: 10.5, 4: 11, 8: 12, 16: 14, 32: 18, 96: 34}
    assert (64, "full") not in calls  # Only divisors of the batch.
    tight = fit_memory.plan({}, budget_mb=10.5, batch=8, report=lambda line: None)
    assert tight["none"] == {
        "micro_batch_1_mb": 11,
        "fits": False,
        "micro_batch": None,
        "steps": None,
        "peak_mb": None,
        "tried": {1: 11},
    }
    assert tight["full"]["micro_batch"] == 2 and tight["full"]["steps"] == 4


def test_batch_normalization_is_not_recomputed():
    # A recomputed BatchNormalization moved its moving statistics twice per
    # step (0.2.0 too): its forward pass runs again in the backward pass.
    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,))
        x = keras.layers.Dense(8)(inputs)
        x = keras.layers.BatchNormalization(momentum=0.5)(x)
        return keras.Model(inputs, keras.layers.Dense(1)(x))

    x = np.random.default_rng(0).normal(size=(16, 6)).astype("float32")
    y = np.ones((16, 1), "float32")
    stats = []
    for mode in ("none", "full"):
        model = remat.rematerialize(build(), mode)
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
        (bn,) = [
            layer
            for layer in model.layers
            if isinstance(getattr(layer, "layer", layer), keras.layers.BatchNormalization)
        ]
        assert isinstance(bn, keras.layers.BatchNormalization)  # not wrapped
        stats.append([bn.moving_mean.numpy(), bn.moving_variance.numpy()])
    for a, b in zip(*stats):
        np.testing.assert_allclose(a, b, rtol=1e-6)
