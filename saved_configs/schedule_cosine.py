"""Batch-size warmups against the recipe people train with (issue #42;
docs/BATCH_SIZE_SCHEDULES.md, keras_accum/experiments/schedules_controls.py).

The char LM of saved_configs/schedule_controls.py (micro-batch 16 sequences,
3072 micro-batches, an evaluation every 64, 512 train sequences held out for
validation, InvariantAdam "fixed_beta_1"), with the learning rate decayed to
zero: a cosine, or warmup-stable-decay (constant, then linear to zero over
the last 20% of the micro-batches; no lr warmup, like the cosine arm). The
switch points (512 and 1024 micro-steps) are those of the controls study,
fixed before any run of this one.

    tune: kappa = 1 with each decay at 6 base lrs (x1.41 apart, around the
    controls' 3e-3), seeds 100-102; read on the validation split.
    cosine: the batch-size warmups with the better decay of `tune` (WSD) at
    its tuned lr, seeds 0-7 (the arms in `_arms`), then kappa = 1 with the
    other decay at its tuned lr (the baseline people use most).
    spike: the switch 1 -> 4 at 512 at the controls' constant lr 3e-3,
    with a kappa ramp (1 -> 2 -> 3 -> 4 over 128 micro-steps), seeds 0-7;
    the spike before is in docs/batch_size_schedules/controls.
    lr_ramp: the switch 1 -> 4 at 512 with the tuned decay, kappa switched
    at once but the per-update lr ramped from 1x to 4x over 128 micro-steps
    through the lr schedule (the optimizer-side alternative to the ramp).
    spike_causes: the switch 1 -> 4 at 512 with the tuned decay, each arm
    changing one thing at the switch against the no-ramp arm of `cosine`:
    the per-update lr not multiplied (the lr schedule x 1/4 from 512 on),
    beta_2 per update kept at its kappa = 1 value (v averages over 4x the
    examples), beta_1 scaled too (`"power"`: beta_1 0.9 ** 4 per update,
    beta_2 the same as "fixed_beta_1"'s), the bias correction from the
    update count at the new betas (it jumps x1.47 at the switch, where the
    library's products keep kappa = 1's), seeds 0-7.
    cosine_warmups: 1 -> 4 at 512 and 1 -> 2 -> 4 at 512, 1024 with the
    cosine decay at cosine's tuned lr, seeds 0-7, against the kappa = 1
    cosine arm of `cosine`.
    smoke: a few micro-batches, every kind of arm.

    taskset -c 1 python3 scripts/schedule_controls.py --config saved_configs/schedule_cosine.py \
        --variant tune --workdir runs/cosine-tune
"""

TUNED = {"cosine": 6e-3, "wsd": 6e-3}  # kappa = 1: best mean final val_loss of `tune`
DECAY = "wsd"  # the better decay of `tune`: 0.4645 against cosine's 0.4697 (val_loss)
RAMP = 128  # micro-steps: 1 -> 2 at the boundary, 3 at +64, 4 at +128

VARIANTS = ("tune", "cosine", "spike", "lr_ramp", "spike_causes", "cosine_warmups", "smoke")
# 8.5e-3 was added (a second process, `--set '{"learning_rates": [8.5e-3]}'`)
# when 6e-3, the grid's edge, came out best for both decays; it is worse for both.
GRID = [1.5e-3, 2.1e-3, 3e-3, 4.2e-3, 6e-3, 8.5e-3]


def _arms(decay, lr):
    d = {"decay": decay, "learning_rates": [lr]}
    return {
        f"kappa=1 {decay}": {"steps": 1, **d},
        f"1->4 at 512 {decay}": {"steps": [[512], [1, 4]], **d},
        f"1->2->4 at 512, 1024 {decay}": {"steps": [[512, 1024], [1, 2, 4]], **d},
        f"adaptive preconditioned {decay}": {
            "steps": "adaptive",
            "estimate": "adam_preconditioned",
            **d,
        },
        f"1->4 at 512 ramp {decay}": {"steps": [[512], [1, 4]], "ramp": RAMP, **d},
    }


