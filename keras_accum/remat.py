"""Rematerialization (gradient checkpointing) of a built model: `rematerialize`.

Each layer keeps its input for the backward pass and recomputes the rest
(Chen et al. 2016, arXiv:1604.06174), for about one more forward pass.
Modes (`MODES`): "none" keeps every activation (Keras's default); "full"
recomputes every layer it can; "larger_than" only layers whose output has
more than `output_size_threshold` elements per item. Embeddings, layers
that draw random numbers, `BatchNormalization` and layers with an
`activity_regularizer` are never wrapped. See docs/guides/memory.md;
BENCHMARKS.md ("Rematerialization") has the measurements.

Example:

    model = keras_accum.rematerialize(build_model(...), "full")
    model.compile(optimizer=keras_accum.InvariantAdam(steps=8), loss=...)
"""

from __future__ import annotations

import inspect
import math

import keras

from keras_accum import _backend, _compat
from keras_accum._backend import tf
from keras_accum.validation import check_choice

MODES = ("none", "full", "larger_than")
# The first Keras with `keras.remat` (JAX's and PyTorch's recomputation).
KERAS_REMAT = "3.9.0"


def check_mode(mode: str, name: str = "mode") -> str:
    """`mode` if it is one of `MODES`, else a ValueError naming argument `name`."""
    return check_choice(name, mode, MODES)


@keras.saving.register_keras_serializable(package="keras_accum")
class Rematerialized(keras.layers.Wrapper):
    """`layer`, recomputed in the backward pass: only its inputs are kept.

    Calls `layer` (inputs, `training`, masks and mixed precision as without
    the wrapper) through `recompute_grad`; the variables are `layer`'s. In a
    subclassed model, wrap a heavy sublayer where it is defined:

        self.block = keras_accum.remat.Rematerialized(Block(...))

    Build a layer of several inputs (e.g. `MultiHeadAttention`) before
    wrapping it: an unbuilt one is built from the first input shape.

    Args:
        layer: the layer to recompute: not one that draws random numbers
            nor an `Embedding`; one with an `activity_regularizer` is refused.
        **kwargs: `keras.layers.Layer` arguments; `name`, `dtype` and
            `trainable` default to `layer`'s.
    """

    def __init__(self, layer, **kwargs):
        if isinstance(layer, keras.layers.Layer):
            kwargs.setdefault("name", layer.name)
            kwargs.setdefault("dtype", layer.dtype_policy)
            kwargs.setdefault("trainable", layer.trainable)
        _require_recomputation("`Rematerialized`")
        if _adds_activity_loss(layer):
            raise ValueError(
                "`Rematerialized` cannot recompute a layer with an `activity_regularizer` (its "
                "loss would be computed inside the recomputation): leave it unwrapped. "
                f"Received: layer={getattr(layer, 'name', layer)!r}"
            )
        super().__init__(layer, **kwargs)
        self.supports_masking = layer.supports_masking

    def call(self, inputs, *args, training=None, **kwargs):
        kwargs.update(self._masks(inputs, args, kwargs))
        return recompute_grad(self.layer)(inputs, *args, training=training, **kwargs)

    def _masks(self, inputs, args, kwargs):
        """The masks Keras's `__call__` would give `layer` from its inputs',
        passed explicitly: the recomputation's inputs carry none."""
        signature = inspect.signature(self.layer.call)
        try:
            bound = signature.bind(inputs, *args, **kwargs).arguments
        except TypeError:
            return {}
        tensors = {name: value for name, value in bound.items() if _all_tensors(value)}
        if len(tensors) == 1:
            wanted = {"mask": next(iter(tensors.values()))}
        else:
            wanted = {f"{name}_mask": value for name, value in tensors.items()}
        masks = {}
        for name, value in wanted.items():
            if name in signature.parameters and bound.get(name) is None:
                mask = keras.tree.map_structure(_compat.keras_mask, value)
                if any(m is not None for m in keras.tree.flatten(mask)):
                    masks[name] = mask
        return masks

    def compute_output_spec(self, inputs, *args, training=None, **kwargs):
        return self.layer.compute_output_spec(inputs, *args, **kwargs)

    def compute_mask(self, inputs, previous_mask):
        return self.layer.compute_mask(inputs, previous_mask)

    def get_build_config(self):
        # The layer's own (e.g. MultiHeadAttention's query and value shapes).
        return self.layer.get_build_config()

    def build_from_config(self, config):
        # A loaded layer is built by its own build config, in `layer`'s.
        if not self.layer.built:
            self.layer.build_from_config(config)
        self.built = True


