"""Tests of keras_accum.training against numpy references and identities.

Model: one Dense layer (linear regression), per-item loss = mean over the
outputs of the squared error. Tolerance "float32 rounding": the loop runs in
float32 and the references in float64; after a few Adam/SGD updates of
O(0.1) weights the float32 results differ by a few ulps, so
`rtol=1e-5, atol=1e-6` (about 100 ulps of the weights' scale).
"""

import json
import os
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import micro_steps, mirrored_strategy

import keras_accum as ka
from keras_accum import training

FLOAT32 = dict(rtol=1e-5, atol=1e-6)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LR, B1, B2, EPS = 0.05, 0.9, 0.999, 1e-7


def f32(value):
    return float(np.float32(value))


mirrored = mirrored_strategy


def data(items=32, features=3, outputs=2, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(items, features).astype("float32")
    y = x @ rng.randn(features, outputs) + 0.3 * rng.randn(items, outputs)
    return x, y.astype("float32")


def initial(features=3, outputs=2):
    rng = np.random.RandomState(1)
    return [
        rng.randn(features, outputs).astype("float32") * 0.5,
        rng.randn(outputs).astype("float32") * 0.1,
    ]


OPTIMIZERS = {
    "ga_sgd": lambda s: ka.GradientAccumulation(keras.optimizers.SGD(LR), s),
    "ga_adam": lambda s: ka.GradientAccumulation(keras.optimizers.Adam(LR), s),
    "invariant": lambda s: ka.InvariantAdam(LR, steps=s),
    "update": lambda s: ka.UpdateAccumulationAdam(LR, steps=s),
}


def build(strategy, optimizer="ga_sgd", steps=2):
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.set_weights(initial())
        opt = OPTIMIZERS[optimizer](steps)
    return model, opt


def run(optimizer, replicas, steps, dataset, epochs=2, **kwargs):
    strategy = mirrored() if replicas == 2 else tf.distribute.get_strategy()
    model, opt = build(strategy, optimizer, steps)
    training.train(
        model,
        opt,
        kwargs.pop("loss", "mse"),
        dataset,
        strategy=strategy,
        epochs=epochs,
        verbose=0,
        **kwargs,
    )
    return model.get_weights(), opt


# -- numpy references ---------------------------------------------------------


def grad(params, x, y, w=None):
    """Gradient of sum_i w_i l_i / sum_i w_i, l_i (or l_io with a mask of
    y's shape) the squared error averaged over outputs."""
    kernel, bias = params
    w = np.ones(len(x)) if w is None else w
    r = x @ kernel + bias - y
    if w.ndim == 1:  # per-item weights; l_i = mean_o r_io^2
        d = 2 * r / r.shape[1] * w[:, None] / max(w.sum(), 1e-300)
    else:  # token mask: loss sum_io w_io r_io^2 / sum w_io
        d = 2 * r * w / max(w.sum(), 1e-300)
    return [x.T @ d, d.sum(0)]


class Adam:
    """keras.optimizers.Adam's update, float64."""

    def __init__(self):
        self.m = self.v = None
        self.t = 0

    def moments(self, g, g2=None):
        """m, v <- Keras's moment updates with g and g2 (default g**2)."""
        g2 = [a * a for a in g] if g2 is None else g2
        if self.m is None:
            self.m, self.v = [0 * a for a in g], [0 * a for a in g]
        self.m = [m + (a - m) * (1 - B1) for m, a in zip(self.m, g)]
        self.v = [v + (a - v) * (1 - B2) for v, a in zip(self.v, g2)]

    def direction(self, t):
        # As Keras: the bias correction uses float32(beta) ** t, while the
        # moment updates use 1 - beta in float64 (1 - float32(0.999) is
        # 1.3e-5 relative off 0.001, which would show after one step).
        alpha = f32(LR) * np.sqrt(1 - f32(B2) ** t) / (1 - f32(B1) ** t)
        return [alpha * m / (np.sqrt(v) + EPS) for m, v in zip(self.m, self.v)]

    def step(self, params, g):
        self.t += 1
        self.moments(g)
        return [p - d for p, d in zip(params, self.direction(self.t))]


def micro_batches(n, replicas, steps):
    """Item indices of micro-batch [j][r]: replica r gets the r-th
    contiguous share of the global batch and splits it into `steps` parts."""
    share = n // replicas
    return [
        [
            np.arange(r * share + (j * share) // steps, r * share + ((j + 1) * share) // steps)
            for r in range(replicas)
        ]
        for j in range(steps)
    ]


def reference(optimizer, batches, replicas, steps, epochs=2):
    params = [p.astype(np.float64) for p in initial()]
    adam = Adam()
    for x, y in batches * epochs:
        parts = micro_batches(len(x), replicas, steps)
        if optimizer == "ga_sgd":  # one SGD step on the big batch
            params = [p - LR * g for p, g in zip(params, grad(params, x, y))]
        elif optimizer == "ga_adam":  # one Adam step on the big batch
            params = adam.step(params, grad(params, x, y))
        elif optimizer == "invariant":  # mean of g_j and of g_j**2
            gs = [grad(params, x[i], y[i]) for step in parts for i in step]
            adam.t += 1
            adam.moments(
                [np.mean([g[k] for g in gs], 0) for k in (0, 1)],
                [np.mean([g[k] ** 2 for g in gs], 0) for k in (0, 1)],
            )
            params = [p - d for p, d in zip(params, adam.direction(adam.t))]
        else:  # update accumulation: Adam moments every global micro-step
            total = [0 * p for p in params]
            for step in parts:
                i = np.concatenate(step)
                adam.t += 1
                adam.moments(grad(params, x[i], y[i]))
                total = [a + d for a, d in zip(total, adam.direction(adam.t))]
            params = [p - a for p, a in zip(params, total)]
    return params


def assert_close(actual, expected, **tolerance):
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, **(tolerance or FLOAT32))


# -- equivalences -------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["ga_sgd", "ga_adam", "invariant"])
def test_two_replicas_equal_one_replica_equal_numpy(optimizer):
    # kappa = 4 both ways: 2 replicas x 2 micro-steps, 1 replica x 4; the
    # micro-batches are the same quarters of each global batch of 16.
    x, y = data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    two, _ = run(optimizer, 2, 2, dataset)
    one, opt = run(optimizer, 1, 4, dataset)
    batches = [(x[:16], y[:16]), (x[16:], y[16:])]
    expected = reference(optimizer, batches, 1, 4)
    assert int(opt.iterations.numpy()) == 4  # 2 epochs x 2 windows
    assert_close(two, expected)
    assert_close(one, expected)
    assert_close(two, one)


def test_update_accumulation_matches_numpy_per_layout():
    # UpdateAccumulationAdam moves its moments once per GLOBAL micro-step
    # with the replica-mean gradient, so 2 replicas x 2 steps (2 moment
    # updates per window) and 1 replica x 4 steps (4) are different
    # algorithms by definition; each matches its numpy reference.
    x, y = data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    batches = [(x[:16], y[:16]), (x[16:], y[16:])]
    two, _ = run("update", 2, 2, dataset)
    one, _ = run("update", 1, 4, dataset)
    assert_close(two, reference("update", batches, 2, 2))
    assert_close(one, reference("update", batches, 1, 4))


def weighted_data():
    x, y = data(items=22)
    w = np.random.RandomState(2).choice([0.5, 1.0, 2.0], 22)
    # Short last batch: items 16..21, 3 per replica, parts of 1 and 2 items.
    # Items 16 and 19 form global micro-step 0: weight 0, an empty step.
    w[[16, 19]] = 0.0
    return x, y, w.astype("float32")


@pytest.mark.parametrize("last_batch", ["weighted", "drop"])
def test_short_batch_and_sample_weights_equal_big_batch(last_batch):
    x, y, w = weighted_data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(8)
    params, opt = run("ga_adam", 2, 2, dataset, last_batch=last_batch)
    adam = Adam()
    expected = [p.astype(np.float64) for p in initial()]
    ends = [8, 16, 22] if last_batch == "weighted" else [8, 16]
    for _ in range(2):
        for lo, hi in zip([0] + ends, ends):
            expected = adam.step(expected, grad(expected, x[lo:hi], y[lo:hi], w[lo:hi]))
    assert int(opt.iterations.numpy()) == 2 * len(ends)
    assert_close(params, expected)


def test_plain_keras_optimizer_is_one_update_per_batch():
    # A Keras optimizer all-reduces (SUM) the replicas' gradients itself:
    # with the loss divided by the global weight, that is the weighted mean
    # over the whole batch, short batch included.
    x, y, w = weighted_data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(8)
    strategy = mirrored()
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.set_weights(initial())
        opt = keras.optimizers.Adam(LR)
    training.train(model, opt, "mse", dataset, strategy=strategy, epochs=2, verbose=0)
    adam = Adam()
    expected = [p.astype(np.float64) for p in initial()]
    for _ in range(2):
        for lo, hi in [(0, 8), (8, 16), (16, 22)]:
            expected = adam.step(expected, grad(expected, x[lo:hi], y[lo:hi], w[lo:hi]))
    assert int(opt.iterations.numpy()) == 6
    assert_close(model.get_weights(), expected)


def test_logs_metrics_and_evaluation(tmp_path, capsys):
    rng = np.random.RandomState(4)
    x = rng.randn(16, 3).astype("float32")
    labels = rng.randint(0, 3, 16)
    dataset = tf.data.Dataset.from_tensor_slices((x, labels)).batch(8)
    strategy = mirrored()
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3, activation="softmax")])
        opt = OPTIMIZERS["ga_sgd"](2)

    def loss_and_accuracy(xs, ys):
        p = model.predict(xs, verbose=0).astype(np.float64)
        return (-np.log(p[np.arange(len(ys)), ys]).mean(), (p.argmax(1) == ys).mean())

    # Updates happen at window ends, so window 1 is evaluated at the
    # initial weights.
    first = loss_and_accuracy(x[:8], labels[:8])
    history = training.train(
        model,
        opt,
        "sparse_categorical_crossentropy",
        dataset,
        strategy=strategy,
        workdir=str(tmp_path),
        metrics=["accuracy"],
        eval_dataset=dataset,
        verbose=1,
    )
    progress = capsys.readouterr().out
    assert "2/2" in progress and "examples/s" in progress
    final = loss_and_accuracy(x, labels)
    with open(tmp_path / "log.jsonl") as f:
        lines = [json.loads(line) for line in f]
    assert len(lines) == 3 and lines[2]["epoch_end"]
    np.testing.assert_allclose(lines[0]["loss"], first[0], rtol=1e-6)
    np.testing.assert_allclose(lines[0]["accuracy"], first[1])
    assert lines[0]["items"] == 8 and lines[1]["updates"] == 2
    assert lines[0]["learning_rate"] == f32(LR)
    assert lines[0]["skipped_micro_batches"] == 0
    np.testing.assert_allclose(history["val_loss"], [final[0]], rtol=1e-6)
    np.testing.assert_allclose(history["val_accuracy"], [final[1]])
    assert history["loss"] == [np.mean([lines[0]["loss"], lines[1]["loss"]])]
    tags = set()
    for path in (tmp_path / "tensorboard").iterdir():
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            tags.update(v.tag for v in event.summary.value)
    assert {
        "loss",
        "accuracy",
        "learning_rate",
        "updates",
        "skipped_micro_batches",
        "examples_per_second",
        "epoch/val_loss",
    } <= tags
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    assert (config["global_batch_size"], config["micro_batch_size"], config["replicas"]) == (
        8,
        2,
        2,
    )


