"""Datasets as `tf.data` pipelines of (features, label), all offline.

* `mnist1d`: MNIST-1D (Greydanus 2020) generated locally by the `mnist1d`
  package and stored as a TFDS dataset (builder `Mnist1d`), prepared on
  demand in about three seconds. The data are exactly
  `make_dataset(get_dataset_args())`: the package defaults, seed 42,
  4000 train / 1000 test examples.
* `synthetic_tokens`: small integer sequences made with numpy from a seed,
  label = most frequent token; exercises `Embedding` (sparse gradients).
* any other TFDS name (`mnist`, `cifar10`, ...) only if it is already prepared
  in `data_dir`. `tfds.load` of a missing dataset retries downloads for
  minutes before failing, so we check first and fail fast.

Example:

    ds = load("mnist1d", "train", data_dir="/tmp/tfds", batch_size=32,
              shuffle_seed=0)
    meta = dataset_info("mnist1d", data_dir="/tmp/tfds")
"""

import contextlib
import dataclasses
import fcntl
import pathlib
import random

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

SYNTHETIC_TOKENS = "synthetic_tokens"
TOKENS_LEN, TOKENS_VOCAB = 32, 10
TOKENS_EXAMPLES = {"train": 2048, "test": 512}


class Mnist1d(tfds.core.GeneratorBasedBuilder):
    """MNIST-1D, generated offline with `mnist1d.data.make_dataset`.

    Arguments are fixed to `get_dataset_args()` (seed 42, 5000 samples, 80/20
    split): those are the paper's data. `x` is cast from float64 to float32.
    The package's download path (`get_dataset`) is never used.
    """

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "make_dataset(get_dataset_args()) of mnist1d."}
    # TFDS 4.9 finds a builder's file through `importlib_resources`, which it
    # does not install (PITFALLS 14); say where it is instead.
    code_path = tfds.core.Path(__file__)

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            description="MNIST-1D: 1-D signals of the ten digit templates.",
            features=tfds.features.FeaturesDict(
                {
                    "x": tfds.features.Tensor(shape=(40,), dtype=np.float32),
                    "label": tfds.features.ClassLabel(num_classes=10),
                }
            ),
            supervised_keys=("x", "label"),
            disable_shuffling=True,  # Keep the package's example order.
            homepage="https://github.com/greydanus/mnist1d",
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # Nothing to download.
        data = make_mnist1d()
        return {
            "train": self._generate_examples(data["x"], data["y"]),
            "test": self._generate_examples(data["x_test"], data["y_test"]),
        }

    def _generate_examples(self, xs, ys):
        for i, (x, y) in enumerate(zip(xs, ys)):
            yield i, {"x": x.astype(np.float32), "label": int(y)}


@contextlib.contextmanager
def global_rngs_untouched():
    """Restores Python's `random` and `np.random` global states on exit.

    Preparing data must not consume the training run's random stream: the
    mnist1d package reseeds both globally, and TFDS draws its temporary
    folder names from `random` (which also seeds Keras's global
    SeedGenerator, hence the initial weights).
    """
    states = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])


def make_mnist1d():
    """`make_dataset(get_dataset_args())`, leaving the global RNGs as found."""
    from mnist1d.data import get_dataset_args, make_dataset  # Imports pyplot.

    with global_rngs_untouched():
        return make_dataset(get_dataset_args())


def make_synthetic_tokens(split, seed=0):
    """Integer sequences and labels: label = most frequent token (lowest wins).

    Tokens are uniform in [0, TOKENS_VOCAB), so `num_classes == TOKENS_VOCAB`;
    train and test are independent streams derived from `seed`.
    Returns `(tokens int32 [n, TOKENS_LEN], labels int32 [n])`.
    """
    index = ("train", "test").index(split)
    rng = np.random.default_rng([seed, index])
    shape = (TOKENS_EXAMPLES[split], TOKENS_LEN)
    tokens = rng.integers(0, TOKENS_VOCAB, size=shape, dtype=np.int32)
    counts = (tokens[..., None] == np.arange(TOKENS_VOCAB)).sum(axis=1)
    return tokens, counts.argmax(axis=1).astype(np.int32)


