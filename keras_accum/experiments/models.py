"""Small classifiers, by name: `build_model("cnn", (40,), 10)`.

Every model is an uncompiled functional `keras.Model` that returns logits
(use `from_logits=True`). Weights are deterministic after
`keras.utils.set_random_seed`. Default sizes (parameters):
mlp 15,210; cnn 5,210 (on MNIST-1D; 60,874 with channels=96, the main
job's); resnet 0.70M (width 32, 32x32x3); transformer 18,826 (vocab 10,
length 32).
"""

import keras
from keras import layers


def mlp(input_shape, num_classes, hidden=(100, 100)):
    """MNIST-1D paper MLP: two hidden layers of 100 ReLU units.

    (The reference `MLPBase` also adds a skip connection around the second
    layer; this is the plain version.)
    """
    inputs = keras.Input(input_shape)
    x = layers.Flatten()(inputs)
    for units in hidden:
        x = layers.Dense(units, activation="relu")(x)
    return keras.Model(inputs, layers.Dense(num_classes)(x), name="mlp")


def cnn(input_shape, num_classes, channels=25, kernel_sizes=(5, 3, 3)):
    """MNIST-1D paper CNN: three stride-2 Conv1D of 25 channels, then Dense.

    Kernel sizes 5, 3, 3 are those of the reference code (`ConvBase` in
    greydanus/mnist1d); "same" padding gives lengths 20, 10, 5 (the
    reference's padding 1 gives 19, 10, 5), so Dense sees 125 features.

    Trained on MNIST-1D with the reference settings, Adam(1e-2), batch 100,
    200 epochs, it reaches 93-94% test accuracy (the paper's 94%); with
    Adam(1e-3), batch 32 it memorises the training set and stops at 84-87%.
    """
    inputs = keras.Input(input_shape)
    x = layers.Reshape((-1, 1))(inputs)  # (40,) -> (40, 1): one channel.
    for k in kernel_sizes:
        x = layers.Conv1D(channels, k, strides=2, padding="same", activation="relu")(x)
    x = layers.Flatten()(x)
    return keras.Model(inputs, layers.Dense(num_classes)(x), name="cnn")


def resnet(input_shape, num_classes, width=32, blocks_per_stage=2):
    """A small ResNet of basic blocks for 28x28x1 or 32x32x3 images.

    Three stages of `blocks_per_stage` basic blocks with widths `width`,
    2*width, 4*width (stride 2 between stages), global average pooling, Dense.
    About 0.18M parameters at width 16, 0.70M at 32, 2.8M at 64.

    Warning: BatchNormalization normalises with the statistics of the batch it
    sees. Under gradient accumulation that is each micro-batch, not the whole
    window, so its behaviour (and moving averages) depend on the micro-batch
    size even when the accumulated gradient does not.
    """
    inputs = keras.Input(input_shape)
    x = _conv_bn(inputs, width, 3, 1)
    x = layers.ReLU()(x)
    for stage in range(3):
        for block in range(blocks_per_stage):
            stride = 2 if stage > 0 and block == 0 else 1
            x = _basic_block(x, width * 2**stage, stride)
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(num_classes)(x), name="resnet")


def _conv_bn(x, filters, kernel, stride):
    x = layers.Conv2D(filters, kernel, strides=stride, padding="same", use_bias=False)(x)
    return layers.BatchNormalization()(x)


def _basic_block(x, filters, stride):
    shortcut = x
    if stride != 1 or x.shape[-1] != filters:  # Project to the new shape.
        shortcut = _conv_bn(x, filters, 1, stride)
    x = layers.ReLU()(_conv_bn(x, filters, 3, stride))
    x = _conv_bn(x, filters, 3, 1)
    return layers.ReLU()(layers.Add()([x, shortcut]))


@keras.saving.register_keras_serializable(package="keras_accum")
class PositionEmbedding(layers.Layer):
    """Adds a learned embedding per position to (batch, length, dim)."""

    def build(self, input_shape):
        self.embedding = self.add_weight(
            shape=tuple(input_shape[1:]),
            name="embedding",
            initializer=keras.initializers.RandomNormal(stddev=0.02),
        )

    def call(self, x):
        return x + self.embedding


def transformer(input_shape, num_classes, vocab_size, dim=32, heads=2, num_blocks=2, mlp_dim=64):
    """Pre-norm Transformer encoder on int tokens, mean-pooled, then Dense.

    `input_shape` is `(length,)`. The token `Embedding` receives sparse
    (`tf.IndexedSlices`) gradients, which accumulators must handle.
    """
    inputs = keras.Input(input_shape, dtype="int32")
    x = layers.Embedding(vocab_size, dim, name="token_embedding")(inputs)
    x = PositionEmbedding(name="position_embedding")(x)
    for _ in range(num_blocks):
        y = layers.LayerNormalization()(x)
        y = layers.MultiHeadAttention(heads, dim // heads)(y, y)
        x = layers.Add()([x, y])
        y = layers.LayerNormalization()(x)
        y = layers.Dense(mlp_dim, activation="gelu")(y)
        x = layers.Add()([x, layers.Dense(dim)(y)])
    x = layers.GlobalAveragePooling1D()(layers.LayerNormalization()(x))
    return keras.Model(inputs, layers.Dense(num_classes)(x), name="transformer")


MODELS = {"cnn": cnn, "mlp": mlp, "resnet": resnet, "transformer": transformer}


def build_model(name, input_shape, num_classes, **kwargs):
    """The model `name` for inputs of `input_shape` (no batch dimension).

    `kwargs` go to the builder (e.g. `width=` for resnet, `vocab_size=` for
    transformer, which requires it).
    """
    if name not in MODELS:
        raise ValueError(f"Unknown model {name!r}. Valid: {', '.join(sorted(MODELS))}")
    return MODELS[name](tuple(input_shape), num_classes, **kwargs)
