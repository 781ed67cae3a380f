"""Controls for the char-LM batch-size warmup (issue #35; docs/BATCH_SIZE_SCHEDULES.md,
keras_accum/experiments/schedules_controls.py).

The 12-epoch character LM of the `warmup` variants of
saved_configs/batch_size_schedules.py (micro-batch 16 sequences, 3072
micro-batches, an evaluation every 64), with 512 of its 4096 train
sequences held out as a validation split, InvariantAdam "fixed_beta_1".
Every switch point below was fixed before any test loss of these runs was
seen: 512 micro-steps is where B_simple passes the micro-batch size on the
kappa = 1 run (the docs' table), 2304 is three quarters of the run.

    tune: kappa = 1, constant and cosine to zero, at base lrs 1e-3, 3e-3,
    1e-2, seeds 100 and 101; read on the validation split.
    tune_kappa4: constant kappa = 4 at base lrs 1e-3 and 3e-3, seeds 100
    and 101 (its lr retuned on the validation split).
    controls: every arm at the tuned lr (seeds in `_arms`), and a rerun of
    seed 0 of kappa = 1 and of the adaptive arm (determinism); the last arm
    is constant kappa = 4 for 4x the examples (as many updates as kappa =
    1).
    smoke: a few micro-batches, every kind of arm.

    taskset -c 1 python3 scripts/schedule_controls.py --variant tune --workdir runs/controls-tune
"""

TUNED_LR = 3e-3  # kappa = 1, constant: best final val_loss of `tune`
TUNED_COSINE_LR = 3e-3  # kappa = 1, cosine: best final val_loss of `tune`

VARIANTS = ("tune", "tune_kappa4", "controls", "smoke")


def _arms(lr, cosine_lr):
    """The arms in the order run, most important first (an interrupted
    study keeps them complete). What ~100 minutes of one shared core
    allowed: 8 seeds for the first six, 4 for the other controls, 2 for the
    long budget."""
    adaptive = {"steps": "adaptive"}  # AdaptiveSteps' defaults, powers of two
    four = {"seeds": [0, 1, 2, 3]}
    return {
        "kappa=1": {"steps": 1},
        "kappa=1 cosine": {"steps": 1, "decay": "cosine", "learning_rates": [cosine_lr]},
        "kappa=4": {"steps": 4},
        "1->4 at 512": {"steps": [[512], [1, 4]]},
        "1->2->4 at 512, 1024": {"steps": [[512, 1024], [1, 2, 4]]},
        "adaptive": adaptive,
        "kappa=8": {"steps": 8, **four},
        "kappa=2": {"steps": 2, **four},
        "late 1->4 at 2304": {"steps": [[2304], [1, 4]], **four},
        "1->8 at 512": {"steps": [[512], [1, 8]], **four},
        "adaptive preconditioned": {**adaptive, "estimate": "adam_preconditioned", **four},
        "kappa=4, 4x examples": {"steps": 4, "examples": 4 * 49152, "seeds": [0, 1]},
    }


def get_config(variant="controls"):
    if variant not in VARIANTS:
        raise ValueError(f"`variant` must be one of {VARIANTS}. Received: variant={variant!r}")
    config = {
        "micro_batch_size": 16,
        "beta_1": 0.9,
        "beta_2": 0.999,
        "epsilon": 1e-7,
        "scaling_rule": "fixed_beta_1",
        "train_examples": 49152,
        "eval_every": 1024,
        "train_eval_examples": 256,
        "validation_examples": 512,
        "max_kappa": 8,
        "probe_windows": 4,
        "probe_ema": 0.9,
        "threads": 1,
        "deterministic": True,
    }
    if variant == "tune":
        config.update(
            seeds=[100, 101],
            learning_rates=[1e-3, 3e-3, 1e-2],
            arms={"kappa=1": {"steps": 1}, "kappa=1 cosine": {"steps": 1, "decay": "cosine"}},
        )
    elif variant == "tune_kappa4":
        config.update(seeds=[100, 101], learning_rates=[1e-3, 3e-3], arms={"kappa=4": {"steps": 4}})
    elif variant == "controls":
        config.update(
            seeds=list(range(8)),
            learning_rates=[TUNED_LR],
            arms=_arms(TUNED_LR, TUNED_COSINE_LR),
            repeat=["kappa=1", "adaptive"],
        )
    else:
        arms = _arms(1e-3, 3e-3)
        config.update(
            seeds=[0],
            learning_rates=[1e-3],
            train_examples=1024,
            eval_every=256,
            arms={  # one seed each: the arms' own seed lists are the study's
                name: {k: v for k, v in arms[name].items() if k != "seeds"}
                for name in ("kappa=1", "kappa=1 cosine", "kappa=4", "adaptive preconditioned")
            },
            repeat=["adaptive preconditioned"],
            verbose=0,
        )
        config["arms"]["1->2->4 at 16, 32"] = {"steps": [[16, 32], [1, 2, 4]]}
    return config