def test_token_mask_equals_masked_big_batch():
    # A per-token loss (n, 2) with a mask of the same shape: the count is the
    # number of unmasked tokens, summed over replicas.
    x, y = data(items=22)
    mask = (np.random.RandomState(3).rand(22, 2) > 0.3).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y, mask)).batch(8)
    params, _ = run("ga_sgd", 2, 2, dataset, loss=lambda t, p: tf.square(p - t))
    expected = [p.astype(np.float64) for p in initial()]
    for _ in range(2):
        for lo, hi in [(0, 8), (8, 16), (16, 22)]:
            g = grad(expected, x[lo:hi], y[lo:hi], mask[lo:hi])
            expected = [p - LR * d for p, d in zip(expected, g)]
    assert_close(params, expected)


def test_short_batch_warns_for_optimizers_without_weights():
    x, y = data(items=20)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    with pytest.warns(UserWarning, match="short batch"):
        run("invariant", 2, 2, dataset, epochs=1)


# -- the compiled step --------------------------------------------------------


def test_step_traces_once():
    x, y, w = weighted_data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(8)
    strategy = mirrored()
    model, opt = build(strategy)
    trainer = training.Trainer(model, opt, "mse", strategy=strategy)
    iterator = iter(trainer.distribute(dataset, epochs=3))
    calls = 0
    with pytest.raises(tf.errors.OutOfRangeError):
        while True:
            trainer.train_step(iterator)
            calls += 1
    # 3 epochs x (2 full + 1 short batch + the end-of-epoch marker).
    assert calls == 12
    assert int(opt.iterations.numpy()) == 9
    assert trainer.train_step.experimental_get_tracing_count() == 1


