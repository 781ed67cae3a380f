"""keras-hub as a client: a tiny `GPT2CausalLM` with LoRA fine-tuned with the
three optimizers under `model.fit`, and its training state across a restart.

Needs the `hub` extra (`pip install -e '.[hub]'`), which `test` leaves out
(keras-hub 0.32 needs Keras >= 3.15 and TensorFlow 2.21, above the floor that
.ci/floor installs with `[test]`); without it every test here skips.
`.ci/backends` installs it and runs this file under TensorFlow, JAX and
PyTorch. Nothing is downloaded: the backbone is random-initialised from a
config and fed token ids (`preprocessor=None`).
"""

import os

import keras
import numpy as np
import pytest

import keras_accum as ka

keras_hub = pytest.importorskip(
    "keras_hub", reason="keras-hub is not installed (the `hub` extra: pip install -e '.[hub]')"
)

VOCABULARY, LENGTH = 64, 16  # tokens, sequence length
MICRO = 4  # sequences per micro-batch
LR = 1e-2
# Adam moves a weight by about LR per update; the weights are at most ~0.5.
# Against the big batch they differ only by float32 rounding of the gradient
# mean (a sum of micro-batch means instead of one mean): <= 3.3e-7 seen on
# every backend, about 10 ulps of the largest weight. A window that lost a
# micro-batch, stepped per micro-batch or weighted its micro-batches wrongly
# is off by ~1e-3 to 1e-2 (weighting by batch instead of tokens below: 0.02).
ATOL = 1e-6
# Keras's PyTorch backend draws the dropout masks of a layer made without a
# seed (keras-hub's) from torch's global generator, which is not a variable:
# a restored run draws other masks there. TensorFlow and JAX draw them from
# the layers' seed generators, whose states are among `model.variables`.
DROPOUT_RESUMES = keras.backend.backend() != "torch"


def causal_lm(lora=True, dropout=0.0):
    """A 2-layer GPT-2 of hidden size 16, random-initialised (seeded), its
    query and value projections LoRA-enabled at rank 2. No dropout by
    default, so that micro-batches and the big batch compute the same
    function."""
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        dropout=dropout,
        max_sequence_length=LENGTH,
    )
    if lora:
        backbone.enable_lora(rank=2)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def token_data(sequences, padded=False, seed=0):
    """(x, y, sample_weight) as `GPT2CausalLMPreprocessor` makes them: the
    next token is the target, the padding mask the sample weight. `padded`:
    each sequence keeps a random 1..LENGTH tokens, the rest padding."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCABULARY, size=(sequences, LENGTH + 1)).astype("int32")
    if padded:
        kept = rng.integers(1, LENGTH + 1, size=sequences)
        mask = np.arange(LENGTH)[None, :] < kept[:, None]
    else:
        mask = np.ones((sequences, LENGTH), bool)
    x = {"token_ids": np.where(mask, tokens[:, :-1], 0), "padding_mask": mask}
    return x, np.where(mask, tokens[:, 1:], 0), mask.astype("float32")


def rows(data, start, stop):
    """Micro-batches start..stop-1 of `token_data`'s arrays."""
    x, y, weight = data
    part = slice(start * MICRO, stop * MICRO)
    return {k: v[part] for k, v in x.items()}, y[part], weight[part]


def fit(model, data, batch_size=MICRO, callbacks=(), epochs=1):
    x, y, weight = data
    return model.fit(
        x,
        y,
        sample_weight=weight,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=list(callbacks),
    )


def numpy(variables):
    return [keras.ops.convert_to_numpy(v) for v in variables]


def token_mean():
    """Cross-entropy averaged over the unpadded tokens (keras-hub's default
    averages over every position, padding included)."""
    return keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="mean_with_sample_weight"
    )


def assert_frozen_and_trained(model, initial):
    """The frozen weights (LoRA's merged kernels, embeddings, layer norms) are
    the initial ones exactly; every trainable one moved."""
    trainable = {id(v) for v in model.trainable_variables}
    for variable, before in zip(model.weights, initial):
        after = keras.ops.convert_to_numpy(variable)
        if id(variable) in trainable:
            assert not np.array_equal(after, before), variable.path
        else:
            np.testing.assert_array_equal(after, before, err_msg=variable.path)


def test_lora_leaves_few_trainable_weights():
    # enable_lora trains the query/value LoRA factors and those layers' biases.
    model = causal_lm()
    names = {v.path.split("/")[-1] for v in model.trainable_variables}
    assert names == {"lora_kernel_a", "lora_kernel_b", "bias"}
    assert len(model.trainable_variables) == 12 < len(model.weights)


