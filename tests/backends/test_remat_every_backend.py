"""`rematerialize` on whichever backend Keras runs: the same weights after
`fit` with and without it (GradientAccumulation and InvariantAdam, every
recomputing mode, a masked input), a saved rematerialized model that
loads, and the recomputation really dropping activations (PyTorch: what
autograd keeps; JAX: the compiled step's temporary memory).

The route: `tf.recompute_grad` on TensorFlow, `keras.remat` on JAX and
PyTorch (`jax.checkpoint`, `torch.utils.checkpoint`). Tolerance: PyTorch
recomputes the same eager ops, so the weights are bit-identical (asserted
exactly); XLA (JAX) and TensorFlow's graph fuse and sum the backward pass
otherwise with the recomputation: float32 rounding, at most 1.5e-7 (JAX)
and 2.9e-7 (TensorFlow) measured over these cases, asserted 1e-6.
"""

import keras
import numpy as np
import pytest

import keras_accum as ka
from keras_accum import remat

BACKEND = keras.backend.backend()
ATOL = 0.0 if BACKEND == "torch" else 1e-6
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
# Elements per item above which "larger_than" recomputes a layer: the
# hidden layers below are above it, the 4-class heads are not.
THRESHOLD = 16


def mlp():
    inputs = keras.Input((16,))
    x = keras.layers.Dense(32, activation="gelu")(inputs)
    x = keras.layers.LayerNormalization()(x)
    x = keras.layers.Dropout(0.2)(x)  # left alone: it draws random numbers
    x = keras.layers.Dense(32, activation="tanh")(x)
    return keras.Model(inputs, keras.layers.Dense(4)(x))


def masked():
    # The mask from the Embedding reaches the pooling's recomputation.
    inputs = keras.Input((6,), dtype="int32")
    x = keras.layers.Embedding(10, 8, mask_zero=True)(inputs)
    x = keras.layers.Dense(16, activation="gelu")(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, keras.layers.Dense(4)(x))


def data(builder):
    rng = np.random.default_rng(0)
    y = rng.integers(0, 4, 32).astype("int32")
    if builder is mlp:
        return rng.normal(size=(32, 16)).astype("float32"), y
    x = rng.integers(1, 10, (32, 6)).astype("int32")
    x[:, 4:] = 0
    return x, y


OPTIMIZERS = {
    "invariant_adam": lambda: ka.InvariantAdam(1e-2, steps=2),
    "ga_adam": lambda: ka.GradientAccumulation(keras.optimizers.Adam(1e-2), steps=2),
}


def trained(builder, mode, make):
    keras.utils.set_random_seed(0)
    model = remat.rematerialize(builder(), mode, output_size_threshold=THRESHOLD)
    model.compile(make(), LOSS)
    model.fit(*data(builder), batch_size=4, shuffle=False, verbose=0)  # 4 windows
    return model


def assert_same(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=0, atol=ATOL)


@pytest.mark.parametrize(
    "builder, mode, optimizer",
    [
        (mlp, "full", "invariant_adam"),
        (mlp, "full", "ga_adam"),
        (mlp, "larger_than", "invariant_adam"),
        (mlp, "larger_than", "ga_adam"),
        (masked, "full", "invariant_adam"),
        (masked, "larger_than", "ga_adam"),
    ],
    ids=lambda value: getattr(value, "__name__", value),
)
def test_fit_same_weights(builder, mode, optimizer):
    plain = trained(builder, "none", OPTIMIZERS[optimizer])
    model = trained(builder, mode, OPTIMIZERS[optimizer])
    assert remat.mode_of(model) == mode  # Something is recomputed, in "larger_than" not all.
    keras.utils.set_random_seed(0)
    initial = builder().get_weights()
    assert any(not np.array_equal(a, b) for a, b in zip(plain.get_weights(), initial))
    assert_same(model.get_weights(), plain.get_weights())
    x, _ = data(builder)
    assert_same(model.predict(x, verbose=0), plain.predict(x, verbose=0))


def test_saved_model_loads(tmp_path):
    # `masked`: no Dropout, whose draws after loading are another matter.
    model = trained(masked, "full", OPTIMIZERS["invariant_adam"])
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")  # keras_accum is imported
    assert remat.mode_of(loaded) == "full"
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    x, y = data(masked)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    # Training goes on from the saved state as it does in `model`.
    for m in (loaded, model):
        m.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert_same(loaded.get_weights(), model.get_weights())


