"""MNIST-1D CNN with GradientAccumulation(AdamW), 4 micro-batches of 25.

Run (~2 minutes on a 2-core CPU):
    python scripts/train.py --config saved_configs/mnist1d_cnn_gradient_accumulation.py
Smoke variant (tests): get_config(smoke=True).

Exactly AdamW at batch 100 = 4 x 25; the hyperparameters are scaled from a
batch-25 base with the square-root rule (Malladi et al.) for standard Adam.
"""

BASE_LR = 5e-3  # at kappa = 1: becomes 1e-2 at kappa = 4, the MNIST-1D paper's Adam rate
STEPS = 4


def get_config(smoke=False):
    return {
        "dataset": "mnist1d",
        "model": "cnn",
        "optimizer": "gradient_accumulation",
        "inner_optimizer": "adamw",
        "weight_decay": 1e-4,
        "micro_batch_size": 25,
        "steps": STEPS,
        # lr = BASE_LR * sqrt(kappa), 1 - beta_i = kappa (1 - beta_i),
        # epsilon / sqrt(kappa).
        "scaling_rule": "sqrt",
        "learning_rate": BASE_LR,
        "epochs": 2 if smoke else 60,
        "seed": 0,
    }
