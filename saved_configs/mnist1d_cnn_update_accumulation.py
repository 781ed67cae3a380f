"""MNIST-1D CNN with UpdateAccumulationAdam, 4 micro-batches of 25 per update.

Run (~2 minutes on a 2-core CPU):
    python scripts/train.py --config saved_configs/mnist1d_cnn_update_accumulation.py
Smoke variant (tests): get_config(smoke=True).

The learning rate is a per-micro-batch Adam rate: each update applies the sum
of STEPS Adam steps, so it is NOT scaled with kappa (scaling_rule=None).
"""

STEPS = 4


def get_config(smoke=False):
    return {
        "dataset": "mnist1d",
        "model": "cnn",
        "optimizer": "update_accumulation_adam",
        "micro_batch_size": 25,
        "steps": STEPS,
        "learning_rate": 5e-3,  # per micro-batch: ~4 x 5e-3 per update
        "scaling_rule": None,
        "epochs": 2 if smoke else 60,
        "seed": 0,
    }
