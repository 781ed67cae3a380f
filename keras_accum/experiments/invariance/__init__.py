"""Batch-size invariance study: training curves versus examples seen.

The claim tested (Wang & Aitchison 2024, arXiv:2402.18824; ALGORITHMS.md
sections 3 and 4): with the micro-batch size fixed, `InvariantAdam` with the
linear rule (lr x kappa, 1 - beta x kappa) gives the same training curve,
as a function of examples seen, whatever the number kappa of micro-batches
per update, for small enough learning rates; standard Adam on the averaged
gradient needs the square-root rule (Malladi et al. 2022), which holds only
when gradient noise dominates.

Every run of a seed starts from the same weights and sees the same stream of
micro-batches; only how the stream is grouped into updates changes. Methods,
from base hyperparameters tuned at kappa = 1:

| method                | optimizer                                            |
|-----------------------|------------------------------------------------------|
| `invariant`           | `InvariantAdam(steps=kappa, **scale(kappa, "invariant"))` |
| `power`               | `InvariantAdam(steps=kappa, **scale(kappa, "power"))` |
| `fixed_beta_1`        | `InvariantAdam(steps=kappa, **scale(kappa, "fixed_beta_1"))` |
| `sqrt`                | `GradientAccumulation(Adam(**scale(kappa, "sqrt")), kappa)` |
| `update_accumulation` | `UpdateAccumulationAdam(base_lr, steps=kappa)` (per-micro-batch rate) |
| `plain`               | `GradientAccumulation(Adam(base_lr), kappa)`, no rescaling |

At kappa = 1 all of them are `keras.optimizers.Adam` (tests/test_invariance.py
checks they give identical numbers), so with `share_kappa1` that run is done
once per (learning rate, seed) and recorded under every method.

Evaluation points are multiples of `eval_every` examples, a multiple of the
largest window (max kappa x micro-batch size): every kappa sits at a window
end there. The *spread* at a point is max - min over kappa of a metric; a
run's spread is its mean over the evaluation points after the start
(examples > 0) and its value at the end.

Speed: one model and one compiled training loop (`tf.function` over a chunk
of micro-batches) per (method, kappa), reused for every learning rate and
seed by resetting the weights and the optimizer state.

Output folder (`run_study(config, workdir)`):

    config.json        the resolved config (re-run it with --config)
    runs.csv           a row per (method, learning_rate, kappa, seed, examples)
    noise_scale.csv    B_simple of the initial and of the trained models
    spread.md          the spread table (Markdown) and the noise scale
    spread_vs_lr.png   spread versus base learning rate, a line per method
    frontier.png       kappa = 8 against kappa = 1 over the seed noise, per
                       method and lr (when the config has both and 2+ seeds)
    curves_lr_*.png    loss versus examples, a panel per method, a line per kappa
    summary.json       run time and counts
"""

from keras_accum.experiments.invariance.config import (
    DEFAULTS,
    METHODS,
    method_optimizer,
    optimizer_hyperparameters,
    resolve_config,
)
from keras_accum.experiments.invariance.report import METRICS, spreads, summarize
from keras_accum.experiments.invariance.study import InvarianceStudy, run_method, run_study
from keras_accum.experiments.run_config import load_config_file
from keras_accum.experiments.study_runner import StudyRunner, load_arrays, micro_batch_indices

__all__ = [
    "DEFAULTS",
    "InvarianceStudy",
    "METHODS",
    "METRICS",
    "StudyRunner",
    "load_arrays",
    "load_config_file",
    "method_optimizer",
    "micro_batch_indices",
    "optimizer_hyperparameters",
    "resolve_config",
    "run_method",
    "run_study",
    "spreads",
    "summarize",
]
