"""Each device's own gradient under JAX's `keras.distribution`, summed once
per window (`PerDeviceGradients`).

Keras's JAX `train_step` all-reduces every gradient on every micro-batch.
Under the mixin, `train_step` differentiates each device's shard on its
device (`jax.shard_map`, manual over the batch axis only) and hands the
optimizer one `[devices, *shape]` row per device; the optimizer keeps each
device's window sums in variables of that layout and reduces them once, in
the window's end. See docs/guides/fit.md ("One reduction per window").
"""

import contextvars
from typing import Any

import keras
from keras import ops

from keras_accum import _backend, _compat, _replicas, kernels, weighing

__all__ = ["PerDeviceGradients"]

# The batch axis while `DeviceRoute.train_step` traces each device's step, else None.
_AXIS = contextvars.ContextVar("keras_accum_device_axis", default=None)


def summed_over_devices(values: list) -> list:
    """`values` summed over the devices inside the per-device step (for
    `layers.BatchNormalization`'s window sums); elsewhere as given."""
    axis = _AXIS.get()
    if axis is None:
        return values
    import jax

    return [jax.lax.psum(_varying_over(axis, v), axis) for v in values]


def _varying_over(axis, value):
    """`value` typed as varying over `axis`, so that a psum adds each device's."""
    import jax

    aval = jax.typeof(value)
    manual = getattr(aval, "manual_axis_type", None)  # jax 0.10; before, vma
    varying = manual.varying if manual is not None else getattr(aval, "vma", ())
    return value if axis in varying else jax.lax.pcast(value, axis, to="varying")


class PerDeviceGradients:
    """Model mixin: under JAX's `keras.distribution.DataParallel`,
    `GradientAccumulation` and `InvariantAdam` get each device's gradient
    and reduce over the devices once per window.

    The one line (the distribution set before the model is built)::

        class Net(keras_accum.PerDeviceGradients, keras.Sequential): pass

    then ``Net([...])`` (``Net(inputs, outputs)`` for a functional model; a
    subclassed model lists the mixin first). Without a distribution that
    splits the batch, on another backend, or with another optimizer,
    `train_step` is Keras's. See docs/guides/fit.md.
    """

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Keras's `compile`, then the per-device route for its optimizer."""
        super().compile(*args, **kwargs)
        if _backend.BACKEND == "jax" and getattr(self, "optimizer", None) is not None:
            if getattr(self.optimizer, "_device_route", None) is not None:
                return  # compiled again with the optimizer this route built
            route = DeviceRoute.of_distribution()
            if route is not None and route.takes(self.optimizer):
                self.optimizer._device_route = route

    def compile_from_config(self, config: dict) -> None:
        """Keras's, through this class's `compile`: `load_model` builds the
        per-device sums before it loads the saved state into them."""
        self.compile(**keras.saving.deserialize_keras_object(config))
        if getattr(self, "optimizer", None) is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    def train_step(self, *args: Any) -> Any:
        """Keras's, or the per-device route's; `args` Keras's `(state, data)`."""
        route = getattr(getattr(self, "optimizer", None), "_device_route", None)
        if route is None:
            return super().train_step(*args)
        return route.train_step(self, *args)