@pytest.mark.parametrize(
    "optimizer,steps,per_window",
    [
        ("ga_sgd", 2, 1),
        ("ga_sgd", 4, 1),  # one all-reduce per window
        ("invariant", 2, 2),
        ("invariant", 4, 2),  # m, v: see below
        ("update", 2, 2),
        ("update", 4, 4),  # one per micro-step
    ],
)
def test_gradient_all_reduces_per_window(optimizer, steps, per_window, monkeypatch):
    # Counts, at run time, the tensors that go through a cross-device
    # reduction, split into kernel-shaped ones (a gradient or gradient-sized
    # state: the expensive all-reduces) and the rest. The counter increment
    # is built into the graph next to each reduction, inside the same
    # cond/while branch, so it counts executions, not the copies a traced
    # graph holds (a static count of ops in `concrete_function.graph` would
    # see the window-end branch of every micro-step's cond). The strategy
    # reduces with ReductionToOneDevice, which every reduction then goes
    # through: TF also uses a fresh ReductionToOneDevice to read
    # sync-on-read variables onto CPUs, so patching the class (not an
    # instance passed as `cross_device_ops`) sees those reads too.
    kernel_shape = (3, 2)
    gradient_sized = tf.Variable(0, dtype=tf.int64)
    others = tf.Variable(0, dtype=tf.int64)
    reduce = tf.distribute.ReductionToOneDevice.reduce_implementation

    def counting(self, reduce_op, per_replica_value, destinations, options):
        value = getattr(per_replica_value, "values", [per_replica_value])[0]
        kernel_sized = tuple(value.shape) == kernel_shape
        (gradient_sized if kernel_sized else others).assign_add(1)
        return reduce(self, reduce_op, per_replica_value, destinations, options)

    monkeypatch.setattr(tf.distribute.ReductionToOneDevice, "reduce_implementation", counting)
    strategy = tf.distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    x, y = data(items=32)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).take(1)
    model, opt = build(strategy, optimizer, steps)
    trainer = training.Trainer(model, opt, "mse", strategy=strategy)
    iterator = iter(trainer.distribute(dataset, epochs=3))
    for _ in range(3):
        trainer.train_step(iterator)  # one window
        trainer.train_step(iterator)  # the end-of-epoch marker
    assert int(opt.iterations.numpy()) == 3
    # InvariantAdam: reading m and v once per window (2), whatever steps;
    # writing them back spread over the replicas reads nothing back.
    assert int(gradient_sized.numpy()) == 3 * per_window
    if optimizer == "ga_sgd":
        # The small ones: every step call all-reduces the loop's item counts
        # and its logs (2 x 6 calls); each window also reduces the bias
        # gradient (with the kernel's, in the same batch all-reduce) and
        # reads GradientAccumulation's weight total once: 3 x 2.
        assert int(others.numpy()) == 2 * 6 + 3 * 2


