"""What is public in keras_accum, and a Sphinx extension that fails the
build when a public name has no docstring or no page (optax's coverage
check, for this package).

Public: `keras_accum` and the modules in `PUBLIC_MODULES`. A module's names
are its `__all__` where it has one, otherwise the classes and functions it
defines whose names do not start with an underscore. A name that
`keras_accum` re-exports is documented once, as `keras_accum.<name>`.

`tests/test_docs.py` imports this file to check the docstrings without
Sphinx (nothing here imports Sphinx); the page check needs a build.
"""

import importlib
import inspect
import re

PUBLIC_MODULES = (
    "keras_accum",
    "keras_accum.layers",
    "keras_accum.schedules",
    "keras_accum.adaptive_steps",
    "keras_accum.scaling",
    "keras_accum.equations",
    "keras_accum.weighing",
    "keras_accum.nonfinite",
    "keras_accum.remat",
    "keras_accum.diagnostics",
    "keras_accum.sharpness",
    "keras_accum.training",
)


def public_names(module_name):
    """The public names of `module_name` (see the module docstring)."""
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and value.__module__ == module_name
    ]


def reexported():
    """{module: [names]} of the names `keras_accum` re-exports from each
    public submodule (their pages are `keras_accum.<name>`)."""
    top = importlib.import_module("keras_accum")
    found = {}
    for module_name in PUBLIC_MODULES[1:]:
        module = importlib.import_module(module_name)
        found[module_name] = [
            name
            for name in public_names(module_name)
            if name in top.__all__ and getattr(top, name) is getattr(module, name)
        ]
    return found


def modules_with_all():
    """The public modules that declare `__all__`."""
    return [m for m in PUBLIC_MODULES if hasattr(importlib.import_module(m), "__all__")]


def constant_doc(module_name, name):
    """The `#:` comment lines above `name`'s assignment, in the module that
    assigns it ([] when there are none)."""
    source = inspect.getsource(importlib.import_module(_defining_module(module_name, name)))
    lines = source.split("\n")
    for i, line in enumerate(lines):
        if re.match(rf"{re.escape(name)}\s*(:[^=]*)?=", line):
            comments = []
            for above in reversed(lines[:i]):
                if not above.startswith("#:"):
                    break
                comments.insert(0, above[2:].strip())
            return comments
    return []


def page_name(module_name, name):
    """The documented (Python domain) name of `module_name.name`."""
    if name in reexported().get(module_name, ()):
        return f"keras_accum.{name}"
    return f"{module_name}.{name}"


def undocumented():
    """'module.name: why' for each public name without a docstring.

    A class, function or module needs a docstring of its own; any other
    value (a constant) a `#:` comment above its assignment."""
    missing = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        if not (module.__doc__ or "").strip():
            missing.append(f"{module_name}: no module docstring")
        for name in public_names(module_name):
            value = getattr(module, name, None)
            if value is None and not hasattr(module, name):
                missing.append(f"{module_name}.{name}: in __all__ but not defined")
            elif inspect.isclass(value) or inspect.isroutine(value) or inspect.ismodule(value):
                if not (value.__doc__ or "").strip():
                    missing.append(f"{module_name}.{name}: no docstring")
            elif not "".join(constant_doc(module_name, name)).strip():
                defining = _defining_module(module_name, name)
                missing.append(f"{module_name}.{name}: no `#:` comment in {defining}")
    return missing


def _defining_module(module_name, name):
    """The module whose source assigns `name` (a constant re-exported by a
    package is assigned in one of its submodules)."""
    module = importlib.import_module(module_name)
    for candidate in [module_name] + [
        m for m in dir(module) if inspect.ismodule(getattr(module, m, None))
    ]:
        full = candidate if candidate == module_name else f"{module_name}.{candidate}"
        try:
            source = inspect.getsource(importlib.import_module(full))
        except (OSError, TypeError, ImportError):
            continue
        if f"\n{name} =" in "\n" + source or f"\n{name}: " in "\n" + source:
            return full
    return module_name


# -- the Sphinx extension --------------------------------------------------


def _defined_here(obj):
    """True when a class member is defined in keras_accum (not inherited
    from Keras or TensorFlow, whose docstrings are not reStructuredText)."""
    target = obj.fget if isinstance(obj, property) else obj
    target = getattr(target, "__func__", target)
    module = getattr(target, "__module__", None) or ""
    return module.split(".")[0] == "keras_accum"


def _skip_member(app, what, name, obj, skip, options):
    if what == "class" and not _defined_here(obj):
        return True
    return None


def _constant_docstring(app, what, name, obj, options, lines):
    """A constant re-exported by a package (`keras_accum.training`) takes
    the `#:` comment of the module that assigns it."""
    if what in ("data", "attribute") and not any(line.strip() for line in lines):
        module_name, _, short = name.rpartition(".")
        if module_name in PUBLIC_MODULES:
            lines[:] = constant_doc(module_name, short)


def _forwarded_signature(app, what, name, obj, options, signature, return_annotation):
    """`InvariantAdam(*args, name=..., **kwargs)` forwards to its base's
    `__init__`: show the arguments it takes (the base's, with the
    subclass's own keyword defaults), not `*args, **kwargs`."""
    if what != "class" or not name.startswith("keras_accum"):
        return None
    own = inspect.signature(obj.__init__)
    kinds = {p.kind for p in own.parameters.values()}
    if inspect.Parameter.VAR_POSITIONAL not in kinds:
        return None
    for base in obj.__mro__[1:]:
        init = base.__dict__.get("__init__")
        if init is None:
            continue
        params = dict(inspect.signature(init).parameters)
        if inspect.Parameter.VAR_POSITIONAL in {p.kind for p in params.values()}:
            continue
        params.pop("self", None)
        for p in own.parameters.values():
            if p.kind is inspect.Parameter.KEYWORD_ONLY:
                params[p.name] = p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD)
        merged = [p.replace(annotation=inspect.Parameter.empty) for p in params.values()]
        ordered = sorted(merged, key=lambda p: p.kind == inspect.Parameter.VAR_KEYWORD)
        return str(inspect.Signature(ordered)), return_annotation
    return None


def _check_coverage(app, env):
    from sphinx.util import logging

    logger = logging.getLogger("public_api")
    documented = env.get_domain("py").objects
    for why in undocumented():
        logger.warning("undocumented public name: %s", why)
    for module_name in PUBLIC_MODULES:
        if module_name not in documented:
            logger.warning("public module without a page: %s", module_name)
        for name in public_names(module_name):
            if page_name(module_name, name) not in documented:
                logger.warning(
                    "public name without a page: %s (list its module in docs/api.rst)",
                    page_name(module_name, name),
                )


def setup(app):
    app.connect("autodoc-skip-member", _skip_member)
    app.connect("autodoc-process-docstring", _constant_docstring)
    app.connect("autodoc-process-signature", _forwarded_signature)
    app.connect("env-check-consistency", _check_coverage)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
