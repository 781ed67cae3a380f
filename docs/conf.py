"""Sphinx configuration: the API reference from the docstrings, and the
guides (Markdown, through myst-parser) as pages of the same site.

Build offline, warnings as errors (the README's command):

    python3 -m pip install -q -e '.[docs]'
    python3 -m sphinx -W --keep-going -b html docs docs/_build/html
"""

import os
import sys

# The checkout being documented, not an installed copy.
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "docs", "_ext"))
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras_accum  # noqa: E402
import public_api  # noqa: E402

project = "keras_accum"
author = "keras_accum authors"
copyright = "keras_accum authors"
release = keras_accum.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",  # the browser renders the equations with MathJax
    # ...loaded from _static/mathjax (copied from this package's wheel), not
    # from a CDN: the equations render with no network.
    "sphinx-mathjax-offline",
    "sphinx.ext.viewcode",
    "myst_parser",
    "public_api",  # fails the build when a public name has no page (docs/_ext)
    "data_links",  # links into the studies' data folders (docs/_ext)
]

# No intersphinx: the build must not need the network.
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = [
    "_build",
    # Data folders of the studies (their summary.md files are outputs that
    # the pages link to, not pages).
    "invariance",
    "batch_size_schedules",
    "batch_norm",
]
templates_path = ["_templates"]

# `Name` in a docstring is a cross-reference when Name is documented, and
# code otherwise (nitpicky is off: an unresolved name is not an error).
default_role = "py:obj"

autosummary_generate = True
autosummary_ignore_module_all = False  # a module's __all__ is its public API
autosummary_context = {
    "reexported": public_api.reexported(),
    "has_all": public_api.modules_with_all(),
}
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_inherit_docstrings = False  # Keras's docstrings are not ours to build
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3

html_theme = "alabaster"
html_title = f"keras_accum {release}"
html_static_path = []


def _hide_backend_forms(app, name, obj, options, bases):
    # `InvariantAdam(drivers.InvariantAdamForm, AdamFamily)`: the form is how
    # one backend runs the rule (docs/ARCHITECTURE.md), not part of the API.
    bases[:] = [b for b in bases if not b.__module__.startswith("keras_accum.drivers")]


def setup(app):
    app.connect("autodoc-process-bases", _hide_backend_forms)