# -- checkpoints --------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["ga_adam", "invariant", "update"])
def test_mid_window_checkpoint_restores_accumulators(optimizer, tmp_path):
    # Micro-step API: one global micro-batch per call, steps=3 per window.
    # Save after 4 micro-steps (window 2 is 1/3 done), restore into a fresh
    # model and optimizer, continue to 9. The replica-local accumulators are
    # saved as their sum and restored split evenly, so the result equals the
    # uninterrupted run to float32 rounding (the summation order changes).
    x, y = data(items=36)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    strategy = mirrored()

    def fresh():
        model, opt = build(strategy, optimizer, steps=3)
        return training.Trainer(model, opt, "mse", strategy=strategy)

    uninterrupted = fresh()
    micro_steps(uninterrupted, dataset, 9)
    first = fresh()
    micro_steps(first, dataset, 4)
    assert int(first.optimizer.micro_step.numpy()) % 3 == 1
    first.save(str(tmp_path))
    resumed = fresh()
    assert resumed.restore(str(tmp_path))
    assert int(resumed.batches.numpy()) == 4
    micro_steps(resumed, dataset, 5)
    assert int(resumed.optimizer.iterations.numpy()) == 3
    assert_close(resumed.model.get_weights(), uninterrupted.model.get_weights())
    # And the numpy reference. Micro-step j holds items 4j..4j+3, 2 per
    # replica: as a window of 12 items that is the layout of 1 replica x 3
    # steps for the global micro-steps (UpdateAccumulationAdam) and the same
    # six 2-item micro-batches as 2 replicas x 3 steps (InvariantAdam).
    replicas = 1 if optimizer == "update" else 2
    windows = [(x[i : i + 12], y[i : i + 12]) for i in (0, 12, 24)]
    assert_close(resumed.model.get_weights(), reference(optimizer, windows, replicas, 3, epochs=1))