def builder(name, data_dir=None):
    """A prepared TFDS builder: `mnist1d` is prepared on demand, others must
    already be on disk (no download is ever attempted)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"`dataset` must be a dataset name. Received: dataset={name!r}")
    try:
        b = tfds.builder(name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError:
        raise ValueError(
            f"`dataset` must be {Mnist1d.name}, {SYNTHETIC_TOKENS} or a TFDS dataset name "
            f"(`tfds build --help`). Received: dataset={name!r}"
        ) from None
    except ValueError as e:  # A malformed name: TFDS explains over many lines.
        first = str(e).splitlines()[0]
        raise ValueError(f"`dataset`: {first} Received: dataset={name!r}") from None
    if b.is_prepared():
        return b
    if name == Mnist1d.name:
        # Workers of one job may prepare into the same folder at once, and
        # TFDS deletes other processes' incomplete folders: take turns.
        root = pathlib.Path(b.data_dir_root)
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f".{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            b = tfds.builder(name, data_dir=data_dir)
            if not b.is_prepared():
                config = tfds.download.DownloadConfig(try_download_gcs=False)
                with global_rngs_untouched():
                    b.download_and_prepare(download_config=config)
        return b
    raise FileNotFoundError(
        f"Dataset {name!r} is not prepared in "
        f"data_dir={str(b.data_dir_root)!r} (looked for {str(b.data_dir)!r}). "
        "We do not call tfds.load, which would retry the download for "
        "minutes on an offline machine. "
        f"Prepare it where there is network with `tfds build {name} "
        f"--data_dir=...` (or tfds.builder({name!r}).download_and_prepare()) "
        "and copy that folder here."
    )


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """What a model and a training loop need to know about a dataset."""

    input_shape: tuple
    num_classes: int
    num_train_examples: int
    num_test_examples: int
    vocab_size: int | None = None  # Token datasets only.


def dataset_info(name, data_dir=None):
    """`DatasetInfo` for `name` (prepares `mnist1d` if needed)."""
    if name == SYNTHETIC_TOKENS:
        n = TOKENS_EXAMPLES
        return DatasetInfo(
            (TOKENS_LEN,), TOKENS_VOCAB, n["train"], n["test"], vocab_size=TOKENS_VOCAB
        )
    info = builder(name, data_dir).info
    x_key, y_key = info.supervised_keys
    return DatasetInfo(
        input_shape=tuple(info.features[x_key].shape),
        num_classes=info.features[y_key].num_classes,
        num_train_examples=info.splits["train"].num_examples,
        num_test_examples=info.splits["test"].num_examples,
    )


def load(
    name,
    split,
    *,
    data_dir=None,
    batch_size=None,
    shuffle_seed=None,
    drop_remainder=False,
    validation_examples=0,
):
    """A `tf.data.Dataset` of (features, label) for `split` of `name`.

    `split` is "train", "test" or "validation". With `validation_examples`
    = n > 0, "validation" is the first n examples of the train split and
    "train" the rest (the test split is never touched); the split does not
    depend on any seed.

    Features: uint8 images become float32 in [0, 1], other floats float32,
    integer tokens int32; labels are int32. Decoded examples are cached in
    memory (the datasets used here are small). With `shuffle_seed`, examples
    are reshuffled every epoch in a reproducible order; with `batch_size`,
    batched. `data_dir=None` is TFDS's default (`$TFDS_DATA_DIR` or
    `~/tensorflow_datasets`).
    """
    source = "test" if split == "test" else "train"
    if split not in ("train", "test", "validation"):
        raise ValueError(
            f"`split` must be one of 'train', 'test', 'validation'. Received: split={split!r}"
        )
    if split == "validation" and validation_examples < 1:
        raise ValueError("split='validation' needs validation_examples >= 1.")
    if name == SYNTHETIC_TOKENS:
        ds = tf.data.Dataset.from_tensor_slices(make_synthetic_tokens(source))
    else:
        b = builder(name, data_dir)
        ds = b.as_dataset(split=source, as_supervised=True, shuffle_files=False)
    if split == "validation":
        ds = ds.take(validation_examples)
    elif split == "train" and validation_examples:
        ds = ds.skip(validation_examples)
    if name != SYNTHETIC_TOKENS:
        ds = ds.cache().map(_convert, num_parallel_calls=tf.data.AUTOTUNE)
    if shuffle_seed is not None:
        ds = ds.shuffle(ds.cardinality(), seed=shuffle_seed, reshuffle_each_iteration=True)
    if batch_size is not None:
        ds = ds.batch(batch_size, drop_remainder=drop_remainder)
    return ds.prefetch(tf.data.AUTOTUNE)


def _convert(x, y):
    if x.dtype == tf.uint8:  # Images: [0, 255] -> [0, 1].
        x = tf.cast(x, tf.float32) / 255.0
    x = tf.cast(x, tf.int32 if x.dtype.is_integer else tf.float32)
    return x, tf.cast(y, tf.int32)