def deep_mlp(depth, width):
    inputs = keras.Input((width,))
    x = inputs
    for _ in range(depth):
        x = keras.layers.Dense(width, activation="gelu")(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x))


@pytest.mark.skipif(BACKEND != "torch", reason="autograd's saved tensors are PyTorch's")
def test_torch_keeps_only_each_layers_input():
    import torch

    depth, width, batch = 6, 64, 32
    x = np.random.default_rng(0).normal(size=(batch, width)).astype("float32")

    def saved_bytes(model):
        total = 0

        def pack(tensor):
            nonlocal total
            total += tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = keras.ops.sum(model(x, training=True) ** 2)
        loss.backward()
        return total

    plain = deep_mlp(depth, width)
    kept = saved_bytes(remat.rematerialize(plain, "full"))
    # Each layer's input (the model's input and the 6 hidden outputs) and
    # the logits that `** 2` keeps; nothing a layer computed inside.
    assert kept == 4 * ((depth + 1) * batch * width + batch * 10)
    assert kept < saved_bytes(plain) / 2


@pytest.mark.skipif(BACKEND != "jax", reason="XLA's memory analysis of a JAX step")
def test_jax_compiled_step_needs_less_temporary_memory():
    # The step Keras jit-compiles (`train_step`, the state donated), one
    # micro-batch; activations (256 x 256 per layer, and GELU's input)
    # dwarf the weights.
    import jax

    x = np.zeros((256, 256), "float32")
    y = np.zeros((256,), "int32")

    def temp_bytes(mode):
        model = remat.rematerialize(deep_mlp(8, 256), mode)
        model.compile(ka.InvariantAdam(1e-3, steps=4), LOSS)
        model.optimizer.build(model.trainable_variables)
        state = model._get_jax_state(
            trainable_variables=True,
            non_trainable_variables=True,
            optimizer_variables=True,
            metrics_variables=True,
        )
        step = jax.jit(model.train_step, donate_argnums=0)
        return step.lower(state, (x, y)).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes("full") < 0.75 * temp_bytes("none")


@pytest.mark.parametrize("mode", ["full", "none"])
def test_keras_without_remat(monkeypatch, mode):
    # Keras < 3.9 has no `keras.remat`: JAX and PyTorch refuse a wrapper in
    # one line; TensorFlow's route (`tf.recompute_grad`) needs none.
    monkeypatch.delattr(keras, "remat", raising=False)
    if BACKEND == "tensorflow" or mode == "none":
        model = remat.rematerialize(mlp(), mode)
        assert remat.mode_of(model) == mode
        return
    with pytest.raises(RuntimeError) as error:
        remat.rematerialize(mlp(), mode)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"`Rematerialized` on {BACKEND} needs Keras >= 3.9.0")
    assert f"Keras {keras.__version__} is installed" in message


def test_activity_regularized_layer_is_left_alone():
    # Its loss would be computed inside the recomputation (TensorFlow drops
    # its gradient, JAX leaks a tracer): left unwrapped, the model trains
    # as without remat; wrapping it by hand is refused in one line.
    def regularized():
        inputs = keras.Input((16,))
        x = keras.layers.Dense(32, activation="gelu", activity_regularizer="l2")(inputs)
        x = keras.layers.Dense(32, activation="gelu")(x)
        return keras.Model(inputs, keras.layers.Dense(4)(x))

    def fitted(mode):
        keras.utils.set_random_seed(0)
        model = remat.rematerialize(regularized(), mode)
        model.compile(ka.InvariantAdam(1e-2, steps=2), LOSS)
        model.fit(*data(mlp), batch_size=4, shuffle=False, verbose=0)
        return model

    model = fitted("full")
    kinds = [type(layer).__name__ for layer in model.layers]
    assert kinds == ["InputLayer", "Dense", "Rematerialized", "Rematerialized"]
    assert remat.mode_of(model) == "full"  # Every layer it may wrap.
    assert_same(model.get_weights(), fitted("none").get_weights())
    with pytest.raises(ValueError) as error:
        remat.Rematerialized(keras.layers.Dense(2, activity_regularizer="l2", name="d"))
    message = str(error.value)
    assert "\n" not in message and message.endswith("Received: layer='d'")
