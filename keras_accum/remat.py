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

`rematerialize(model, mode)` returns a new model, made by
`keras.models.clone_model`, in which each layer to recompute is wrapped in
`Rematerialized`. The new model shares `model`'s layers, so its variables
are `model`'s (the same objects, no copy); `model`, its layers and Keras
are otherwise left as they were, and no other model in the process changes.
It takes a Sequential or Functional model, built, loaded or resumed; a
subclassed model cannot be cloned: wrap its heavy sublayers in
`Rematerialized` where it is defined. If `model` is compiled, the new model
is compiled the same way with the same optimizer object (its state
included).

Which layers: the outermost model is not wrapped (recomputing the whole
forward pass once more would save nothing beyond the per-layer
recomputation); a nested Sequential or Functional model counts as its
layers, a nested subclassed model as one layer. An `Embedding` is never
wrapped: its gradient is sparse on TensorFlow (`tf.IndexedSlices`, one
row per token seen), `tf.recompute_grad` would return it dense (every row,
and Adam would then move rows no token touched), and on every backend a
lookup keeps nothing that recomputing it would free. Nor is a layer that
draws random numbers (Dropout with rate > 0, or a layer holding one): its
recomputation would draw new ones. Nor is a `BatchNormalization`: its
training call moves its moving statistics, and the recomputation would
move them a second time. Nor is a layer with an `activity_regularizer`
(or holding one): its loss would be computed inside the recomputed
function, where TensorFlow drops its gradient and JAX leaks a tracer; a
layer that calls `add_loss` itself is not detected, wrap it yourself only
if it does not.

