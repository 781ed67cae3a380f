"""`AccumulationLogger` puts updates, examples (tokens under
`weigh_micro_batches`), the window size in force and the last window's
mean loss into `fit`'s logs, on every backend: read back from the file
`CSVLogger` writes (as Keras's own CSVLogger test reads its file back with
`csv.DictReader`), against the optimizer's counters and a numpy reference
of each micro-batch's loss."""

import csv

import keras
import numpy as np
import pytest

import keras_accum as ka

rng = np.random.default_rng(0)
X = rng.normal(size=(40, 3)).astype("float32")
Y = rng.normal(size=(40, 1)).astype("float32")
MICRO = 8  # 5 micro-batches an epoch


class WeightsBeforeEachBatch(keras.callbacks.Callback):
    """The model's weights as each micro-batch starts (the reference's)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_begin(self, batch, logs=None):
        self.seen.append(self.model.get_weights())


def rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.filterwarnings("ignore:.*training ended inside a window:UserWarning")
def test_csv_rows_hold_the_counts_and_the_window_mean_loss(tmp_path):
    # Windows of 1, 1, then 3 micro-batches: epoch 1 ends on an update
    # (micro-batches 1 | 2 | 3-5), epoch 2 inside a window (6-8 | 9-10).
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    optimizer = ka.InvariantAdam(1e-2, steps=ka.PiecewiseSteps([2], [1, 3]))
    model.compile(optimizer=optimizer, loss="mse")
    weights = WeightsBeforeEachBatch()
    path = tmp_path / "log.csv"
    logger, csv_logger = ka.AccumulationLogger(), keras.callbacks.CSVLogger(str(path))
    history = model.fit(
        X, Y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0,
        callbacks=[weights, logger, csv_logger],
    )  # fmt: skip
    # Each micro-batch's mse at the weights it started from, in numpy.
    losses = []
    for i, (kernel, bias) in enumerate(weights.seen):
        lo = (i % 5) * MICRO
        pred = X[lo : lo + MICRO].astype("float64") @ kernel + bias
        losses.append(float(np.mean((pred - Y[lo : lo + MICRO]) ** 2)))
    last_window = {0: np.mean(losses[2:5]), 1: np.mean(losses[5:8])}
    read = rows(path)
    assert [int(r["epoch"]) for r in read] == [0, 1]
    for epoch, row in enumerate(read):
        assert float(row["updates"]) == [3, 4][epoch]
        assert float(row["examples"]) == [40, 80][epoch]
        assert float(row["window_steps"]) == 3
        np.testing.assert_allclose(float(row["window_loss"]), last_window[epoch], rtol=1e-5)
        assert "tokens" not in row  # only under weigh_micro_batches
    assert history.history["updates"] == [3.0, 4.0]
    assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == 4


def test_tokens_under_weigh_micro_batches_are_the_loss_denominators(tmp_path):
    """A token-mean loss (`mean_with_sample_weight`): the items a window is
    weighed by are the sample weights' sum, 0 for a padding-only
    micro-batch; the examples are still every row trained."""
    sample_weight = np.ones(40, "float32")
    sample_weight[8:16] = 0.0  # micro-batch 2 weighs nothing
    sample_weight[30:33] = 0.5
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    optimizer = ka.GradientAccumulation(keras.optimizers.SGD(0.1), steps=5)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"),
    )
    ka.weigh_micro_batches(model)
    path = tmp_path / "log.csv"
    model.fit(
        X, Y, sample_weight=sample_weight, batch_size=MICRO, epochs=2, shuffle=False,
        verbose=0, callbacks=[ka.AccumulationLogger(), keras.callbacks.CSVLogger(str(path))],
    )  # fmt: skip
    read = rows(path)
    per_epoch = float(sample_weight.sum())  # 30.5
    assert [float(r["tokens"]) for r in read] == [per_epoch, 2 * per_epoch]
    assert [float(r["examples"]) for r in read] == [40.0, 80.0]
    assert [float(r["updates"]) for r in read] == [1.0, 2.0]


def test_the_progress_bar_shows_the_counts(capsys):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=ka.UpdateAccumulationAdam(steps=5), loss="mse")
    model.fit(X, Y, batch_size=MICRO, callbacks=[ka.AccumulationLogger()], verbose=2)
    out = capsys.readouterr().out
    for key in ("updates: 1", "examples: 40", "window_steps: 5", "window_loss: "):
        assert key in out, out


def test_a_keras_optimizer_is_refused_in_one_line():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError) as caught:
        model.fit(X, Y, batch_size=MICRO, callbacks=[ka.AccumulationLogger()], verbose=0)
    assert "\n" not in str(caught.value)
    assert str(caught.value).endswith("Received: optimizer=SGD")


def test_reused_across_fits_with_an_appending_csv_logger(tmp_path):
    """Ported from Keras's `csv_logger_test.test_CSVLogger` (cases 2 and 3:
    a tab-separated file appended to, the callback objects reused by a
    second `fit`, validation data): one header, every row as wide, and the
    counts go on across the two runs (10 examples an epoch in batches of
    4, 4 and 2: one window of 3)."""
    path = str(tmp_path / "log.tsv")
    rng = np.random.default_rng(1337)
    x, y = rng.random((10, 3)), rng.random((10, 1))
    x_val, y_val = rng.random((10, 3)), rng.random((10, 1))
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(2, "relu"), keras.layers.Dense(1)]
    )
    model.compile(optimizer=ka.InvariantAdam(steps=3), loss="mse", metrics=["mse"])
    cbks = [ka.AccumulationLogger(), keras.callbacks.CSVLogger(path, separator="\t", append=True)]
    for epochs in (1, 2):
        model.fit(
            x, y, batch_size=4, validation_data=(x_val, y_val), callbacks=cbks, epochs=epochs,
            verbose=0,
        )  # fmt: skip
    with open(path) as f:
        lines = f.readlines()
    assert len(lines) == 4 and sum("epoch" in line for line in lines) == 1
    assert len({line.count("\t") for line in lines}) == 1
    with open(path) as f:
        read = list(csv.DictReader(f, delimiter="\t"))
    assert [float(r["examples"]) for r in read] == [10.0, 20.0, 30.0]
    assert [float(r["updates"]) for r in read] == [1.0, 2.0, 3.0]
    assert all(r["val_loss"] != "NA" for r in read)
