"""`pip install keras_accum[jax]` brings no TensorFlow, and that is enough:
the package imports and trains under JAX where `import tensorflow` fails.

Offline, from this machine's own distributions: a child `python -S` (no
site-packages) whose PYTHONPATH is a folder of links to the dependency
closure of setup.cfg's `install_requires` plus the `jax` extra (each
distribution's `Requires-Dist`, followed) and to this checkout's
`keras_accum`. Were TensorFlow back among the requirements, it would be in
the closure and the child's `import tensorflow` would succeed. The child
sets KERAS_BACKEND=jax itself, so this runs under every backend.
"""

import configparser
import importlib.metadata as metadata
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

CHILD = r"""
import sys
import numpy as np

try:
    import tensorflow
except ModuleNotFoundError as error:
    assert error.name == "tensorflow", error
else:
    sys.exit(f"tensorflow imported from {tensorflow.__file__}")

import keras
import keras_accum as ka

assert keras.backend.backend() == "jax", keras.backend.backend()
assert ka.__file__.startswith(sys.argv[1]), ka.__file__  # the checkout, via the links
rng = np.random.default_rng(0)
x = rng.normal(size=(32, 5)).astype("float32")
y = (x @ rng.normal(size=(5, 1))).astype("float32")


def trained(optimizer, batch_size):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse")
    before = model.evaluate(x, y, batch_size=32, verbose=0)
    model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    after = model.evaluate(x, y, batch_size=32, verbose=0)
    return model, before, after


for name, optimizer in [
    ("GradientAccumulation", ka.GradientAccumulation(keras.optimizers.Adam(0.01), 4)),
    ("InvariantAdam", ka.InvariantAdam(0.01, steps=4)),
    ("UpdateAccumulationAdam", ka.UpdateAccumulationAdam(0.01, steps=4)),
]:
    model, before, after = trained(optimizer, 4)
    # 2 epochs of 8 micro-batches of 4, in windows of 4: 4 updates.
    print(name, int(optimizer.iterations), int(optimizer.micro_step), before, after)
    if name == "GradientAccumulation":
        # The identity it exists for: Adam on the windows' 16 examples at once.
        big, _, _ = trained(keras.optimizers.Adam(0.01), 16)
        for mine, theirs in zip(model.get_weights(), big.get_weights()):
            np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)
print(sorted(n for n in sys.modules if n.split(".")[0] == "tensorflow"))
"""


def _name(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(requirements):
    """The installed distributions `requirements` need, recursively."""
    from packaging.requirements import Requirement

    found, todo, done = {}, [(r, "") for r in requirements], set()
    while todo:
        requirement, extra = todo.pop()
        if (_name(requirement.name), extra) in done:
            continue
        done.add((_name(requirement.name), extra))
        dist = metadata.distribution(requirement.name)  # PackageNotFoundError: fails
        found[_name(requirement.name)] = dist
        for line in dist.requires or []:
            needed = Requirement(line)
            if needed.marker is None or needed.marker.evaluate({"extra": extra}):
                todo += [(needed, "")] + [(needed, e) for e in needed.extras]
    return found


def _link(source, target):
    """Links `source` at `target`; a folder two distributions share (a
    namespace package) becomes a real folder of links to both."""
    if not target.exists():
        target.symlink_to(source)
    elif source.is_dir() and target.is_dir():
        if target.is_symlink():
            first = target.resolve()
            target.unlink()
            target.mkdir()
            for child in first.iterdir():
                _link(child, target / child.name)
        for child in source.iterdir():
            _link(child, target / child.name)


def test_imports_and_trains_under_jax_without_tensorflow(tmp_path):
    if importlib.util.find_spec("jax") is None:
        pytest.skip("jax is not installed (pip install keras_accum[jax]; .ci/backends installs it)")
    from packaging.requirements import Requirement

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = config["options"]["install_requires"].split()
    lines += config["options.extras_require"]["jax"].split()
    dists = _closure([Requirement(line) for line in lines])
    assert "jax" in dists and "keras" in dists, sorted(dists)
    assert "tensorflow" not in dists, sorted(dists)

    links = tmp_path / "links"
    links.mkdir()
    for dist in dists.values():
        assert dist.files is not None, f"{dist.metadata['Name']} lists no files (no RECORD)"
        tops = {pathlib.PurePath(f).parts[0] for f in dist.files}
        for top in sorted(tops - {"..", "__pycache__"}):
            source = pathlib.Path(dist.locate_file(top))
            if source.exists():
                _link(source, links / top)
    (links / "keras_accum").symlink_to(ROOT / "keras_accum")

    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),  # Keras writes ~/.keras/keras.json there
        "PYTHONPATH": str(links),
        "KERAS_BACKEND": "jax",
        "JAX_PLATFORMS": "cpu",
    }
    run = subprocess.run(
        [sys.executable, "-S", "-c", CHILD, str(links)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    *trained, modules = run.stdout.strip().splitlines()
    assert modules == "[]", run.stdout  # not even a part of TensorFlow
    assert [line.split()[0] for line in trained] == [
        "GradientAccumulation",
        "InvariantAdam",
        "UpdateAccumulationAdam",
    ], run.stdout
    for line in trained:
        name, iterations, micro_steps, before, after = line.split()
        assert (int(iterations), int(micro_steps)) == (4, 16), line
        assert float(after) < float(before), line