def test_gradient_accumulation_equals_the_big_batch():
    steps = 4
    data = token_data(2 * steps * MICRO)  # two windows
    accumulated = causal_lm()
    initial = numpy(accumulated.weights)
    accumulated.compile(optimizer=ka.GradientAccumulation(keras.optimizers.Adam(LR), steps=steps))
    fit(accumulated, data)
    big = causal_lm()
    big.compile(optimizer=keras.optimizers.Adam(LR))
    fit(big, data, batch_size=steps * MICRO)

    assert int(accumulated.optimizer.iterations) == int(big.optimizer.iterations) == 2
    assert int(accumulated.optimizer.micro_step) == 2 * steps
    for a, b, variable in zip(numpy(accumulated.weights), numpy(big.weights), big.weights):
        np.testing.assert_allclose(a, b, rtol=0, atol=ATOL, err_msg=variable.path)
    assert_frozen_and_trained(accumulated, initial)


def test_token_weighted_windows_equal_the_big_batch():
    """Padded sequences: 23 to 48 tokens per micro-batch. With a token-mean
    loss and `weigh_micro_batches`, the window is the big batch's token mean;
    averaging micro-batches equally would be off by ~0.02 here."""
    steps = 4
    data = token_data(2 * steps * MICRO, padded=True)
    tokens = data[2].reshape(-1, MICRO * LENGTH).sum(axis=1)
    assert tokens.min() < 0.6 * tokens.max()  # unequal enough to tell
    accumulated = causal_lm()
    accumulated.compile(
        optimizer=ka.GradientAccumulation(keras.optimizers.Adam(LR), steps=steps),
        loss=token_mean(),
    )
    ka.weigh_micro_batches(accumulated)
    fit(accumulated, data)
    big = causal_lm()
    big.compile(optimizer=keras.optimizers.Adam(LR), loss=token_mean())
    fit(big, data, batch_size=steps * MICRO)

    assert int(accumulated.optimizer.iterations) == 2
    for a, b, variable in zip(numpy(accumulated.weights), numpy(big.weights), big.weights):
        np.testing.assert_allclose(a, b, rtol=0, atol=ATOL, err_msg=variable.path)


@pytest.mark.parametrize("optimizer", ["UpdateAccumulationAdam", "InvariantAdam"])
def test_adam_variants_train(optimizer):
    steps, micro_steps = 3, 6
    model = causal_lm()
    initial = numpy(model.weights)
    model.compile(optimizer=getattr(ka, optimizer)(LR, steps=steps))
    history = fit(model, token_data(micro_steps * MICRO))

    assert np.all(np.isfinite(history.history["loss"]))
    assert int(model.optimizer.micro_step) == micro_steps
    assert int(model.optimizer.iterations) == micro_steps // steps
    assert_frozen_and_trained(model, initial)


# -- saving across a restart ------------------------------------------------------
# Keras saves a LoRA-enabled layer with its factors merged into the kernel
# (`save_weights`, `.keras` files and `BackupAndRestore` alike), and loading
# zeroes both factors: training resumed from such a file starts LoRA afresh.
# So the state goes to a file of arrays: every variable of the model and of
# its optimizer, restored into objects built and compiled as the saved ones.


def save_training_state(model, path):
    variables = model.variables + model.optimizer.variables
    np.savez(path + ".tmp.npz", *numpy(variables))
    os.replace(path + ".tmp.npz", path)  # a kill mid-write keeps the last file


def restore_training_state(model, path):
    model.optimizer.build(model.trainable_variables)
    variables = model.variables + model.optimizer.variables
    with np.load(path) as saved:
        if len(saved.files) != len(variables):
            raise ValueError(
                f"{path} holds {len(saved.files)} arrays, the model and its optimizer "
                f"{len(variables)} variables: build and compile it as it was saved. "
                f"Received: model={model.name!r}"
            )
        for i, variable in enumerate(variables):
            variable.assign(saved[f"arr_{i}"])


class SaveTrainingState(keras.callbacks.Callback):
    """Saves the state once, after micro-batch `at`, in the middle of `fit`
    (under JAX, `self.model` syncs the state `fit` holds)."""

    def __init__(self, path, at):
        super().__init__()
        self.path, self.at = path, at

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.micro_step) == self.at:
            save_training_state(self.model, self.path)


def test_restart_mid_window_continues_the_run_exactly(tmp_path):
    """A fit of 6 micro-batches in windows of 3 saves after micro-batch 5
    (two accumulated) from a callback. Restored into new objects and fed
    micro-batch 6, the run ends with weights and optimizer state those of the
    uninterrupted fit, dropout masks included where they resume
    (`DROPOUT_RESUMES`)."""

    def compiled():
        model = causal_lm(dropout=0.1 if DROPOUT_RESUMES else 0.0)
        model.compile(
            optimizer=ka.GradientAccumulation(keras.optimizers.Adam(LR), steps=3),
            loss=token_mean(),
        )
        return ka.weigh_micro_batches(model)

    data = token_data(6 * MICRO, padded=True)
    path = os.path.join(tmp_path, "state.npz")
    run = compiled()
    fit(run, data, callbacks=[SaveTrainingState(path, at=5)])

    resumed = compiled()
    restore_training_state(resumed, path)
    assert int(resumed.optimizer.micro_step) == 5
    assert int(resumed.optimizer.iterations) == 1
    fit(resumed, rows(data, 5, 6))

    assert int(resumed.optimizer.iterations) == int(run.optimizer.iterations) == 2
    for a, b, variable in zip(numpy(resumed.variables), numpy(run.variables), run.variables):
        np.testing.assert_array_equal(a, b, err_msg=variable.path)
    for a, b, variable in zip(
        numpy(resumed.optimizer.variables),
        numpy(run.optimizer.variables),
        run.optimizer.variables,
    ):
        np.testing.assert_array_equal(a, b, err_msg=variable.path)


