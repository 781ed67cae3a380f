"""Batch-size schedules study (docs/BATCH_SIZE_SCHEDULES.md).

MLP on MNIST-1D, micro-batch 32. Two experiments (see
keras_accum/experiments/schedules_study.py):

* switch: kappa = 1 -> 8 half way, for InvariantAdam with the "invariant"
  and "power" rules and for Adam with the square-root rule re-applied at the
  switch, at base learning rates 1e-4 (small), 1e-3 and 1e-2 (large);
* adaptive: AdaptiveSteps(1, 16) from the gradient noise scale against
  constant kappa = 1 and kappa = 16 (power rule: 16 x (1 - 0.9) >= 1 would
  make the linear rule's beta_1 <= 0).

    full: 3 seeds, 32768 examples per run; 90 runs, about 3.5 min wall on
    the shared 2-core machine.
    python scripts/schedules_study.py --config saved_configs/batch_size_schedules.py \
        --variant full --workdir runs/schedules-full

    warmup_sweep: the char LM, 12 epochs, kappa = 1 only at base lrs 1e-3,
    3e-3, 1e-2, 3e-2 and 3 seeds (12 runs); run as two processes (lrs
    split with --set) then --merge: 7.5 min wall each, 256 s CPU each.
    warmup: at the best of the sweep (3e-3), 4 seeds, kappa = 1, 8, the
    doubling warmup and AdaptiveSteps(1, 8) for fixed_beta_1 and sqrt (28
    runs); two processes (seeds split): 15.3 min wall, 690-696 s CPU each.
    python scripts/schedules_study.py --variant warmup --set '{"seeds": [0, 1]}' \
        --workdir runs/warmup-a   # and [2, 3] in runs/warmup-b, then:
    python scripts/schedules_study.py --merge runs/warmup-a,runs/warmup-b \
        --workdir runs/warmup
    warmup_settled: kappa = 1 and AdaptiveSteps with its smoothing and
    settling (powers of two) for fixed_beta_1, power and sqrt, 4 seeds (16
    runs); two processes (seeds split): 8.4 min wall, 500 s CPU each.

    smoke: 1 seed, 2048 examples per run, one learning rate.
    python scripts/schedules_study.py --config saved_configs/batch_size_schedules.py \
        --variant smoke --workdir runs/schedules-smoke
"""

MICRO_BATCH = 32
MAX_STEPS = 16
WINDOW = MAX_STEPS * MICRO_BATCH  # 512: evaluation points are multiples


VARIANTS = (
    "full",
    "smoke",
    "charlm",
    "warmup",
    "warmup_settled",
    "warmup_sweep",
    "warmup_smoke",
)


def get_config(variant="full"):
    if variant not in VARIANTS:
        raise ValueError(f"`variant` must be one of {VARIANTS}. Received: variant={variant!r}")
    config = {
        "dataset": "mnist1d",
        "model": "mlp",
        "micro_batch_size": MICRO_BATCH,
        "beta_1": 0.9,
        "beta_2": 0.999,
        "epsilon": 1e-7,
        "switch_kappa": 8,
        "switch_methods": ["invariant", "power", "sqrt"],
        "adaptive_max_steps": MAX_STEPS,
        "probe_windows": 4,
        "probe_ema": 0.9,
    }
    if variant == "full":
        config.update(
            seeds=[0, 1, 2],
            train_examples=64 * WINDOW,  # 32768
            switch_examples=32 * WINDOW,  # half way
            eval_every=2 * WINDOW,  # 1024
            probe_every=2 * WINDOW,
            switch_learning_rates=[1e-4, 1e-3, 1e-2],
            adaptive_learning_rates=[3e-4, 1e-3],
        )
    elif variant == "charlm":
        # The character-level transformer LM (keras_accum.experiments.charlm):
        # micro-batch 16 sequences of 64 characters, 4096 sequences per run
        # (one epoch), switch at 2048; no adaptive runs. 24 runs, about
        # 20 min wall on the shared 2-core machine.
        config.update(
            dataset="char_corpus",
            micro_batch_size=16,
            adaptive_max_steps=8,
            switch_methods=["invariant", "sqrt"],
            seeds=[0, 1],
            train_examples=4096,
            switch_examples=2048,
            eval_every=256,
            probe_every=256,
            train_eval_examples=256,
            switch_learning_rates=[1e-4, 3e-4],
            adaptive_learning_rates=[],
        )
    elif variant.startswith("warmup"):
        # The char LM for 12 epochs (3072 micro-batches of 16): kappa = 1
        # against K = 8, the doubling warmup and AdaptiveSteps(1, 8).
        config.update(
            dataset="char_corpus",
            micro_batch_size=16,
            train_examples=49152,
            eval_every=1024,
            probe_every=1024,
            train_eval_examples=256,
            switch_learning_rates=[],
            adaptive_learning_rates=[],
            adaptive_max_steps=8,
            seeds=[0, 1, 2, 3],
            warmup_learning_rates=[3e-3],  # the best of warmup_sweep
            warmup_kappa=8,
            warmup_boundaries=[512, 1024, 2048],
        )
        if variant == "warmup_sweep":  # kappa = 1 only, the base lr tuned there
            config.update(
                seeds=[0, 1, 2],
                warmup_learning_rates=[1e-3, 3e-3, 1e-2, 3e-2],
                warmup_schedules=["kappa=1"],
            )
        elif variant == "warmup_settled":  # AdaptiveSteps' smoothing and settling
            config.update(
                adaptive_kwargs={"smoothing": 0.9, "min_observations": 4},
                warmup_rules=["fixed_beta_1", "power"],
                warmup_schedules=["kappa=1", "adaptive"],
            )
        elif variant == "warmup_smoke":  # a few micro-batches: the code runs
            config.update(
                seeds=[0],
                train_examples=1024,
                eval_every=128,
                probe_every=128,
                warmup_boundaries=[8, 16, 32],
                verbose=0,
            )
    else:
        config.update(
            seeds=[0],
            train_examples=4 * WINDOW,
            switch_examples=2 * WINDOW,
            eval_every=WINDOW,
            probe_every=WINDOW,
            switch_learning_rates=[1e-3],
            adaptive_learning_rates=[1e-3],
            verbose=0,
        )
    return config
