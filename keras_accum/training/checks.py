"""The loop's argument checks, before anything runs: one ValueError each."""

import keras

from keras_accum import _compat, base
from keras_accum.training.stream import peek_batch_size
from keras_accum.validation import check_int


def steps_per_update(optimizer):
    """Micro-batches per replica per update (1 for a plain Keras optimizer)."""
    if isinstance(optimizer, base.AccumulationOptimizer):
        # None for a schedule: fed one micro-batch at a time (`micro_batch_step`).
        return optimizer.steps if isinstance(optimizer.steps, int) else None
    return 1


def check_scope(strategy, model, optimizer):
    """ValueError unless `optimizer` and the built `model` come from `strategy.scope()`."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(
            f"`optimizer` must be a keras Optimizer. Received: optimizer={optimizer!r}"
        )
    for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if opt is None or _compat.optimizer_strategy(opt) is strategy:
            continue
        raise ValueError(
            "`optimizer` was created outside `strategy.scope()` (under "
            f"{type(_compat.optimizer_strategy(opt)).__name__}, not "
            f"strategy={type(strategy).__name__}); create and "
            f"build it inside the scope. Received: optimizer={opt!r}"
        )
    if not model.built or not model.trainable_variables:
        raise ValueError(
            "`model` must be built (give it an `Input` or call it on a "
            f"batch inside `strategy.scope()`). Received: model={model!r}"
        )
    for v in model.variables:
        if not strategy.extended.variable_created_in_scope(getattr(v, "value", v)):
            raise ValueError(
                f"`model` variable {v.path!r} was created outside "
                "`strategy.scope()`; create the model inside it. "
                f"Received: model={model!r}"
            )


def check_split(global_batch, replicas, opt_steps, steps, micro_batch_size):
    """Checks `steps` / `micro_batch_size`; returns the micro-batch size per replica."""
    if steps is not None and micro_batch_size is not None:
        raise ValueError(
            "Give `steps` or `micro_batch_size`, not both (one follows from "
            f"the other). Received: steps={steps!r}, "
            f"micro_batch_size={micro_batch_size!r}"
        )
    if global_batch % replicas:
        raise ValueError(
            f"The global batch size {global_batch} (first batch of `dataset`) "
            f"must be divisible by the {replicas} replicas in sync."
        )
    per_replica = global_batch // replicas
    if steps is not None:
        check_int("steps", steps)
        if steps != opt_steps:
            raise ValueError(
                f"`steps` must equal the optimizer's window ({opt_steps} "
                f"micro-batches per replica). Received: steps={steps!r}"
            )
    if micro_batch_size is not None:
        check_int("micro_batch_size", micro_batch_size)
        if per_replica % micro_batch_size:
            raise ValueError(
                "`micro_batch_size` must divide the per-replica batch size "
                f"{per_replica} (global batch {global_batch} / {replicas} "
                f"replicas). Received: micro_batch_size={micro_batch_size!r}"
            )
        if per_replica // micro_batch_size != opt_steps:
            raise ValueError(
                f"`micro_batch_size` gives {per_replica // micro_batch_size} "
                f"micro-batches per replica, but the optimizer's window has "
                f"steps={opt_steps}. Received: "
                f"micro_batch_size={micro_batch_size!r}"
            )
    if per_replica % opt_steps:
        raise ValueError(
            f"The per-replica batch size {per_replica} (global batch "
            f"{global_batch} / {replicas} replicas) is not divisible by the "
            f"optimizer's steps={opt_steps}: micro-batches would differ in "
            "size. Change the batch size or `steps`."
        )
    return per_replica // opt_steps


def check_run(optimizer, dataset, strategy, epochs, steps, micro_batch_size, every, verbose):
    """Checks `train`'s arguments; returns (global batch, steps, micro-batch size)."""
    check_int("epochs", epochs)
    check_int("checkpoint_every", every)
    if verbose not in (0, 1):
        raise ValueError(f"`verbose` must be 0 or 1. Received: verbose={verbose!r}")
    global_batch = peek_batch_size(dataset)
    opt_steps = steps_per_update(optimizer)
    if opt_steps is None:
        raise ValueError(
            "`train` needs a constant `steps`; with a schedule drive "
            "`Trainer.micro_batch_step` over a dataset of micro-batches. "
            f"Received: steps={optimizer.steps!r}"
        )
    replicas = strategy.num_replicas_in_sync
    micro = check_split(global_batch, replicas, opt_steps, steps, micro_batch_size)
    return global_batch, opt_steps, micro