def _causes(decay):
    """1 -> 4 at 512, each arm changing one thing at the switch."""
    d = {"steps": [[512], [1, 4]], "decay": decay}
    return {
        f"1->4 at 512 lr not scaled {decay}": {"lr_scale": 0.25, **d},
        f"1->4 at 512 beta_2 not scaled {decay}": {"beta_forms": ["fixed", "fixed"], **d},
        f"1->4 at 512 power {decay}": {"scaling_rule": "power", **d},
        f"1->4 at 512 count correction {decay}": {"bias_correction": "updates", **d},
    }


def _other(decay):
    other = "cosine" if decay == "wsd" else "wsd"
    return {f"kappa=1 {other}": {"steps": 1, "decay": other, "learning_rates": [TUNED[other]]}}


def get_config(variant="cosine"):
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
        "wsd_decay": 0.2,
        "threads": 1,
        "deterministic": True,
    }
    if variant == "tune":
        config.update(
            seeds=[100, 101, 102],
            learning_rates=GRID,
            arms={
                "kappa=1 cosine": {"steps": 1, "decay": "cosine"},
                "kappa=1 wsd": {"steps": 1, "decay": "wsd"},
            },
        )
    elif variant == "cosine":
        config.update(
            seeds=list(range(8)),
            learning_rates=[TUNED[DECAY]],
            arms={**_arms(DECAY, TUNED[DECAY]), **_other(DECAY)},
        )
    elif variant == "spike":
        config.update(
            seeds=list(range(8)),
            learning_rates=[3e-3],
            arms={"1->4 at 512 ramp": {"steps": [[512], [1, 4]], "ramp": RAMP}},
        )
    elif variant == "lr_ramp":
        config.update(
            seeds=list(range(8)),
            learning_rates=[TUNED[DECAY]],
            arms={
                f"1->4 at 512 lr ramp {DECAY}": {
                    "steps": [[512], [1, 4]],
                    "lr_ramp": RAMP,
                    "decay": DECAY,
                }
            },
        )
    elif variant == "spike_causes":
        config.update(seeds=list(range(8)), learning_rates=[TUNED[DECAY]], arms=_causes(DECAY))
    elif variant == "cosine_warmups":
        arms = _arms("cosine", TUNED["cosine"])
        config.update(
            seeds=list(range(8)),
            learning_rates=[TUNED["cosine"]],
            arms={a: arms[a] for a in ("1->4 at 512 cosine", "1->2->4 at 512, 1024 cosine")},
        )
    else:
        config.update(
            seeds=[0],
            learning_rates=[1e-3],
            train_examples=1024,
            eval_every=256,
            arms={
                "kappa=1 wsd": {"steps": 1, "decay": "wsd"},
                "1->4 at 16 ramp cosine": {
                    "steps": [[16], [1, 4]],
                    "ramp": 32,
                    "decay": "cosine",
                },
                "1->4 at 16 lr ramp": {"steps": [[16], [1, 4]], "lr_ramp": 32},
                "1->4 at 16 lr not scaled wsd": {
                    "steps": [[16], [1, 4]],
                    "lr_scale": 0.25,
                    "decay": "wsd",
                },
                "1->4 at 16 beta_2 not scaled power": {
                    "steps": [[16], [1, 4]],
                    "beta_forms": ["fixed", "fixed"],
                    "scaling_rule": "power",
                },
                "1->4 at 16 count correction": {
                    "steps": [[16], [1, 4]],
                    "bias_correction": "updates",
                },
                "adaptive preconditioned cosine": {
                    "steps": "adaptive",
                    "estimate": "adam_preconditioned",
                    "decay": "cosine",
                },
            },
            verbose=0,
        )
    return config
