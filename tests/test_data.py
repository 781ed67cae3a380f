"""keras_accum.experiments.data: offline MNIST-1D, fail-fast TFDS, synthetic tokens."""

import os
import pathlib
import random
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
from tensorflow_datasets.image_classification import mnist

from keras_accum.experiments import data, experiment


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tfds")
    data.builder("mnist1d", data_dir=path)  # Prepared once for this module.
    return path


def _arrays(ds):
    xs, ys = zip(*ds.as_numpy_iterator())
    return np.stack(xs), np.array(ys)


def test_mnist1d_is_the_package_output(data_dir):
    expected = data.make_mnist1d()
    for split, key in [("train", "x"), ("test", "x_test")]:
        x, y = _arrays(data.load("mnist1d", split, data_dir=data_dir))
        assert x.dtype == np.float32 and y.dtype == np.int32
        assert x.shape == (len(expected[key]), 40)
        np.testing.assert_array_equal(x, expected[key].astype(np.float32))
        np.testing.assert_array_equal(y, expected["y" + key[1:]])
    info = data.dataset_info("mnist1d", data_dir=data_dir)
    assert info == data.DatasetInfo((40,), 10, 4000, 1000)


def test_mnist1d_is_not_regenerated(data_dir, monkeypatch):
    def fail():
        raise AssertionError("regenerated")

    monkeypatch.setattr(data, "make_mnist1d", fail)
    assert data.builder("mnist1d", data_dir=data_dir).is_prepared()


def test_mnist1d_prepared_by_two_processes_at_once(tmp_path):
    # Workers of one job share a data_dir; TFDS deletes other processes'
    # incomplete folders, so unguarded they fail (seen with 2 workers).
    code = (
        "import sys; from keras_accum.experiments import data, experiment; "
        "b = data.builder('mnist1d', data_dir=sys.argv[1]); "
        "print(b.info.splits['train'].num_examples)"
    )
    env = dict(
        os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(pathlib.Path(data.__file__).parents[1])
    )
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    for worker in workers:
        out, err = worker.communicate(timeout=180)
        assert worker.returncode == 0, err[-2000:]
        assert out.strip().splitlines()[-1] == "4000"


def test_make_mnist1d_leaves_global_rngs_alone():
    random.seed(1), np.random.seed(1)
    data.make_mnist1d()
    after = random.random(), np.random.rand()
    random.seed(1), np.random.seed(1)
    assert after == (random.random(), np.random.rand())


def test_preparing_mnist1d_leaves_global_rngs_alone(tmp_path):
    # TFDS names its temporary folders with `random`, which also seeds
    # Keras's global SeedGenerator (initial weights): a fresh data_dir must
    # not shift any of them.
    def draws():
        return random.random(), np.random.rand(), float(keras.random.uniform(()))

    keras.utils.set_random_seed(3)
    expected = draws()
    keras.utils.set_random_seed(3)
    data.builder("mnist1d", data_dir=tmp_path)  # Prepares: the folder is new.
    assert draws() == expected


def test_validation_split_is_carved_from_train(data_dir):
    x_train, y_train = _arrays(data.load("mnist1d", "train", data_dir=data_dir))
    kwargs = dict(data_dir=data_dir, validation_examples=400)
    x_val, y_val = _arrays(data.load("mnist1d", "validation", **kwargs))
    x_rest, y_rest = _arrays(data.load("mnist1d", "train", **kwargs))
    np.testing.assert_array_equal(np.concatenate([x_val, x_rest]), x_train)
    np.testing.assert_array_equal(np.concatenate([y_val, y_rest]), y_train)
    assert len(x_val) == 400
    x_test, _ = _arrays(data.load("mnist1d", "test", **kwargs))
    assert len(x_test) == 1000


def test_missing_dataset_fails_fast(tmp_path):
    start = time.monotonic()
    with pytest.raises(FileNotFoundError, match="'mnist'.*tfds build mnist"):
        data.load("mnist", "train", data_dir=tmp_path)
    assert time.monotonic() - start < 30  # Loose: tfds.load retries minutes.


class FakeMnist(mnist.MNIST, skip_registration=True):
    """The real MNIST on-disk format with 6 made-up images, written offline."""

    name = "mnist"
    code_path = tfds.core.Path(__file__)  # See Mnist1d.code_path.

    def _split_generators(self, dl_manager):
        images = np.zeros((6, 28, 28, 1), np.uint8)
        images[:, 0, 0] = 255
        return {s: self._generate_examples(images) for s in ("train", "test")}

    def _generate_examples(self, images):
        for i, image in enumerate(images):
            yield i, {"image": image, "label": i}


def test_prepared_tfds_dataset_is_read_and_scaled(tmp_path):
    FakeMnist(data_dir=tmp_path).download_and_prepare()
    ds = data.load("mnist", "train", data_dir=tmp_path, batch_size=4)
    x, y = next(iter(ds))
    assert x.dtype == tf.float32 and y.dtype == tf.int32
    assert x.shape == (4, 28, 28, 1)
    assert float(tf.reduce_max(x)) == 1.0 and float(tf.reduce_min(x)) == 0.0
    assert data.dataset_info("mnist", data_dir=tmp_path) == data.DatasetInfo((28, 28, 1), 10, 6, 6)


def test_shuffle_is_reproducible(data_dir):
    def first_labels(seed):
        ds = data.load("mnist1d", "train", data_dir=data_dir, batch_size=64, shuffle_seed=seed)
        return next(iter(ds))[1].numpy()

    np.testing.assert_array_equal(first_labels(3), first_labels(3))
    assert not np.array_equal(first_labels(3), first_labels(4))


def test_synthetic_tokens_are_deterministic():
    x, y = data.make_synthetic_tokens("train")
    x2, y2 = data.make_synthetic_tokens("train")
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    other_seed, _ = data.make_synthetic_tokens("train", seed=1)
    assert not np.array_equal(x, other_seed)
    # Label = most frequent token, the lowest on ties.
    row = x[0]
    counts = [np.sum(row == t) for t in range(data.TOKENS_VOCAB)]
    assert y[0] == counts.index(max(counts))

    info = data.dataset_info(data.SYNTHETIC_TOKENS)
    tokens, labels = next(iter(data.load(data.SYNTHETIC_TOKENS, "test", batch_size=8)))
    assert tokens.dtype == tf.int32 and labels.dtype == tf.int32
    assert tokens.shape == (8,) + info.input_shape
    assert int(tf.reduce_max(tokens)) < info.vocab_size


@pytest.mark.parametrize("start_batch", [0, 3, 5])
def test_training_stream_ignores_other_iterators(start_batch, monkeypatch):
    # model.fit under a distribution strategy opens an iterator to peek at
    # one batch before training. Each iterator must still replay the seeded
    # order from the start, or a resumed run (which skips more batches in
    # its peek) trains on a later reshuffle than the uninterrupted one.
    monkeypatch.setattr(experiment.data, "load", lambda *a, **k: tf.data.Dataset.range(12))
    config = {"dataset": "mnist1d", "data_dir": None, "seed": 3}
    keras.utils.set_random_seed(3)
    order = experiment.training_stream(config, 4, 0).take(start_batch + 9)
    expected = np.concatenate(list(order.as_numpy_iterator())[start_batch:])
    stream = experiment.training_stream(config, 4, start_batch)
    next(iter(stream))  # the peek
    got = np.concatenate(list(stream.take(9).as_numpy_iterator()))
    np.testing.assert_array_equal(got, expected)
    # Three passes over 12 examples: each pass is a permutation.
    assert sorted(np.concatenate(list(order.as_numpy_iterator()))[:12]) == list(range(12))
