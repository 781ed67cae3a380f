"""The models the benchmark trains, built from `experiments.models`.

A workload is a model of the registry (`build_model(name, ...)` with fixed
keyword arguments), its input and its random data. The sizes are chosen so
that the optimizer's passes over the parameters are not negligible next to
forward/backward on a CPU at b = 32 (the MLP), or to cover the kinds of
gradient a user meets: convolutions (the CNN), attention and an
`Embedding`'s sparse `tf.IndexedSlices` gradient (the transformer, and
the `lm`, whose vocabulary of 32,768 puts almost all of its parameters in
the Embedding: each micro-batch touches at most 1,024 of its rows).
"""

import dataclasses

from keras_accum.experiments import models


@dataclasses.dataclass(frozen=True)
class Workload:
    """A registry model with its arguments, full size and quick size.

    vocab_size: None for float inputs; else integer tokens in
    [0, vocab_size), and the builder gets `vocab_size=`.
    """

    name: str
    description: str
    model: str  # name in `experiments.models.MODELS`
    input_shape: tuple
    kwargs: dict
    quick_input_shape: tuple
    quick_kwargs: dict
    num_classes: int = 10

    def shape(self, quick):
        return self.quick_input_shape if quick else self.input_shape

    def _kwargs(self, quick):
        return self.quick_kwargs if quick else self.kwargs

    def build(self, quick=False):
        """An uncompiled `keras.Model` returning logits."""
        return models.build_model(
            self.model, self.shape(quick), self.num_classes, **self._kwargs(quick)
        )

    def data(self, count, quick, rng):
        """`count` random examples: (inputs, integer labels)."""
        shape = (count,) + self.shape(quick)
        vocab = self._kwargs(quick).get("vocab_size")
        if vocab is None:
            x = rng.standard_normal(shape).astype("float32")
        else:
            x = rng.integers(0, vocab, shape).astype("int32")
        return x, rng.integers(0, self.num_classes, count).astype("int32")


WORKLOADS = {
    w.name: w
    for w in (
        Workload(
            "cnn",
            "MNIST-1D CNN (the registry's `cnn`), 5,210 params",
            "cnn",
            (40,),
            {},
            (40,),
            {},
        ),
        Workload(
            "mlp",
            "MLP 1024-2048-1024-10, 4.21M params",
            "mlp",
            (1024,),
            {"hidden": (2048, 1024)},
            (64,),
            {"hidden": (128, 64)},
        ),
        Workload(
            "transformer",
            "Transformer encoder, 2 blocks of width 64, 32 tokens of 256, 86,154 params",
            "transformer",
            (32,),
            {"vocab_size": 256, "dim": 64, "heads": 4, "num_blocks": 2, "mlp_dim": 128},
            (8,),
            {"vocab_size": 16, "dim": 16, "heads": 2, "num_blocks": 1, "mlp_dim": 32},
        ),
        Workload(
            "lm",
            "Transformer encoder with a language model's vocabulary: 1 block of width "
            "128, 32 tokens of 32,768, 4.33M params (4.19M of them in the Embedding)",
            "transformer",
            (32,),
            {"vocab_size": 32768, "dim": 128, "heads": 4, "num_blocks": 1, "mlp_dim": 256},
            (8,),
            {"vocab_size": 64, "dim": 16, "heads": 2, "num_blocks": 1, "mlp_dim": 32},
        ),
    )
}