Backends: the recomputation is Keras's own on JAX and PyTorch,
`keras.remat` (`jax.checkpoint`, and `torch.utils.checkpoint` without
reentrance; Keras >= 3.9, older Keras is refused there in one line), and
on TensorFlow `tf.recompute_grad`, which is what `keras.remat` is there
(and runs on every Keras this package supports). Why not `keras.RematScope`:
it decides when a layer is created, not for a model already built; and on
TensorFlow `tf.recompute_grad` in a `tf.function` refuses keyword
arguments, while Keras calls every layer with `training=...`: a model
built under `keras.RematScope` cannot train in graph mode or under XLA
(keras-team/keras#21207). `Rematerialized` passes the tensors among the
call's arguments to the recomputed function positionally and binds the
others around it (`recompute_grad`): on JAX that also keeps `training`
and masks out of `jax.checkpoint`'s traced arguments.

Saving: a rematerialized model's `.keras` file holds its `Rematerialized`
layers (registered as "keras_accum>Rematerialized"): `import keras_accum`
before `keras.models.load_model`. Its variables and their paths are those
of the model without it; in the file each wrapped layer's weights sit
under its wrapper's.

What it saves and costs is measured in BENCHMARKS.md ("Rematerialization");
the guide "When one example does not fit" (docs/guides/memory.md) sums it up.

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
    """`mode` if it is one of `MODES`, else a one-line ValueError naming the
    argument as the caller's signature spells it (`name`)."""
    return check_choice(name, mode, MODES)


@keras.saving.register_keras_serializable(package="keras_accum")
class Rematerialized(keras.layers.Wrapper):
    """`layer`, recomputed in the backward pass: only its inputs are kept.

    Calls `layer` itself (its inputs, `training`, masks and mixed precision
    as without the wrapper) through `recompute_grad`. The wrapper has no
    variables of its own: they are `layer`'s. `rematerialize` wraps the
    layers of a built model; in a subclassed model, wrap a heavy sublayer
    where it is defined:

        self.block = keras_accum.remat.Rematerialized(Block(...))

    A layer not built yet is built from the wrapper's first input shape, as
    Keras's wrappers do: build a layer of several inputs (e.g.
    `MultiHeadAttention`) before wrapping it.

    Args:
        layer: the layer to recompute: not one that draws random numbers
            (its recomputation would draw new ones) nor an `Embedding` (its
            sparse gradient would come back dense); one with an
            `activity_regularizer` is refused.
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
        """The masks Keras's `__call__` would give `layer` from its inputs'
        (where none is passed): passed explicitly, so that the
        recomputation, whose inputs carry no mask, sees them too."""
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
    """Raises, in one line, under JAX or PyTorch with a Keras older than
    `KERAS_REMAT` (no `keras.remat`); TensorFlow's route needs none."""
    if _backend.IS_TENSORFLOW or hasattr(keras, "remat"):
        return
    raise RuntimeError(
        f"{feature} on {_backend.BACKEND} needs Keras >= {KERAS_REMAT} (`keras.remat`); "
        f"Keras {keras.__version__} is installed (pip install 'keras>={KERAS_REMAT}', or "
        "use KERAS_BACKEND=tensorflow)"
    )


def rematerialize(model: keras.Model, mode: str, output_size_threshold: int = 1024):
    """A new model, sharing `model`'s layers, that recomputes them per `mode`.

    Args:
        model: a built Sequential or Functional Keras model (a subclassed
            one is refused); its own call is not wrapped. Layers it already
            wraps in `Rematerialized` are decided again: "none" unwraps them.
        mode: one of `MODES`.
        output_size_threshold: elements per item above which "larger_than"
            recomputes a layer. Decided here from each layer's output shape
            in the model's graph (a layer without one counts as large):
            Keras's own "larger_than" asks each layer for its output spec on
            every call, which fails for some layers on graph tensors.

    Returns:
        A Functional model (also for a Sequential `model`) with `model`'s
        name and the shapes of its inputs and outputs, compiled like `model`
        if it is compiled.
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
    """A Sequential or Functional model (`keras.Function` is the graph
    class behind Functional models)."""
    return isinstance(layer, (keras.Sequential, keras.Function))


def _uncompiled(model):
    """A Functional model on `model`'s own graph (layers and nodes), not
    compiled: `clone_model` would compile its copy of a compiled model from
    the compile config, building a second optimizer."""
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
    """Compiles `new` as `model` is: the same optimizer object (built, with
    its state) and loss, the other arguments from its compile config."""
    config = dict(model.get_compile_config())
    config.pop("optimizer", None)
    config.pop("loss", None)
    config = keras.saving.deserialize_keras_object(config)
    new.compile(optimizer=model.optimizer, loss=getattr(model, "loss", None), **config)


def _candidates(model):
    """The layers `rematerialize` decides about: `model`'s, a nested
    Sequential or Functional model replaced by its own."""
    for layer in model.layers:
        if _is_graph_model(layer):
            yield from _candidates(layer)
        elif isinstance(layer, Rematerialized) or _may_recompute(layer):
            yield layer


def _may_recompute(layer):
    """False for what is never wrapped: an operation that is not a layer
    (`x + y` in a Functional model), `InputLayer`, `Embedding`,
    `BatchNormalization` (a recomputation would move its moving statistics
    twice), a layer that draws random numbers and one with an activity
    regularizer."""
    if not isinstance(layer, keras.layers.Layer):
        return False
    never = (keras.layers.Embedding, keras.layers.InputLayer, keras.layers.BatchNormalization)
    if isinstance(layer, never):
        return False
    return not _draws_random_numbers(layer) and not _adds_activity_loss(layer)


def _adds_activity_loss(layer):
    """True if `layer` or a layer inside it has an `activity_regularizer`:
    Keras's `__call__` adds its loss, which inside the recomputed function
    would lose its gradient (TensorFlow) or leak a tracer (JAX)."""
    if not isinstance(layer, keras.layers.Layer):
        return False
    inner = [layer, *_compat.all_layers(layer)]
    return any(getattr(sub, "activity_regularizer", None) is not None for sub in inner)


def _draws_random_numbers(layer):
    """True if `layer` or a layer inside it holds a `SeedGenerator`
    (Dropout with rate > 0, GaussianNoise, ...): a recomputation would draw
    new numbers, and the gradient would not be that of the forward pass.
    Keras documents `layer.variables` as `layer.weights` plus the states of
    its seed generators."""
    weights = {id(v) for v in layer.weights}
    return any(id(v) not in weights for v in layer.variables)


def _output_size(layer):
    """Elements per item of `layer`'s output in the model's graph (inf if
    it has no single known output)."""
    try:
        outputs = keras.tree.flatten(layer.output)
    except (AttributeError, ValueError):
        return math.inf
    return sum(math.prod(d or 1 for d in x.shape[1:]) for x in outputs)


def recompute_grad(f):
    """`f` recomputed in the backward pass, keyword arguments accepted.

    The recomputation is `tf.recompute_grad` on TensorFlow and `keras.remat`
    on JAX and PyTorch (`jax.checkpoint`, `torch.utils.checkpoint`). The
    float tensors among the arguments (positional or keyword, nested or
    not) are passed to it positionally, so gradients reach all of them;
    the other arguments (`training=True`, `use_causal_mask=True`, a boolean
    mask, token ids: TensorFlow's backward pass adds a float to each input,
    and `jax.checkpoint` would trace a Python bool) are bound around it.
    Give it a layer rather than its `call`: the layer's `__call__` opens its
    mixed-precision autocast scope again when the backward pass recomputes
    it.
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
