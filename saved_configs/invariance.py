"""Batch-size invariance study of InvariantAdam (docs/INVARIANCE.md).

MLP on MNIST-1D, micro-batch 32, kappa in {1, 2, 4, 8} micro-batches per
update, four methods (invariant, sqrt, update_accumulation, plain), base
learning rates tuned at kappa = 1. Whole-command run times measured on the
2-core CPU machine while other jobs shared it (load average 4-6):

    full: 455 runs, 7 lrs x 5 seeds, 32768 examples each; 5.8 min wall
    (4.5 min CPU). Its results are docs/INVARIANCE.md.
    python scripts/invariance.py --config saved_configs/invariance.py \
        --variant full --workdir runs/invariance-full

    quick: 117 runs, 3 lrs x 3 seeds, 16384 examples each; 1.2-1.6 min
    wall depending on load (1.1 min CPU).
    python scripts/invariance.py --config saved_configs/invariance.py \
        --variant quick --workdir runs/invariance-quick

    frontier: 240 runs, where each rule's invariance breaks: InvariantAdam
    under the invariant, power and fixed_beta_1 rules against
    update_accumulation and sqrt, 5 lrs x 3 seeds, 32768 examples each;
    2.4 min wall (1.8 min CPU) for the whole command at load ~1-2, 6.5
    min wall (1.8 min CPU) at load 10-13. Results: docs/invariance/frontier/.
    python scripts/invariance.py --config saved_configs/invariance.py \
        --variant frontier --workdir runs/invariance-frontier

    smoke: 18 runs of 512 examples, kappa in {1, 2, 4}; 31 s wall including
    the TensorFlow import (17 s in the study). tests/test_invariance.py.
    python scripts/invariance.py --config saved_configs/invariance.py \
        --variant smoke --workdir runs/invariance-smoke

Runs at kappa = 1 are shared by the methods (all are Adam there), so a
(lr, seed) costs 1 + 4 x 3 = 13 runs with four methods.
"""

MICRO_BATCH = 32
KAPPAS = [1, 2, 4, 8]
WINDOW = max(KAPPAS) * MICRO_BATCH  # 256: evaluation points are multiples
VARIANTS = ("full", "quick", "frontier", "smoke")


def get_config(variant="full"):
    if variant not in VARIANTS:
        raise ValueError(f"`variant` must be one of {VARIANTS}. Received: variant={variant!r}")
    config = {
        "dataset": "mnist1d",
        "model": "mlp",
        "micro_batch_size": MICRO_BATCH,
        "kappas": KAPPAS,
        "methods": ["invariant", "sqrt", "update_accumulation", "plain"],
        "beta_1": 0.9,
        "beta_2": 0.999,
        "epsilon": 1e-7,
    }
    if variant == "full":
        config.update(
            learning_rates=[1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2],
            seeds=[0, 1, 2, 3, 4],
            train_examples=32768,  # 8.2 epochs of 4000
            eval_every=4 * WINDOW,  # 1024 examples: 32 points
            plot_learning_rates=[1e-4, 1e-3, 1e-2],
            noise_scale_windows=64,
            noise_scale_kappa=16,  # probe windows of 512 examples
        )
    elif variant == "frontier":
        config.update(
            methods=["invariant", "power", "fixed_beta_1", "update_accumulation", "sqrt"],
            learning_rates=[1e-4, 3e-4, 1e-3, 3e-3, 1e-2],
            seeds=[0, 1, 2],
            train_examples=32768,  # as full
            eval_every=4 * WINDOW,
            plot_learning_rates=[1e-4, 1e-3, 1e-2],
            noise_scale_windows=64,
            noise_scale_kappa=16,
        )
    elif variant == "quick":
        config.update(
            learning_rates=[3e-4, 1e-3, 3e-3],
            seeds=[0, 1, 2],
            train_examples=16384,  # 4.1 epochs
            eval_every=4 * WINDOW,  # 16 points
            plot_learning_rates=[1e-3],
            noise_scale_windows=32,
            noise_scale_kappa=16,
        )
    else:  # smoke: seconds, every output, for tests
        config.update(
            kappas=[1, 2, 4],
            learning_rates=[1e-3],
            seeds=[0, 1],
            train_examples=512,
            eval_every=256,  # 2 points
            plot_learning_rates=[1e-3],
            noise_scale_windows=2,
            noise_scale_kappa=4,
        )
    return config