def test_full_fine_tune_resumes_with_backup_and_restore(tmp_path):
    """Without LoRA, Keras's own files keep the window: `BackupAndRestore`
    backs up at the end of epoch 1 (3 micro-batches in windows of 2, one
    held); a fit stopped as epoch 2 begins and started again with new objects
    ends as the uninterrupted one."""

    def compiled():
        model = causal_lm(lora=False)
        model.compile(optimizer=ka.GradientAccumulation(keras.optimizers.Adam(LR), steps=2))
        return model

    class Stop(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("stopped")

    data = token_data(3 * MICRO)
    run = compiled()
    fit(run, data, epochs=2)
    backup = os.path.join(tmp_path, "backup")
    stopped = compiled()
    with pytest.raises(RuntimeError, match="stopped"):
        fit(stopped, data, epochs=2, callbacks=[keras.callbacks.BackupAndRestore(backup), Stop()])
    assert int(stopped.optimizer.micro_step) == 3
    resumed = compiled()
    fit(resumed, data, epochs=2, callbacks=[keras.callbacks.BackupAndRestore(backup)])

    assert int(resumed.optimizer.micro_step) == 6
    assert int(resumed.optimizer.iterations) == int(run.optimizer.iterations) == 3
    for a, b, variable in zip(numpy(resumed.weights), numpy(run.weights), run.weights):
        np.testing.assert_array_equal(a, b, err_msg=variable.path)
    for a, b, variable in zip(
        numpy(resumed.optimizer.variables),
        numpy(run.optimizer.variables),
        run.optimizer.variables,
    ):
        np.testing.assert_array_equal(a, b, err_msg=variable.path)


def test_restore_refuses_another_model(tmp_path):
    saved = causal_lm()
    saved.compile(optimizer=ka.GradientAccumulation(keras.optimizers.Adam(LR), steps=3))
    saved.optimizer.build(saved.trainable_variables)
    path = os.path.join(tmp_path, "state.npz")
    save_training_state(saved, path)
    other = causal_lm(lora=False)  # every weight trainable: more optimizer state
    other.compile(optimizer=ka.GradientAccumulation(keras.optimizers.Adam(LR), steps=3))
    with pytest.raises(ValueError, match="build and compile it as it was saved"):
        restore_training_state(other, path)


def lora_layers(model):
    return [x for x in model.backbone._flatten_layers() if getattr(x, "lora_enabled", False)]


def test_keras_weight_files_merge_the_lora_factors(tmp_path):
    """Why the state is not saved with `save_weights` (nor `.keras` files nor
    `BackupAndRestore`, which call the same code): the loaded kernel is the
    merged one and both factors are zero."""
    model = causal_lm()
    layer = lora_layers(model)[0]
    rng = np.random.default_rng(1)
    layer.lora_kernel_b.assign(rng.normal(size=layer.lora_kernel_b.shape).astype("float32"))
    merged = keras.ops.convert_to_numpy(layer.kernel)
    path = os.path.join(tmp_path, "m.weights.h5")
    model.save_weights(path)

    loaded = causal_lm()
    loaded.load_weights(path)
    again = lora_layers(loaded)[0]
    assert not np.all(keras.ops.convert_to_numpy(layer.lora_kernel_a) == 0)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(again.lora_kernel_a), 0)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(again.lora_kernel_b), 0)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(again.kernel), merged, atol=1e-6)


def test_load_model_gives_keras_hubs_default_optimizer(tmp_path):
    """keras-hub's `Task.compile` override makes `load_model` skip the saved
    compile: the task comes back with keras-hub's default Adam(2e-5), not the
    optimizer it was compiled with (and LoRA is not enabled either)."""
    model = causal_lm()
    model.compile(optimizer=ka.GradientAccumulation(keras.optimizers.Adam(LR), steps=3))
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    with pytest.warns(UserWarning, match="compile"):
        loaded = keras.saving.load_model(path)
    assert isinstance(loaded.optimizer, keras.optimizers.Adam)
    assert not isinstance(loaded.optimizer, ka.GradientAccumulation)
    assert float(keras.ops.convert_to_numpy(loaded.optimizer.learning_rate)) == pytest.approx(2e-5)
    assert len(loaded.trainable_variables) > len(model.trainable_variables)
