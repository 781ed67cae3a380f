"""A small character-level language model on a corpus the project generates.

* `make_corpus(seed)`: deterministic English-like text from a small
  probabilistic grammar (subject-verb-object sentences with number
  agreement, adjectives, clauses and counting), written with a seeded numpy
  generator: no download, the same characters on every machine.
* `CharCorpus`: the corpus as a TFDS dataset (`char_corpus`), sequences of
  `SEQ_LEN` characters as features and the next characters as labels,
  prepared on demand in a second, like MNIST-1D.
* `build_lm(...)`: a decoder-only transformer (causal self-attention,
  learned positions, pre-norm blocks), logits for every position.

Example:

    x, y = load_arrays("train", data_dir="/tmp/tfds")   # int32 [n, 64] each
    model = build_lm(VOCAB_SIZE, SEQ_LEN)
"""

import numpy as np
import tensorflow_datasets as tfds

SEQ_LEN = 64
ALPHABET = " .,abcdefghijklmnopqrstuvwxyz"
VOCAB_SIZE = len(ALPHABET)
SEQUENCES = {"train": 4096, "test": 512}

_NOUNS = [
    ("cat", "cats"),
    ("dog", "dogs"),
    ("bird", "birds"),
    ("child", "children"),
    ("farmer", "farmers"),
    ("teacher", "teachers"),
    ("river", "rivers"),
    ("king", "kings"),
    ("robot", "robots"),
    ("fox", "foxes"),
]
_VERBS = [
    ("sees", "see"),
    ("likes", "like"),
    ("finds", "find"),
    ("follows", "follow"),
    ("watches", "watch"),
    ("helps", "help"),
    ("carries", "carry"),
]
_ADJECTIVES = ["big", "small", "red", "old", "quick", "quiet", "happy", "green"]
_NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def _noun_phrase(rng):
    """(phrase, plural): e.g. 'the quick fox' or 'three old dogs'."""
    noun = _NOUNS[rng.integers(len(_NOUNS))]
    plural = rng.random() < 0.4
    words = []
    if plural and rng.random() < 0.5:
        words.append(_NUMBERS[rng.integers(1, len(_NUMBERS))])
    else:
        words.append("the" if rng.random() < 0.7 else ("some" if plural else "a"))
    if rng.random() < 0.5:
        words.append(_ADJECTIVES[rng.integers(len(_ADJECTIVES))])
    words.append(noun[1] if plural else noun[0])
    return " ".join(words), plural


def _sentence(rng):
    subject, plural = _noun_phrase(rng)
    verb = _VERBS[rng.integers(len(_VERBS))][1 if plural else 0]
    obj, _ = _noun_phrase(rng)
    sentence = f"{subject} {verb} {obj}"
    if rng.random() < 0.3:
        clause_subject, clause_plural = _noun_phrase(rng)
        clause_verb = _VERBS[rng.integers(len(_VERBS))][1 if clause_plural else 0]
        sentence += f", and {clause_subject} {clause_verb} it"
    if rng.random() < 0.15:
        start = rng.integers(len(_NUMBERS) - 3)
        sentence += ", " + " ".join(_NUMBERS[start : start + 3])
    return sentence + ". "


def make_corpus(characters, seed=0):
    """At least `characters` characters of generated text (all in ALPHABET)."""
    rng = np.random.default_rng([seed, 7])
    parts, length = [], 0
    while length < characters:
        parts.append(_sentence(rng))
        length += len(parts[-1])
    return "".join(parts)


def encode(text):
    lookup = {c: i for i, c in enumerate(ALPHABET)}
    return np.array([lookup[c] for c in text], dtype=np.int32)


def make_sequences(split):
    """(x, y) int32 [n, SEQ_LEN]: consecutive windows of the split's own
    corpus (train and test from different seeds); y is x shifted by one."""
    n = SEQUENCES[split]
    ids = encode(make_corpus(n * (SEQ_LEN + 1), seed=("train", "test").index(split)))
    windows = ids[: n * (SEQ_LEN + 1)].reshape(n, SEQ_LEN + 1)
    return windows[:, :-1], windows[:, 1:]


class CharCorpus(tfds.core.GeneratorBasedBuilder):
    """The generated character corpus: `x` = SEQ_LEN characters, `y` = the
    next character at each position."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Seeded grammar, 4096 train / 512 test sequences of 64."}
    code_path = tfds.core.Path(__file__)  # PITFALLS 14, as for Mnist1d

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            description="Generated English-like sentences, character level.",
            features=tfds.features.FeaturesDict(
                {
                    "x": tfds.features.Tensor(shape=(SEQ_LEN,), dtype=np.int32),
                    "y": tfds.features.Tensor(shape=(SEQ_LEN,), dtype=np.int32),
                }
            ),
            supervised_keys=("x", "y"),
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # Nothing to download.
        return {split: self._generate_examples(*make_sequences(split)) for split in SEQUENCES}

    def _generate_examples(self, xs, ys):
        for i, (x, y) in enumerate(zip(xs, ys)):
            yield i, {"x": x, "y": y}


def load_arrays(split, data_dir=None):
    """The split as numpy (x, y), preparing the TFDS dataset if needed."""
    builder = tfds.builder(CharCorpus.name, data_dir=data_dir)
    if not builder.is_prepared():
        config = tfds.download.DownloadConfig(try_download_gcs=False)
        builder.download_and_prepare(download_config=config)
    data = tfds.as_numpy(builder.as_dataset(split=split, batch_size=-1, as_supervised=True))
    return data[0].astype(np.int32), data[1].astype(np.int32)


def build_lm(vocab_size=VOCAB_SIZE, seq_len=SEQ_LEN, dim=32, heads=2, blocks=2, mlp_dim=64):
    """Decoder-only transformer: logits [batch, seq_len, vocab_size]."""
    import keras
    from keras import layers

    from keras_accum.experiments.models import PositionEmbedding

    tokens = keras.Input((seq_len,), dtype="int32")
    x = layers.Embedding(vocab_size, dim)(tokens)
    x = PositionEmbedding()(x)
    for _ in range(blocks):
        h = layers.LayerNormalization()(x)
        h = layers.MultiHeadAttention(heads, dim // heads)(h, h, use_causal_mask=True)
        x = x + h
        h = layers.LayerNormalization()(x)
        h = layers.Dense(mlp_dim, activation="gelu")(h)
        x = x + layers.Dense(dim)(h)
    x = layers.LayerNormalization()(x)
    return keras.Model(tokens, layers.Dense(vocab_size)(x), name="char_lm")