def job(workdir, *args, **popen):
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    command = [
        sys.executable,
        os.path.join(ROOT, "tests", "_train_job.py"),
        "--workdir",
        str(workdir),
        "--replicas",
        "2",
        *args,
    ]
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen
    )


def test_killed_run_resumes_to_the_same_weights(tmp_path):
    # 44 items, batches of 8 (the last one short), reshuffled every epoch
    # with a fixed seed, 3 epochs: 18 windows. The killed run is SIGKILLed
    # at some point after its checkpoint at window 6, then restarted.
    reference_run = job(tmp_path / "reference")
    killed = job(tmp_path / "killed", "--sleep", "0.5")
    checkpoints = tmp_path / "killed" / "checkpoints"
    deadline = time.monotonic() + 120
    while not (checkpoints / "ckpt-6.index").exists():  # window 6 of epoch 1
        assert killed.poll() is None, killed.stdout.read()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    killed.kill()
    killed.wait()
    assert not (tmp_path / "killed" / "final.npz").exists()
    restarted = job(tmp_path / "killed")
    for process in (reference_run, restarted):
        out, _ = process.communicate(timeout=240)
        assert process.returncode == 0, out
    # Bit for bit: same ops in the same order on the same devices, with op
    # determinism on; the replayed data pipeline gives the same batches.
    expected = np.load(tmp_path / "reference" / "final.npz")
    actual = np.load(tmp_path / "killed" / "final.npz")
    for name in expected:
        np.testing.assert_array_equal(actual[name], expected[name])
    # The log keeps one line per window (those after the checkpoint were
    # dropped on restart and logged again).
    with open(tmp_path / "killed" / "log.jsonl") as f:
        lines = [json.loads(line) for line in f]
    windows = [line["batches"] for line in lines if "epoch_end" not in line]
    assert windows == list(range(1, 19))
    assert [line["epoch"] for line in lines if "epoch_end" in line] == [1, 2, 3]


def trained_trainer(strategy, optimizer="invariant", windows=2):
    x, y = data(items=16)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    model, opt = build(strategy, optimizer, steps=2)
    trainer = training.Trainer(model, opt, "mse", strategy=strategy)
    iterator = iter(trainer.distribute(dataset, epochs=2))
    for _ in range(windows):
        trainer.train_step(iterator)
    trainer.test_iterator = iterator
    return trainer