def _all_tensors(value):
    """True for a tensor or a non-empty structure of tensors (and None)."""
    flat = keras.tree.flatten(value)
    is_tensor = keras.ops.is_tensor
    return any(is_tensor(x) for x in flat) and all(x is None or is_tensor(x) for x in flat)


def _require_recomputation(feature):
    """Raises under JAX or PyTorch with a Keras older than `KERAS_REMAT`."""
    if _backend.IS_TENSORFLOW or hasattr(keras, "remat"):
        return
    raise RuntimeError(
        f"{feature} on {_backend.BACKEND} needs Keras >= {KERAS_REMAT} (`keras.remat`); "
        f"Keras {keras.__version__} is installed (pip install 'keras>={KERAS_REMAT}', or "
        "use KERAS_BACKEND=tensorflow)"
    )


def rematerialize(model: keras.Model, mode: str, output_size_threshold: int = 1024):
    """A new model, sharing `model`'s layers, that recomputes them per `mode`.

    Made by `keras.models.clone_model`; `model`, its layers and Keras are
    left as they were. See docs/guides/memory.md ("Reference").

    Args:
        model: a built Sequential or Functional Keras model (a subclassed
            one is refused). Layers it already wraps in `Rematerialized`
            are decided again: "none" unwraps them.
        mode: one of `MODES`.
        output_size_threshold: elements per item above which "larger_than"
            recomputes a layer, from its output shape in the model's graph
            (a layer without one counts as large).

    Returns:
        A Functional model (also for a Sequential `model`) with `model`'s
        name and the shapes of its inputs and outputs, compiled like `model`
        (with the same optimizer object) if it is compiled.
    """
    check_mode(mode)
    if not _is_graph_model(model):
        raise ValueError(
            "`rematerialize` needs a Sequential or Functional model, which "
            "`keras.models.clone_model` can rebuild: build it as a Functional model, or wrap "
            "its heavy sublayers in `keras_accum.remat.Rematerialized` where you define it. "
            f"Received: model={getattr(model, 'name', model)!r} of type {type(model).__name__}"
        )

    def clone(layer):
        # The size before unwrapping: the wrapper is what `model`'s graph calls.
        size = _output_size(layer)
        if isinstance(layer, Rematerialized):
            layer = layer.layer
        if mode != "none" and _may_recompute(layer):
            if mode == "full" or size > output_size_threshold:
                return Rematerialized(layer)
        return layer

    new = keras.models.clone_model(_uncompiled(model), clone_function=clone, recursive=True)
    if model.compiled:
        _compile_like(new, model)
    return new


def mode_of(model: keras.Model) -> str:
    """The mode of `model`'s layers: "none" (none wrapped), "full" (every
    layer `rematerialize` would wrap) or "larger_than" (some)."""
    wrapped = [isinstance(layer, Rematerialized) for layer in _candidates(model)]
    if not any(wrapped):
        return "none"
    return "full" if all(wrapped) else "larger_than"


def _is_graph_model(layer):
    """A Sequential or Functional model (a `keras.Function`)."""
    return isinstance(layer, (keras.Sequential, keras.Function))


