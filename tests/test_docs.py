"""The README and the guides: their code runs, their commands are the ones CI
runs, and the numbers the README repeats agree with the files they come
from. The Sphinx build (`.ci/run`) checks that every public name has a
page; here, without Sphinx, that every public name has a docstring."""

import importlib.util
import os
import re
import statistics
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "docs", "_ext"))

import public_api  # noqa: E402

README = os.path.join(ROOT, "README.md")
GUIDES = os.path.join(ROOT, "docs", "guides")

MAIN_COMMAND = (
    "python3 -m pip install -q -e '.[experiments]' && "
    "python3 scripts/train.py --config saved_configs/mnist1d_cnn_invariant.py"
)
HUB_GUIDE = os.path.join("docs", "guides", "keras_hub.md")
TEST_COMMAND = "python3 -m pip install -q -e '.[test]' && python3 -m pytest -q"


def _read(*parts):
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def _runnable_blocks(text):
    """The ```python blocks marked `<!-- runnable -->` on the line before, as
    (module, code): `<!-- runnable needs=keras_hub -->` names a module of an
    optional extra without which the block is skipped (module "" if none)."""
    return re.findall(r"<!-- runnable(?: needs=([\w.]+))? -->\n```python\n(.*?)```", text, re.S)


def _checked(text, name):
    """The text between `<!-- check:NAME -->` and `<!-- /check -->`."""
    found = re.findall(rf"<!-- check:{name} -->(.*?)<!-- /check -->", text)
    assert len(found) == 1, f"README: expected one check:{name} marker, found {len(found)}"
    return found[0]


def test_readme_holds_the_two_commands_and_ci_runs_the_test_command():
    readme = _read("README.md")
    assert f"```bash\n{MAIN_COMMAND}\n```" in readme
    assert f"```bash\n{TEST_COMMAND}\n```" in readme
    assert TEST_COMMAND in _read(".ci", "run").split("\n")


@pytest.mark.parametrize(
    "page",
    ["README.md"] + sorted(os.path.join("docs", "guides", f) for f in os.listdir(GUIDES)),
)
def test_runnable_blocks_run(page, capsys):
    blocks = _runnable_blocks(_read(page))
    if page == "README.md":
        assert blocks, "the README's ten-line example lost its runnable marker"
    if page == HUB_GUIDE:
        assert [needs for needs, _ in blocks] == ["keras_hub"], "the keras-hub example's marker"
    for needs, block in blocks:
        if needs and importlib.util.find_spec(needs) is None:
            pytest.skip(f"{page}: its example needs {needs}, not installed (see its page)")
        exec(compile(block, f"{page} (runnable block)", "exec"), {"__name__": "__doc__"})
    if page == "README.md":
        # The example's comment says 8 updates.
        assert capsys.readouterr().out.strip().endswith("8 updates")
    if page == HUB_GUIDE:
        # Its comments: 5 micro-batches restored, 2 updates at the end.
        out = capsys.readouterr().out
        assert "\n5 micro-batches\n" in out and out.strip().endswith("2 updates")


def test_hub_guide_names_the_hub_extras_keras_hub():
    pin = re.search(r"^\s+keras-hub==(\d+\.\d+)\.\*$", _read("setup.cfg"), re.M).group(1)
    named = re.findall(r"keras-hub (\d+\.\d+)", _read(HUB_GUIDE))
    assert named and set(named) == {pin}


def test_readme_pitfall_count_is_the_number_of_rows_of_pitfalls():
    rows = re.findall(r"^\| (\d+) \|", _read("docs", "PITFALLS.md"), re.M)
    assert [int(r) for r in rows] == list(range(1, len(rows) + 1))
    assert int(_checked(_read("README.md"), "pitfalls")) == len(rows)


def test_readme_accuracy_is_the_mean_of_the_seeds_table():
    table = _read("docs", "guides", "main_job.md")
    table = table.split("<!-- seeds:main -->")[1].split("<!-- /seeds:main -->")[0]
    seeds = [float(a) for a in re.findall(r"^\| \d+ \| ([\d.]+)% \|", table, re.M)]
    mean, std = re.search(r"\*\*([\d.]+)% \+- ([\d.]+)\*\*", table).groups()
    assert len(seeds) == 5
    # The table's mean row is the mean of its rows (to the table's rounding).
    assert abs(statistics.mean(seeds) - float(mean)) <= 0.051
    assert abs(statistics.stdev(seeds) - float(std)) <= 0.051
    assert _checked(_read("README.md"), "seeds-mean") == f"{mean}% +- {std}"


def test_readme_floors_are_setup_cfg_floors():
    setup = _read("setup.cfg")
    readme = " ".join(_read("README.md").split())
    python = re.search(r"python_requires = >=([\d.]+)", setup).group(1)
    tensorflow = re.search(r"tensorflow>=([\d.]+)", setup).group(1)
    keras = re.search(r"keras>=([\d.]+)", setup).group(1)
    assert f"Python >= {python}; TensorFlow >= {tensorflow} and Keras >= {keras}" in readme
    from keras_accum import _floor

    assert _floor.KERAS_FLOOR == keras
    testing = " ".join(_read("docs", "guides", "testing.md").split())
    assert f"Keras {keras} with TensorFlow {tensorflow} (the floor tests)" in testing


def test_readme_links_resolve():
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", _read("README.md")):
        assert os.path.exists(os.path.join(ROOT, target)), target


def test_every_public_name_has_a_docstring():
    assert public_api.undocumented() == []


def test_api_page_lists_every_public_module():
    listed = re.findall(r"^   (keras_accum[\w.]*)$", _read("docs", "api.rst"), re.M)
    assert listed == list(public_api.PUBLIC_MODULES)


def test_version_is_one_number_everywhere():
    """setup.cfg's version is the package's `__version__` and the newest
    release the CHANGELOG describes."""
    import keras_accum

    declared = re.search(r"^version = (\S+)$", _read("setup.cfg"), re.M).group(1)
    newest = re.search(r"^## (\d+\.\d+\.\d+)", _read("CHANGELOG.md"), re.M).group(1)
    assert declared == keras_accum.__version__ == newest