def test_truncated_newest_checkpoint_falls_back_and_is_named(tmp_path):
    # Two checkpoints; the newest one's data file cut in half (a disk or a
    # writer without rename). Restore uses the older one and names the
    # broken one; with both broken, the error names them.
    strategy = tf.distribute.get_strategy()
    trainer = trained_trainer(strategy, windows=1)
    older = trainer.save(str(tmp_path))
    trainer.train_step(trainer.test_iterator)
    newer = trainer.save(str(tmp_path))
    assert older.endswith("ckpt-1") and newer.endswith("ckpt-2")
    (data_file,) = tmp_path.glob("ckpt-2.data-*")
    data_file.write_bytes(data_file.read_bytes()[: data_file.stat().st_size // 2])
    fresh = trained_trainer(strategy, windows=0)
    with pytest.warns(UserWarning, match="ckpt-2 is not a complete checkpoint"):
        assert fresh.restore(str(tmp_path)) == older
    assert int(fresh.batches.numpy()) == 1
    for w, v in zip(fresh.model.get_weights(), trainer.model.get_weights()):
        assert not np.array_equal(w, v)  # the older state, not the newer
    (tmp_path / "ckpt-1.index").write_bytes(b"not a checkpoint")
    with pytest.raises(training.CheckpointError, match="ckpt-2.*ckpt-1"):
        fresh.restore(str(tmp_path))


def test_mirrored_checkpoint_resumes_bit_exact(tmp_path):
    # InvariantAdam's moments are replica-local: a checkpoint holds their
    # sum and a plain restore splits it evenly. The parts saved beside it
    # restore each replica's own values, so the resumed run is bit-exact.
    strategy = mirrored()
    first = trained_trainer(strategy, windows=1)
    first.save(str(tmp_path))
    x, y = data(items=16)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    resumed = trained_trainer(strategy, windows=0)
    assert resumed.restore(str(tmp_path))
    for a, b in zip(first.optimizer._momentums, resumed.optimizer._momentums):
        for p, q in zip(a.value.values, b.value.values):
            np.testing.assert_array_equal(p.numpy(), q.numpy())
    for trainer in (first, resumed):
        trainer.train_step(iter(trainer.distribute(dataset, epochs=2)))
    for a, b in zip(first.model.get_weights(), resumed.model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_foreign_and_truncated_keras_files_are_named(tmp_path):
    from keras_accum.training import checkpoints

    model, _ = build(tf.distribute.get_strategy(), "ga_sgd", 2)
    model.compile(optimizer=keras.optimizers.SGD(), loss="mse")
    checkpoints.save_keras(model, str(tmp_path / "epoch_001.keras"), {"epoch": 1})
    loaded, state = checkpoints.load_keras(str(tmp_path / "epoch_001.keras"))
    assert state == {"epoch": 1}
    assert_close(loaded.get_weights(), model.get_weights(), rtol=0, atol=0)
    (tmp_path / "epoch_002.keras").write_bytes(b"PK\x03\x04 truncated")
    with pytest.warns(UserWarning, match="epoch_002.keras is not a complete"):
        assert checkpoints.newest_keras(str(tmp_path)).endswith("epoch_001.keras")
    (tmp_path / "epoch_001.keras").write_text("hello")
    with pytest.raises(training.CheckpointError, match="epoch_002.keras.*epoch_001.keras"):
        checkpoints.newest_keras(str(tmp_path))


def test_kill_inside_a_write_keeps_the_previous_file(tmp_path):
    # The hook truncates the second write's temporary file and SIGKILLs the
    # process before the rename: the file keeps the first version, and the
    # leftover is removed by the next writer.
    script = (
        "import sys\n"
        "from keras_accum.training import checkpoints\n"
        "checkpoints.atomic_write_text(sys.argv[1], 'first')\n"
        "checkpoints.atomic_write_text(sys.argv[1], 'second' * 1000)\n"
    )
    target = tmp_path / "state.txt"
    env = dict(os.environ, PYTHONPATH=ROOT, KERAS_ACCUM_CHECKPOINT_HOOK="kill:2")
    result = subprocess.run([sys.executable, "-c", script, str(target)], env=env, timeout=120)
    assert result.returncode == -9
    assert target.read_text() == "first"
    from keras_accum.training import checkpoints

    assert len(list(tmp_path.glob(".state.txt.tmp-*"))) == 1
    checkpoints.remove_partial(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.txt"]


def test_kill_between_writes_and_a_failed_write(tmp_path):
    # after:<n> kills just after the n-th write is complete, before the
    # next starts; a block that raises leaves the old file and no leftover.
    script = (
        "import sys\n"
        "from keras_accum.training import atomic\n"
        "atomic.atomic_write_text(sys.argv[1] + '.a', 'a')\n"
        "atomic.atomic_write_text(sys.argv[1] + '.b', 'b')\n"
    )
    target = tmp_path / "state"
    env = dict(os.environ, PYTHONPATH=ROOT, KERAS_ACCUM_CHECKPOINT_HOOK="after:1")
    result = subprocess.run([sys.executable, "-c", script, str(target)], env=env, timeout=120)
    assert result.returncode == -9
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.a"]
    from keras_accum.training import atomic

    with pytest.raises(RuntimeError):
        with atomic.replacing(tmp_path / "state.a") as f:
            f.write("half")
            raise RuntimeError("disk full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.a"]
    assert (tmp_path / "state.a").read_text() == "a"


def test_logs_rewind_to_the_checkpoint(tmp_path):
    from keras_accum.training import logs

    csv_path = tmp_path / "metrics.csv"
    csv_path.write_text("epoch,loss\n0,1.5\n1,1.25\n2,1.0\n3,0.")
    logs.rewind_csv(str(csv_path), lambda row: int(row["epoch"]) < 2)
    assert csv_path.read_text().splitlines() == ["epoch,loss", "0,1.5", "1,1.25"]
    jsonl = tmp_path / "log.jsonl"
    jsonl.write_text('{"batches": 1}\n{"batches": 2}\n{"batches": 3}\n{"batc')
    assert logs.rewind_jsonl(str(jsonl), lambda r: r["batches"] <= 2) == [
        {"batches": 1},
        {"batches": 2},
    ]
    for run in range(2):  # two processes, two event files, steps 0-2 each
        with tf.summary.create_file_writer(str(tmp_path / "tb")).as_default():
            for step in range(3):
                tf.summary.scalar("loss", 10.0 * run + step, step=step)
        time.sleep(1.1)  # event file names hold the time in seconds
    logs.rewind_events(str(tmp_path / "tb"), lambda tag, step, seen: seen < 4)
    (path,) = (tmp_path / "tb").iterdir()
    values = [
        (e.step, float(tf.make_ndarray(v.tensor)))
        for e in logs._events(str(path))
        for v in e.summary.value
    ]
    assert values == [(0, 0.0), (1, 1.0), (2, 2.0), (0, 10.0)]


@pytest.mark.parametrize("source", ["arrays", "reshuffled dataset"])
def test_noise_scale_callback_state_round_trip(source):
    # A fresh callback given the state after one probe makes the same
    # second probe as the callback that ran on.
    from keras_accum import diagnostics

    x, y = data(items=16)

    def probe_data():
        if source == "arrays":
            return (x, y)
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(16, seed=1).batch(8)

    callbacks = [diagnostics.NoiseScaleCallback(probe_data(), 4, 2, 1, seed=3) for _ in range(2)]
    for callback in callbacks:
        callback.set_model(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
        callback.model.compile(loss="mse")
        callback.model.set_weights(initial())
    callbacks[0].on_train_batch_end(0)
    callbacks[1].set_state(json.loads(json.dumps(callbacks[0].get_state())))
    for callback in callbacks:
        callback.on_train_batch_end(1)
    assert callbacks[0].get_state() == callbacks[1].get_state()
    assert callbacks[1].get_state()["updates"] == 2


# -- bad input ----------------------------------------------------------------


def bad(match, dataset=None, **kwargs):
    x, y = data()
    strategy = kwargs.pop("strategy", None) or mirrored()
    model, opt = kwargs.pop("built", None) or build(strategy, "ga_sgd", 2)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=match):
        training.train(
            model,
            opt,
            kwargs.pop("loss", "mse"),
            dataset or tf.data.Dataset.from_tensor_slices((x, y)).batch(16),
            strategy=strategy,
            verbose=0,
            **kwargs,
        )
    assert_close(model.get_weights(), before, rtol=0, atol=0)
    assert int(opt.iterations.numpy()) == 0


def test_micro_batch_size_must_divide_per_replica_batch():
    bad(r"micro_batch_size.*per-replica batch size 8.*micro_batch_size=3", micro_batch_size=3)


def test_micro_batch_size_must_match_optimizer_steps():
    bad(r"gives 4 micro-batches.*steps=2.*micro_batch_size=2", micro_batch_size=2)


def test_steps_and_micro_batch_size_not_both():
    bad(r"not both.*steps=2, micro_batch_size=4", steps=2, micro_batch_size=4)


def test_steps_must_match_optimizer():
    bad(r"`steps` must equal.*Received: steps=3", steps=3)


def test_per_replica_batch_not_divisible_by_steps():
    x, y = data()
    bad(r"per-replica batch size 3 .*steps=2", tf.data.Dataset.from_tensor_slices((x, y)).batch(6))


def test_optimizer_created_outside_strategy_scope():
    strategy = mirrored()
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    opt = OPTIMIZERS["ga_sgd"](2)
    bad(
        r"outside `strategy.scope\(\)`.*Received: optimizer=", strategy=strategy, built=(model, opt)
    )


def test_inner_optimizer_created_outside_strategy_scope():
    strategy = mirrored()
    inner = keras.optimizers.SGD(0.1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        opt = ka.GradientAccumulation(inner, 2)
    bad(
        r"outside `strategy.scope\(\)`.*Received: optimizer=<.*SGD",
        strategy=strategy,
        built=(model, opt),
    )


def test_model_created_outside_strategy_scope():
    strategy = mirrored()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with strategy.scope():
        opt = OPTIMIZERS["ga_sgd"](2)
    bad(r"`model` variable .* outside `strategy.scope\(\)`", strategy=strategy, built=(model, opt))


def test_empty_dataset():
    x, y = data()
    bad(r"`dataset` is empty", tf.data.Dataset.from_tensor_slices((x, y)).take(0).batch(16))


def test_infinite_dataset():
    x, y = data()
    bad(r"must be finite", tf.data.Dataset.from_tensor_slices((x, y)).batch(16).repeat())


def test_reduced_loss_is_refused():
    bad(
        r"per-item values, not a reduced scalar", loss=lambda t, p: tf.reduce_mean(tf.square(p - t))
    )


def test_bad_last_batch_and_epochs():
    bad(r"last_batch=.*'pad'", last_batch="pad")
    bad(r"Received: epochs=0", epochs=0)


# -- a checkpoint of the previous layout -----------------------------------------

PREVIOUS = os.path.join(ROOT, "tests", "fixtures", "checkpoint_before_window_state")


def test_a_checkpoint_of_the_previous_layout_restores_every_counter():
    """The fixture is a `tf.train.Checkpoint(model=, optimizer=)` written by
    the layout before `WindowState` (e589083, Keras 3.15.1), whose counters
    were optimizer attributes (`optimizer/_micro_step/...`): a model
    `Dense(2)` on inputs of 3 (seed 0), `InvariantAdam(1e-2,
    steps=PiecewiseSteps([3], [2, 3]))`, `fit` on 20 rows of
    `RandomState(0).randn(20, 3)` (row 9 NaN) at batch 4, inside a window:
    micro_step 5, one skipped micro-batch, window of 3 ending at 7. Every
    saved object is matched and every variable comes back as saved."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = ka.InvariantAdam(1e-2, steps=ka.PiecewiseSteps([3], [2, 3]))
    optimizer.build(model.trainable_variables)
    for variable in optimizer.variables:  # nothing left from the build
        variable.assign(tf.ones(variable.shape, variable.dtype) * 9)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    checkpoint.read(os.path.join(PREVIOUS, "checkpoint")).assert_consumed()
    with open(os.path.join(PREVIOUS, "optimizer_values.json")) as f:
        saved = json.load(f)
    # [path, value] in creation order (the slots' paths name the model's
    # layers, which depend on what this process built before).
    assert len(saved) == len(optimizer.variables)
    counters = [path for path, _ in saved[:8]]
    assert counters == [v.path for v in optimizer.variables[:8]]
    assert "invariant_adam/micro_step" in counters and "invariant_adam/window_end" in counters
    for (_, value), variable in zip(saved, optimizer.variables):
        np.testing.assert_array_equal(variable.numpy(), np.asarray(value))
    assert int(optimizer.micro_step) == 5
    assert int(optimizer.skipped_micro_batches) == 1
    assert int(optimizer.window_steps) == 3 and optimizer.pending_micro_batches() == 1