def _uncompiled(model):
    """`model` as an uncompiled Functional model on its own graph (a
    compiled one would make `clone_model` build a second optimizer)."""
    if isinstance(model, keras.Sequential):
        if not model.built:
            raise ValueError(
                "`rematerialize` needs a built model: give the Sequential model a "
                f"`keras.Input` or call it once. Received: model={model.name!r} (not built)"
            )
        outputs = model.outputs[0] if len(model.outputs) == 1 else model.outputs
        return keras.Model(model.inputs[0], outputs, name=model.name)
    return keras.Model(model.input, model.output, name=model.name)


def _compile_like(new, model):
    """Compiles `new` as `model` is, with the same optimizer object and loss."""
    config = dict(model.get_compile_config())
    config.pop("optimizer", None)
    config.pop("loss", None)
    config = keras.saving.deserialize_keras_object(config)
    new.compile(optimizer=model.optimizer, loss=getattr(model, "loss", None), **config)


def _candidates(model):
    """The layers `rematerialize` decides about, nested graph models flattened."""
    for layer in model.layers:
        if _is_graph_model(layer):
            yield from _candidates(layer)
        elif isinstance(layer, Rematerialized) or _may_recompute(layer):
            yield layer


def _may_recompute(layer):
    """False for what is never wrapped (see the module docstring), and for an
    operation that is not a layer (`x + y`) or an `InputLayer`."""
    if not isinstance(layer, keras.layers.Layer):
        return False
    never = (keras.layers.Embedding, keras.layers.InputLayer, keras.layers.BatchNormalization)
    if isinstance(layer, never):
        return False
    return not _draws_random_numbers(layer) and not _adds_activity_loss(layer)


def _adds_activity_loss(layer):
    """True if `layer` or a layer inside it has an `activity_regularizer`."""
    if not isinstance(layer, keras.layers.Layer):
        return False
    inner = [layer, *_compat.all_layers(layer)]
    return any(getattr(sub, "activity_regularizer", None) is not None for sub in inner)


def _draws_random_numbers(layer):
    """True if `layer` or a layer inside it holds a `SeedGenerator` (Keras's
    `layer.variables` are its weights plus its seed generators' states)."""
    weights = {id(v) for v in layer.weights}
    return any(id(v) not in weights for v in layer.variables)


def _output_size(layer):
    """Elements per item of `layer`'s output in the model's graph, or inf."""
    try:
        outputs = keras.tree.flatten(layer.output)
    except (AttributeError, ValueError):
        return math.inf
    return sum(math.prod(d or 1 for d in x.shape[1:]) for x in outputs)


def recompute_grad(f):
    """`f` recomputed in the backward pass, keyword arguments accepted.

    `tf.recompute_grad` on TensorFlow, `keras.remat` on JAX and PyTorch. The
    float tensors among the arguments (nested or not) are passed to it
    positionally, so gradients reach all of them; the other arguments
    (`training`, boolean masks, token ids) are bound around it. Give it a
    layer rather than its `call`, so the recomputation reopens its
    mixed-precision autocast scope.
    """
    checkpoint = tf.recompute_grad if _backend.IS_TENSORFLOW else keras.remat
    nest = tf.nest if _backend.IS_TENSORFLOW else keras.tree

    def call(*args, **kwargs):
        flat = nest.flatten((args, kwargs))
        where = [i for i, value in enumerate(flat) if _differentiable(value)]

        def positional(*tensors):
            values = list(flat)
            for i, tensor in zip(where, tensors):
                values[i] = tensor
            inner_args, inner_kwargs = nest.pack_sequence_as((args, kwargs), values)
            return f(*inner_args, **inner_kwargs)

        return checkpoint(positional)(*(flat[i] for i in where))

    return call


def _differentiable(value):
    """A float or complex tensor."""
    if not keras.ops.is_tensor(value):
        return False
    dtype = keras.backend.standardize_dtype(value.dtype)
    return "float" in dtype or "complex" in dtype
