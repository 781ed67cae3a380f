"""Issue #42's decay protocol on a second task: the MNIST-1D CNN
(docs/BATCH_SIZE_SCHEDULES.md, "decay" on MNIST-1D;
keras_accum/experiments/schedules_controls.py with `task` "mnist1d_cnn").

The char-LM protocol of saved_configs/schedule_cosine.py, unchanged but for
the task: micro-batch 16 examples, 3072 micro-batches (49152 examples,
about 14 epochs of the 3500 trained on), an evaluation every 64, the last
500 of MNIST-1D's 4000 train examples held out for validation, InvariantAdam
"fixed_beta_1", WSD decaying over the last 20%. The budget in micro-batches
is the char LM's, so its switch points (512 and 1024 micro-steps, 1/6 and
1/3 of the run) are kept as they are, fixed before any run of this study.

    tune: kappa = 1 with WSD (and cosine) at 9 base lrs x1.41 apart, seeds 100-102,
    read on the validation split.
    arms: the batch-size warmups with WSD (the better decay of `tune`) at its
    tuned lr, seeds 0-7, then kappa = 1 with cosine at its own tuned lr;
    kappa = 1 WSD's seed 0 rerun once (determinism).
    smoke: a few micro-batches.

    taskset -c 1 python3 scripts/schedule_controls.py --config saved_configs/schedule_mnist1d.py \
        --variant tune --workdir runs/mnist1d-tune
"""

TUNED = {"wsd": 8e-3, "cosine": 1.13e-2}  # kappa = 1: best mean final val_loss of `tune`
DECAY = "wsd"  # the better decay of `tune`: 0.2594 against cosine's 0.2971 (val_loss)
RAMP = 128  # micro-steps: 1 -> 2 at the boundary, 3 at +64, 4 at +128
GRID = [1e-3, 1.4e-3, 2e-3, 2.8e-3, 4e-3, 5.7e-3, 8e-3, 1.13e-2, 1.6e-2]
VARIANTS = ("tune", "arms", "smoke")


def _arms(decay, lr):
    d = {"decay": decay, "learning_rates": [lr]}
    return {
        f"kappa=1 {decay}": {"steps": 1, **d},
        f"1->4 at 512 {decay}": {"steps": [[512], [1, 4]], **d},
        f"1->2->4 at 512, 1024 {decay}": {"steps": [[512, 1024], [1, 2, 4]], **d},
        f"1->4 at 512 ramp {decay}": {"steps": [[512], [1, 4]], "ramp": RAMP, **d},
        f"adaptive preconditioned {decay}": {
            "steps": "adaptive",
            "estimate": "adam_preconditioned",
            **d,
        },
    }


def _other(decay):
    other = "cosine" if decay == "wsd" else "wsd"
    return {f"kappa=1 {other}": {"steps": 1, "decay": other, "learning_rates": [TUNED[other]]}}


def get_config(variant="arms"):
    if variant not in VARIANTS:
        raise ValueError(f"`variant` must be one of {VARIANTS}. Received: variant={variant!r}")
    config = {
        "task": "mnist1d_cnn",
        "micro_batch_size": 16,
        "beta_1": 0.9,
        "beta_2": 0.999,
        "epsilon": 1e-7,
        "scaling_rule": "fixed_beta_1",
        "train_examples": 49152,
        "eval_every": 1024,
        "train_eval_examples": 256,
        "validation_examples": 500,
        "max_kappa": 8,
        "probe_windows": 4,
        "probe_ema": 0.9,
        "wsd_decay": 0.2,
        "threads": 1,
        "deterministic": True,
    }
    if variant == "tune":
        config.update(
            seeds=[100, 101, 102],
            learning_rates=GRID,
            arms={
                "kappa=1 wsd": {"steps": 1, "decay": "wsd"},
                "kappa=1 cosine": {"steps": 1, "decay": "cosine"},
            },
        )
    elif variant == "arms":
        config.update(
            seeds=list(range(8)),
            learning_rates=[TUNED[DECAY]],
            arms={**_arms(DECAY, TUNED[DECAY]), **_other(DECAY)},
            repeat=[f"kappa=1 {DECAY}"],
        )
    else:
        config.update(
            seeds=[0],
            learning_rates=[1e-3],
            train_examples=1024,
            eval_every=256,
            arms={
                "kappa=1 wsd": {"steps": 1, "decay": "wsd"},
                "1->4 at 16 ramp wsd": {"steps": [[16], [1, 4]], "ramp": 32, "decay": "wsd"},
                "adaptive preconditioned wsd": {
                    "steps": "adaptive",
                    "estimate": "adam_preconditioned",
                    "decay": "wsd",
                },
            },
            verbose=0,
        )
    return config