class DeviceRoute:
    """The batch axis of a mesh: its window variables, their reduction, and
    the train step that differentiates each device's shard."""

    def __init__(self, mesh: keras.distribution.DeviceMesh, axis: str, devices: int):
        self.mesh, self.axis, self.devices = mesh, axis, devices
        self._rows = set()  # ids of the variables made here (one row per device)

    @classmethod
    def of_distribution(cls) -> "DeviceRoute | None":
        """The route of the distribution in scope, or None (no batch axis of 2+)."""
        distribution = keras.distribution.distribution()
        if distribution is None:
            return None
        mesh = distribution.device_mesh
        axis = getattr(distribution, "batch_dim_name", None)
        names = list(mesh.axis_names)
        if axis not in names:
            return None
        sizes = dict(zip(names, mesh.shape))
        if int(sizes[axis]) < 2:
            return None
        return cls(mesh, axis, int(sizes[axis]))

    def takes(self, optimizer: keras.optimizers.Optimizer) -> bool:
        """Whether `optimizer` (not built yet) keeps per-device window sums."""
        if not getattr(optimizer, "_per_device_sums", False):
            return False
        if optimizer.built:
            raise ValueError(
                f"{type(optimizer).__name__} was built before this model's compile: "
                "PerDeviceGradients needs a fresh optimizer, whose window sums it "
                f"lays out over the devices. Received: optimizer={optimizer!r}"
            )
        return True

    def add_variable(
        self,
        optimizer: keras.optimizers.Optimizer,
        reference: keras.Variable,
        name: str,
        dtype: str = "float32",
    ) -> keras.Variable:
        """A window variable of shape `[devices, *reference.shape]`, one row
        per device, sharded over the batch axis and each row as `reference`
        (a `ModelParallel` layout's axes)."""
        shape = (self.devices, *reference.shape)
        axes = _layout_axes(reference)
        named = {a for entry in axes for a in (entry if isinstance(entry, tuple) else (entry,))}
        if self.axis in named:
            raise ValueError(
                "PerDeviceGradients keeps one row per device along the batch axis "
                f"{self.axis!r}, and the layout of {reference.path!r} shards it over that "
                f"axis too (axes {axes}): lay the variable out over the other axes of the "
                "mesh, or use a model without PerDeviceGradients."
            )
        layout = keras.distribution.TensorLayout((self.axis, *axes), self.mesh)
        name = _replicas.slot_name(reference, name)
        variable = optimizer.add_variable(shape, "zeros", dtype, layout=layout, name=name)
        self._rows.add(id(variable))
        return variable

    def holds(self, variable: keras.Variable) -> bool:
        """Whether `variable` is a window variable made here (a row per device)."""
        return id(variable) in self._rows

    @staticmethod
    def local_rows(variable: keras.Variable) -> Any:
        """What a checkpoint keeps of a window variable: the rows of this
        process's devices, in order (every row on one process)."""
        import numpy as np

        value = variable.value
        if getattr(value, "is_fully_addressable", True):
            return np.asarray(value)
        shards = sorted(value.addressable_shards, key=lambda s: s.index[0].start or 0)
        return np.concatenate([np.asarray(s.data) for s in shards])

    def rows_from(self, variable: keras.Variable, value: Any) -> Any:
        """A saved `local_rows` value as a value of `variable`, placed on this
        process's devices."""
        import jax
        import numpy as np

        value = np.asarray(value)
        if value.shape[:1] == (self.devices,) or jax.process_count() == 1:
            return value
        sharding = variable.value.sharding
        return jax.make_array_from_process_local_data(sharding, value, tuple(variable.shape))

    @staticmethod
    def whole(variable: keras.Variable) -> Any:
        """Every row of a window variable as numpy (on several processes an
        all-gather: every process must ask at once)."""
        import numpy as np

        value = variable.value
        if getattr(value, "is_fully_addressable", True):
            return np.asarray(value)
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(value, tiled=True))

    @staticmethod
    def weighed(rows: list, scale: Any, share: Any) -> tuple:
        """Under `weigh_micro_batches`: each row times its device's `scale`,
        and the devices' `share`s summed (the micro-batch's weight)."""
        column = lambda g: ops.reshape(scale, (-1,) + (1,) * (len(g.shape) - 1))  # noqa: E731
        return [column(g) * g for g in rows], ops.sum(ops.broadcast_to(share, (len(rows[0]),)))

    @staticmethod
    def each_row(function: Any, rows: list) -> list:
        """`function` (list to list) applied to each device's row on its own
        (`jax.vmap`): `InvariantAdam`'s clip of each device's micro-batch."""
        import jax

        return list(jax.vmap(lambda *row: function(list(row)))(*rows))

    @staticmethod
    def total(values: list) -> list:
        """Each `[devices, *shape]` value summed over its devices: a window's reduction."""
        return [ops.sum(ops.convert_to_tensor(v), axis=0) for v in values]

    def window_steps(
        self, keep: Any, momentums: list, velocities: list, alphas: list, epsilon: float
    ) -> list:
        """`InvariantAdam`'s [alpha m / (sqrt(v) + epsilon)], m and v summed
        over the devices, where `keep` holds (a `cond`); zeros elsewhere."""

        def reduced():
            m, v = self.total(momentums), self.total(velocities)
            return kernels.adam_steps(m, v, alphas, epsilon)

        def held():
            return [ops.zeros(m.shape[1:], m.dtype) for m in momentums]

        return ops.cond(keep, reduced, held)

    def train_step(self, model: keras.Model, state: tuple, data: Any) -> tuple:
        """Keras's JAX `train_step`, with `[devices, *shape]` gradients: each
        row its device's gradient / devices."""
        import jax
        from jax.sharding import PartitionSpec

        # `weigh_micro_batches`: each device's loss records its shard's count.
        items = getattr(model.optimizer, "_fit_items", None)
        if items is not None and items.weighed_model() is not model:
            items = None  # compiled again without weighing: nothing recorded

        trainable, non_trainable, optimizer_values, metrics_values = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        axis, devices = self.axis, self.devices
        split, whole = PartitionSpec(axis), PartitionSpec()

        def varying(value):
            return _varying_over(axis, value) is value

        def agreed(value):  # a non-trainable value the devices moved apart
            if not varying(value):
                return value
            if jax.numpy.issubdtype(value.dtype, jax.numpy.floating):
                return jax.lax.pmean(value, axis)
            return jax.lax.pmax(value, axis)  # counters (seed generators)

        # Seed generator state (seed, count): each device its own seed (else
        # all drop the same units); the count moves as on one device.
        seeds = [v.name == "seed_generator_state" for v in model.non_trainable_variables]

        def local(trainable, non_trainable, metrics_values, optimizer_values, x, y, sample_weight):
            shift = jax.lax.axis_index(axis) * _SEED_STRIDE
            given = non_trainable
            non_trainable = [
                v + ops.cast(ops.stack([shift, 0]), v.dtype) if seed else v
                for seed, v in zip(seeds, non_trainable)
            ]
            optimizer_values = [
                jax.numpy.zeros(shape) if value is None else value
                for shape, value in zip(shapes, optimizer_values)
            ]
            # Varying over the batch axis: else the gradient of a replicated
            # input comes back summed over the devices.
            trainable = [_varying_over(axis, p) for p in trainable]
            grad_fn = jax.value_and_grad(model.compute_loss_and_updates, has_aux=True)
            token = _AXIS.set(axis)
            try:
                (_, aux), grads = grad_fn(
                    trainable,
                    non_trainable,
                    metrics_values,
                    x,
                    y,
                    sample_weight,
                    training=True,
                    optimizer_variables=optimizer_values,
                )
            finally:
                _AXIS.reset(token)
            loss, y_pred, new_non_trainable, new_metrics = aux
            count = None if items is None else items.traced
            if items is not None:
                items.traced = None  # a value of this trace: handed out below
            count = weighing.UNSET if count is None else count
            count = _varying_over(axis, ops.cast(ops.reshape(count, (1,)), "float32"))
            new_non_trainable = [
                old + (new - shifted) if seed else new
                for seed, old, shifted, new in zip(seeds, given, non_trainable, new_non_trainable)
            ]
            # The compiled loss's trackers add sums: every device's addition.
            new_metrics = [
                old + jax.lax.psum(_varying_over(axis, change), axis)
                for old, change in ((o, n - o) for o, n in zip(metrics_values, new_metrics))
            ]
            return (
                [(g / devices)[None] for g in grads],
                jax.lax.pmean(loss, axis),
                y_pred,
                [agreed(v) for v in new_non_trainable],
                new_metrics,
                count,
            )

        # Per-device rows stay out (only `scale_loss` reads them there, wanting whole shapes).
        rows = [id(v) in self._rows for v in model.optimizer.variables]
        shapes = [v.shape for v in model.optimizer.variables]
        optimizer_inputs = [None if row else v for row, v in zip(rows, optimizer_values)]
        grads, loss, y_pred, non_trainable, metrics_values, counts = jax.shard_map(
            local,
            mesh=self.mesh.backend_mesh,
            in_specs=(whole, whole, whole, whole, split, split, split),
            out_specs=(split, whole, split, whole, whole, split),
            axis_names={axis},  # manual over the batch; a model axis stays XLA's
        )(trainable, non_trainable, metrics_values, optimizer_inputs, x, y, sample_weight)
        if items is not None:
            items.traced = counts  # [devices]: what `apply` takes
        trainable, optimizer_values = model.optimizer.stateless_apply(
            optimizer_values, grads, trainable
        )
        logs, metrics_values = _compat.update_jax_metrics(
            model, metrics_values, loss, x, y, y_pred, sample_weight
        )
        return logs, (trainable, non_trainable, optimizer_values, metrics_values)


def _layout_axes(variable: keras.Variable) -> tuple:
    """The mesh axes `variable` is sharded over, one entry (or None) per
    dimension, from its `TensorLayout` or JAX `NamedSharding`."""
    layout = _compat.variable_layout(variable)
    axes = getattr(layout, "axes", None)
    if axes is None:
        axes = getattr(layout, "spec", None) or ()
    axes = tuple(axes)
    return axes + (None,) * (len(variable.shape) - len(axes))


# Apart enough that two devices' seeds never meet (a seed is a uint32 or int).
_SEED_STRIDE = 1_000_003
