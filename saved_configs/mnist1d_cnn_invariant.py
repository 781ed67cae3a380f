"""MNIST-1D CNN trained with InvariantAdam, 4 micro-batches of 32 per update.

Run (the README's main command; ~2-3 minutes on a 2-core CPU):
    python scripts/train.py --config saved_configs/mnist1d_cnn_invariant.py
Smoke variant (tests): get_config(smoke=True), a few seconds.
"""

BASE_LR = 1e-3        # Adam learning rate tuned at kappa = 1, batch 32
STEPS = 4             # micro-batches per update: kappa = 4 on one device


def get_config(smoke=False):
    return {
        "dataset": "mnist1d",
        "model": "cnn",
        "optimizer": "invariant_adam",
        "micro_batch_size": 32,
        "steps": STEPS,
        # Linear rule: lr = BASE_LR * kappa, 1 - beta_i = kappa * (1 - beta_i).
        "scaling_rule": "invariant",
        "learning_rate": BASE_LR,
        "epochs": 2 if smoke else 60,
        "noise_scale_every": 25,
        "seed": 0,
    }
