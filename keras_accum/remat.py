"""Rematerialization (gradient checkpointing) of a built model: `rematerialize`.

Accumulation makes the batch independent of memory down to one micro-batch,
activations included. Rematerialization lowers that floor: each layer keeps
its input for the backward pass and recomputes everything else it computed
(Chen et al. 2016, arXiv:1604.06174), for about one more forward pass.

Modes (`MODES`):

* "none": every activation is kept (Keras's default).
* "full": every layer of the model is recomputed in the backward pass.
* "larger_than": only layers whose output has more than
  `output_size_threshold` elements per item (Keras's default, 1024) are.

`rematerialize(model, mode)` gives each layer of a built model the mode
`keras.RematScope(mode)` would have given it at construction, so a model
from any builder, `keras.models.load_model` or a resumed run can be
rematerialized, and the model's variables, their names and its saved files
are those of the same model without it. The outermost model is not wrapped
(recomputing the whole forward pass once more would save nothing beyond
the per-layer recomputation); a nested model counts as its layers. An
`Embedding` is never wrapped: its gradient is sparse (`tf.IndexedSlices`,
one row per token seen), `tf.recompute_grad` would return it dense (every
row, and Adam would then move rows no token touched), and a lookup keeps
nothing that recomputing it would free. Nor is a layer that draws random
numbers (Dropout with rate > 0, or a layer holding one): its recomputation
would draw new ones.

On the TensorFlow backend Keras's remat is `tf.recompute_grad`, which in a
`tf.function` refuses keyword arguments, and Keras calls every layer with
`training=...`: a model built under `keras.RematScope` cannot train in
graph mode or under XLA (keras-team/keras#21207). `rematerialize` installs
a fix: the tensors among the call's arguments are passed positionally to
`tf.recompute_grad` and the other keyword arguments are bound around it.
It changes only layers with a remat mode.

The mode is read when a step is traced: set it before the first `fit` or
`Trainer` step. What it saves and costs is measured in BENCHMARKS.md
("Rematerialization"); the README's "When one example does not fit" sums
it up.

Example:

    model = build_model(...)
    keras_accum.remat.rematerialize(model, "full")
    model.compile(optimizer=keras_accum.InvariantAdam(steps=8), loss=...)
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from keras_accum.validation import check_choice

MODES = ("none", "full", "larger_than")


def check_mode(mode: str) -> str:
    """`mode` if it is one of `MODES`, else a one-line ValueError."""
    return check_choice("remat", mode, MODES)


def rematerialize(model: keras.Model, mode: str, output_size_threshold: int = 1024):
    """Sets the rematerialization mode of every layer of `model`; returns it.

    Args:
        model: a Keras model; its own call is not wrapped.
        mode: one of `MODES`; "none" removes any mode set before.
        output_size_threshold: elements per item above which "larger_than"
            recomputes a layer. Decided here from each layer's output shape
            in the model's graph (a layer without one, e.g. in a subclassed
            model, counts as large): Keras's own "larger_than" asks each
            layer for its output spec on every call, which fails for some
            layers on graph tensors.
    """
    check_mode(mode)
    full = None
    if mode != "none":
        _install_keyword_fix()
        full = _remat_mode("full")
    for layer in _layers(model):
        large = mode == "full" or _output_size(layer) > output_size_threshold
        layer._remat_mode = full if large else None
    return model


def mode_of(model: keras.Model) -> str:
    """The mode of `model`'s layers: "none" (none wrapped), "full" (every
    layer `rematerialize` wraps) or "larger_than" (some)."""
    wrapped = [layer._remat_mode is not None for layer in _layers(model)]
    if not any(wrapped):
        return "none"
    return "full" if all(wrapped) else "larger_than"


def _output_size(layer):
    """Elements per item of `layer`'s output in the model's graph (inf if
    it has no single known output)."""
    try:
        outputs = keras.tree.flatten(layer.output)
    except (AttributeError, ValueError):
        return math.inf
    return sum(math.prod(d or 1 for d in x.shape[1:]) for x in outputs)


def _layers(model):
    """The layers of `model`, a nested model replaced by its layers."""
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            yield from _layers(layer)
        elif not isinstance(layer, (keras.layers.Embedding, keras.layers.InputLayer)):
            if not _draws_random_numbers(layer):
                yield layer


def _draws_random_numbers(layer):
    """True if `layer` or a layer inside it holds a SeedGenerator (Dropout
    with rate > 0, GaussianNoise, ...): a recomputation would draw new
    numbers, and the gradient would not be that of the forward pass."""
    return any(getattr(inner, "_seed_generators", None) for inner in layer._flatten_layers())


def _remat_mode(mode):
    """The RematMode Keras gives a layer built inside `RematScope(mode)`."""
    from keras.src.backend.common.remat import get_current_remat_mode

    with keras.RematScope(mode=mode):
        return get_current_remat_mode()


def recompute_grad(f):
    """`tf.recompute_grad(f)` that accepts keyword arguments in graph mode.

    The tensors among the arguments (positional or keyword, nested or not)
    are passed to `tf.recompute_grad` positionally, so gradients reach all
    of them; the other arguments (`training=True`, `use_causal_mask=True`)
    are bound around it; the recomputation runs in the mixed-precision
    autocast scope of the call.
    """

    from keras.src.backend import AutocastScope, get_autocast_scope

    def call(*args, **kwargs):
        flat = tf.nest.flatten((args, kwargs))
        where = [i for i, value in enumerate(flat) if tf.is_tensor(value)]
        # Mixed precision: the layer's call casts its variables in the scope
        # its __call__ opened; the backward pass recomputes outside it.
        autocast = get_autocast_scope()

        def positional(*tensors):
            values = list(flat)
            for i, tensor in zip(where, tensors):
                values[i] = tensor
            inner_args, inner_kwargs = tf.nest.pack_sequence_as((args, kwargs), values)
            if autocast is None:
                return f(*inner_args, **inner_kwargs)
            with AutocastScope(autocast.dtype):
                return f(*inner_args, **inner_kwargs)

        return tf.recompute_grad(positional)(*(flat[i] for i in where))

    return call


def _install_keyword_fix():
    """Keras's TensorFlow remat becomes `recompute_grad` above (idempotent)."""
    from keras.src.backend.tensorflow import core

    core.remat = recompute_grad
