"""MNIST-1D CNN with GradientAccumulation(AdamW), 4 micro-batches of 32.

Run (~2 minutes on a 2-core CPU):
    python scripts/train.py --config saved_configs/mnist1d_cnn_gradient_accumulation.py
Smoke variant (tests): get_config(smoke=True).

Exactly AdamW at batch 128 = 4 x 32; the hyperparameters are scaled from a
batch-32 base with the square-root rule (Malladi et al.) for standard Adam.
"""

BASE_LR = 1e-3
STEPS = 4


def get_config(smoke=False):
    return {
        "dataset": "mnist1d",
        "model": "cnn",
        "optimizer": "gradient_accumulation",
        "inner_optimizer": "adamw",
        "weight_decay": 1e-4,
        "micro_batch_size": 32,
        "steps": STEPS,
        # lr = BASE_LR * sqrt(kappa), 1 - beta_i = kappa (1 - beta_i),
        # epsilon / sqrt(kappa).
        "scaling_rule": "sqrt",
        "learning_rate": BASE_LR,
        "epochs": 2 if smoke else 60,
        "seed": 0,
    }
