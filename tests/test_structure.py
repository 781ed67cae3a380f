"""The library's structure, read from its source with `ast`: no import
circle among its modules, no private Keras or TensorFlow name outside
`keras_accum/_compat.py`, and every module on the docs' two maps."""

import ast
import pathlib

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "keras_accum"
# The harness, not the library: it may import anything of the library.
HARNESS = PACKAGE / "experiments"


def library_files():
    """{module name: path} of every module of the library."""
    files = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if HARNESS in path.parents:
            continue
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def import_graph(files):
    """{module: {imported library module: first line}}, from every import
    statement of each module: at module level, in a function, under any
    `if` (a late or a type-checking import closes a circle all the same).
    `from keras_accum import x` is an edge to `keras_accum.x` when that is a
    module, else to the package `keras_accum`."""
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                    for alias in node.names
                ]
            for target in targets:
                # `import keras_accum.a.b` runs keras_accum.a.b: the longest
                # library module that the dotted name starts with.
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def find_cycle(graph):
    """One import circle as a list of modules (first == last), or None."""
    state = {}  # module -> "open" while on the path, "done" after

    def visit(module, path):
        state[module] = "open"
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                return path[path.index(target) :] + [target]
            if target not in state:
                found = visit(target, path)
                if found:
                    return found
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module, [])
            if found:
                return found
    return None


def describe(cycle, graph):
    """'a:12 -> b:30 -> a': each module with the line of its import of the next."""
    return " -> ".join(f"{a}:{graph[a][b]}" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_cycle_finder_finds_a_circle_and_only_a_circle():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert describe(["a", "b", "c", "a"], graph) == "a:1 -> b:2 -> c:3 -> a"
    assert find_cycle({"a": {"b": 1, "c": 1}, "b": {"c": 2}, "c": {}}) is None


def test_the_graph_has_the_known_edges():
    graph = import_graph(library_files())
    # Known edges, one of each kind, so that an empty graph cannot pass.
    assert "keras_accum.schedules" in graph["keras_accum.base"]
    assert "keras_accum._floor" in graph["keras_accum"]
    assert "keras_accum.training.checkpoints" in graph["keras_accum.training.trainer"]
    assert not any(m.startswith("keras_accum.experiments") for m in graph)


def test_function_level_imports_are_edges(tmp_path):
    package = tmp_path / "keras_accum"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from keras_accum import b\n")
    (package / "b.py").write_text("def late():\n    from keras_accum.a import f\n")
    files = {
        "keras_accum": package / "__init__.py",
        "keras_accum.a": package / "a.py",
        "keras_accum.b": package / "b.py",
    }
    graph = import_graph(files)
    assert graph["keras_accum.b"] == {"keras_accum.a": 2}
    assert find_cycle(graph) == ["keras_accum.a", "keras_accum.b", "keras_accum.a"]


def test_no_import_circle_in_the_library():
    graph = import_graph(library_files())
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + describe(cycle, graph)


def listed_modules(page):
    """The file names a docs page's map lists: the first column of each
    line (`nonfinite.py, _saving.py   what they do` lists two)."""
    names = set()
    for line in (ROOT / page).read_text().split("\n"):
        first = line.strip().split("  ")[0]
        names |= {name.strip() for name in first.split(",") if name.strip().endswith(".py")}
    return names


def test_every_library_module_is_listed_in_the_map():
    page = "docs/guides/layout.md"
    listed = listed_modules(page)
    files = {path.name for path in library_files().values()}
    assert "base.py" in listed and "multiworker.py" in listed  # the parser reads the map
    assert files <= listed, f"{page} does not list: {sorted(files - listed)}"


def test_the_architecture_is_one_page_and_points_to_the_map():
    text = (ROOT / "docs/ARCHITECTURE.md").read_text()
    assert len(text.splitlines()) <= 120
    assert "(guides/layout.md)" in text


# -- the rules ask no backend question: the drivers do (keras_accum/drivers) -------

RULES = [
    "base.py",
    "adam_family.py",
    "gradient_accumulation.py",
    "invariant_adam.py",
    "update_accumulation_adam.py",
    "layers.py",
]
BACKEND_QUESTIONS = {"BACKEND", "IS_TENSORFLOW", "IN_PLACE"}


def backend_questions(source):
    """['line: what'] for each backend question of a module: `tf` imported,
    `_backend.BACKEND`, `_backend.IS_TENSORFLOW`, `keras.backend.backend()`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom | ast.Import):
            names = [alias.asname or alias.name for alias in node.names]
            if "tf" in names or "tensorflow" in names:
                found.append(f"{node.lineno}: imports tf")
        elif isinstance(node, ast.Attribute) and node.attr in BACKEND_QUESTIONS:
            found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value  # keras.backend.backend()
            if node.func.attr == "backend" and getattr(owner, "attr", None) == "backend":
                found.append(f"{node.lineno}: backend.backend()")
    return found


def test_the_scan_sees_a_backend_question():
    assert backend_questions("from keras_accum._backend import tf\n") == ["1: imports tf"]
    assert backend_questions("if _backend.IS_TENSORFLOW:\n    pass\n") == ["1: .IS_TENSORFLOW"]
    assert backend_questions("x = keras.backend.backend()\n") == ["1: backend.backend()"]
    assert backend_questions("x = keras.backend.result_type(a)\n") == []
    assert backend_questions("x = _backend.INT\n") == []


@pytest.mark.parametrize("module", RULES)
def test_the_rules_ask_no_backend_question(module):
    # The backend is asked once, in keras_accum/drivers/__init__.py; what
    # differs per backend is a driver's or a form's (keras_accum/drivers).
    assert backend_questions((PACKAGE / module).read_text()) == []


# -- nor a flag-type question: a rule takes numbers or tensors alike ------------
# (whether `start` or `ok` is a Python bool or a tensor is the driver's to
# know: `kernels.decided`, `masked`, `flag` and the drivers ask it.)

FLAG_ATTRIBUTES = {"EAGER", "is_concrete", "decided"}


def flag_questions(source):
    """['line: what'] for each question of a module about a flag's type:
    `isinstance(x, bool)`, `x is True` / `is not False`, `kernels.EAGER`,
    `is_concrete`, `decided`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
            kinds = node.args[1] if len(node.args) == 2 else None
            kinds = kinds.elts if isinstance(kinds, ast.Tuple) else [kinds]
            if any(isinstance(k, ast.Name) and k.id == "bool" for k in kinds):
                found.append(f"{node.lineno}: isinstance(..., bool)")
        elif isinstance(node, ast.Compare):
            for op, right in zip(node.ops, node.comparators):
                if isinstance(op, ast.Is | ast.IsNot) and isinstance(right, ast.Constant):
                    if isinstance(right.value, bool):
                        found.append(f"{node.lineno}: is {right.value}")
        elif isinstance(node, ast.Attribute) and node.attr in FLAG_ATTRIBUTES:
            found.append(f"{node.lineno}: .{node.attr}")
    return found


def test_the_scan_sees_a_flag_question():
    assert flag_questions("if isinstance(start, bool):\n    pass\n") == ["1: isinstance(..., bool)"]
    assert flag_questions("x = isinstance(s, (int, bool))\n") == ["1: isinstance(..., bool)"]
    assert flag_questions("if ok is not False:\n    pass\n") == ["1: is False"]
    assert flag_questions("if kernels.EAGER:\n    pass\n") == ["1: .EAGER"]
    assert flag_questions("if ok is None or isinstance(n, int):\n    pass\n") == []


@pytest.mark.parametrize("module", RULES)
def test_the_rules_ask_no_flag_type_question(module):
    assert flag_questions((PACKAGE / module).read_text()) == []


# -- the window's bookkeeping is written by the drivers alone -------------------
# (`keras_accum.base.WindowState`: the rules and the rest read it.)

WINDOW_FIELDS = {"micro_step", "skipped_micro_batches", "skipped_updates", "bad", "size", "end"}
WRITES = {"assign", "assign_add", "assign_sub", "assign_total"}


def window_state_writes(source):
    """['line: field'] for each write of a `WindowState` field in a module:
    `<x>._window.<field>.assign*(...)`, `state.<field>.assign*(...)` or
    `counters.<field>...` (the drivers' names for it),
    `_replicas.assign_total(counters.<field>, ...)`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in WRITES:
            continue
        target = node.args[0] if node.func.attr == "assign_total" and node.args else node.func.value
        if not (isinstance(target, ast.Attribute) and target.attr in WINDOW_FIELDS):
            continue
        owner = target.value
        if (isinstance(owner, ast.Attribute) and owner.attr == "_window") or (
            isinstance(owner, ast.Name) and owner.id in ("state", "counters")
        ):
            found.append(f"{node.lineno}: {target.attr}")
    return found


def test_the_scan_sees_a_window_state_write():
    assert window_state_writes("self._window.micro_step.assign_add(1)\n") == ["1: micro_step"]
    assert window_state_writes("state.bad.assign(0)\n") == ["1: bad"]
    assert window_state_writes("_replicas.assign_total(counters.bad, 0)\n") == ["1: bad"]
    assert window_state_writes("self.micro_step.assign(1)\n") == []  # a layer's own count
    assert window_state_writes("x = self._window.micro_step + 1\n") == []  # a read


def test_only_the_drivers_write_the_window_state():
    writers = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        if window_state_writes(path.read_text()):
            writers.add(path.relative_to(PACKAGE).as_posix())
    assert writers == {
        "drivers/portable.py",
        "drivers/tensorflow/__init__.py",
        "drivers/tensorflow/_execution.py",
    }


# -- the non-finite policies are objects: nobody compares their names ------------
# (`nonfinite.Policy` answers what a driver asks: screens, raises, skips,
# drops_windows, window_ok, what a dropped window leaves.)

POLICY_NAMES = {"skip_micro_batch", "skip_window", "raise"}


def policy_name_comparisons(source):
    """['line: what'] for each comparison of the `nonfinite` argument, or of
    a policy's name, in a module: `x.nonfinite == ...`, `policy in (...)`,
    `... == "skip_window"`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        for side in list(sides):
            sides += side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else []
        for side in sides:
            if isinstance(side, ast.Attribute) and side.attr == "nonfinite":
                found.append(f"{node.lineno}: .nonfinite compared")
            elif isinstance(side, ast.Name) and side.id in ("nonfinite", "policy"):
                found.append(f"{node.lineno}: {side.id} compared")
            elif isinstance(side, ast.Constant) and side.value in POLICY_NAMES:
                found.append(f"{node.lineno}: {side.value!r} compared")
    return found


def test_the_scan_sees_a_policy_compared_by_name():
    assert policy_name_comparisons("if self.nonfinite == 'raise':\n    pass\n") == [
        "1: .nonfinite compared",
        "1: 'raise' compared",
    ]
    assert policy_name_comparisons("if policy in (None, 'raise'):\n    pass\n") == [
        "1: policy compared",
        "1: 'raise' compared",
    ]
    assert policy_name_comparisons("if policy.drops_windows and x == 1:\n    pass\n") == []


def test_no_module_compares_a_policy_by_name():
    # The argument's check (base.py's `check_choice`) and InvariantAdam's
    # refusal of "skip_window" read the user's value; nothing else asks a
    # policy its name (keras_accum/nonfinite.py holds the table).
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative == "nonfinite.py" or relative.startswith("experiments/"):
            continue
        hits = policy_name_comparisons(path.read_text())
        if hits:
            found[relative] = hits
    assert found == {"invariant_adam.py": [f"{INVARIANT_REFUSAL}: 'skip_window' compared"]}


INVARIANT_REFUSAL = next(
    number
    for number, line in enumerate((PACKAGE / "invariant_adam.py").read_text().splitlines(), 1)
    if 'get("nonfinite")' in line
)
# -- private Keras and TensorFlow names: in keras_accum/_compat.py only ----------

COMPAT = PACKAGE / "_compat.py"

# Private attributes the library may use although they are not its own
# (defined nowhere in keras_accum) or share a Keras/TF private name. Each
# says why; an entry nothing uses any more fails `test_no_stale_exception`.
ALLOWED = {
    # Overrides Keras's attribute of that name (its optimizer reads it for
    # `use_ema`): GradientAccumulation answers with the wrapped optimizer's
    # averages. A definition, not a call: it cannot move into _compat.
    "_model_variables_moving_average": "GradientAccumulation's override of Keras's",
    # InvariantAdam's and UpdateAccumulationAdam's moments, under the names
    # of keras.optimizers.Adam's (not a base of theirs), so that one reader,
    # _compat.adam_velocities, serves all three; read on `self` only.
    "_momentums": "our Adams' slots, named as Keras Adam's",
    "_velocities": "our Adams' slots, named as Keras Adam's",
}
# Private names of other libraries, by the name they are read from.
ALLOWED_ON = {
    # PyTorch's multi-tensor kernels, what torch.optim runs with
    # `foreach=True` (keras_accum.kernels); not Keras's or TensorFlow's.
    ("torch", "_foreach_"): "PyTorch's foreach kernels",
    # The standard library's frame access (a warning's stacklevel, base.py).
    ("sys", "_getframe"): "Python's",
}
_ATTRIBUTE_CALLS = ("getattr", "hasattr", "setattr", "delattr")


def _private(name):
    return isinstance(name, str) and name.startswith("_") and not name.startswith("__")


def _string(node):
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _dict_key(node):
    """'_x' for `obj.__dict__["_x"]` and `obj.__dict__.get("_x")`, else None."""
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute):
        if node.value.attr == "__dict__":
            return _string(node.slice)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
        owner = node.func.value
        if isinstance(owner, ast.Attribute) and owner.attr == "__dict__":
            return _string(node.args[0])
    return None


def private_names(sources):
    """(defined, members, used, imports) of the private names in `sources`
    ({path: source}).

    `defined`: the names the code gives to its own things (functions,
    classes, assignments to names or attributes of `self`/`cls`, `setattr`
    and `__dict__` keys). `members` {name: [(path, line)]}: those of them
    that are attributes (in a class body, on `self`/`cls`, through
    `setattr` or `__dict__`). `used` {name: [(path, line, receiver)]}: every
    private attribute read, written or looked up (`obj._x`,
    `getattr(obj, "_x")`, `obj.__dict__["_x"]`), with the name it is read
    from when that is a plain name. `imports` [(path, line, what)]: imports
    of Keras's or TensorFlow's internals (`keras.src`, `tensorflow.python`)
    and of private names of modules other than keras_accum's."""
    defined, members, used, imports = set(), {}, {}, []
    for path, source in sources.items():
        tree = ast.parse(source, str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        members.setdefault(item.name, []).append((path, item.lineno))
                    elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                        targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                        for target in targets:
                            for part in ast.walk(target):
                                if isinstance(part, ast.Name):
                                    members.setdefault(part.id, []).append((path, item.lineno))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for part in ast.walk(target):
                        member = None
                        if isinstance(part, ast.Name):
                            defined.add(part.id)
                        elif isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name):
                            if part.value.id in ("self", "cls"):
                                member = part.attr
                        elif _dict_key(part):
                            member = _dict_key(part)
                        if member:
                            defined.add(member)
                            members.setdefault(member, []).append((path, node.lineno))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id == "setattr" and len(node.args) > 1 and _string(node.args[1]):
                    defined.add(_string(node.args[1]))
                    members.setdefault(_string(node.args[1]), []).append((path, node.lineno))
            name = receiver = None
            if isinstance(node, ast.Attribute):
                name = node.attr
                receiver = node.value.id if isinstance(node.value, ast.Name) else None
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id in _ATTRIBUTE_CALLS and len(node.args) > 1:
                    name = _string(node.args[1])
                    owner = node.args[0]
                    receiver = owner.id if isinstance(owner, ast.Name) else None
            elif _dict_key(node):
                name = _dict_key(node)
            if _private(name):
                used.setdefault(name, []).append((path, node.lineno, receiver))
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = (
                    [alias.name for alias in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                )
                for module in modules:
                    if module.split(".")[:2] in (["keras", "src"], ["tensorflow", "python"]):
                        imports.append((path, node.lineno, module))
                if isinstance(node, ast.ImportFrom) and node.level == 0:
                    if not (node.module or "").startswith("keras_accum"):
                        for alias in node.names:
                            if _private(alias.name):
                                imports.append((path, node.lineno, f"{node.module}.{alias.name}"))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if (node.value.id, node.attr) in (("keras", "src"), ("tf", "python")):
                    imports.append((path, node.lineno, f"{node.value.id}.{node.attr}"))
    members = {name: places for name, places in members.items() if _private(name)}
    return {n for n in defined if _private(n)}, members, used, imports


def keras_private_names():
    """The private names of the Keras and TensorFlow classes that the
    library's classes derive from (their attributes and those their
    instances set), of a built Adam and of a built model: a name of ours
    among them would read as, or overwrite, Keras's."""
    import importlib
    import inspect

    import keras

    bases = set()
    for name in library_files():
        module = importlib.import_module(name)
        for value in vars(module).values():
            if inspect.isclass(value) and value.__module__.startswith("keras_accum"):
                bases |= {
                    base
                    for base in value.__mro__
                    if base.__module__.split(".")[0] in ("keras", "tensorflow")
                }
    variable = keras.Variable(np.ones((2, 2), "float32"))
    optimizer = keras.optimizers.Optimizer(0.1, use_ema=True, name="probe")
    optimizer.build([variable])
    adam = keras.optimizers.Adam(0.1)
    adam.build([variable])
    model = keras.Sequential([keras.Input((2,)), keras.layers.BatchNormalization()])
    model.compile(optimizer, "mse", metrics=["mae"])
    instances = [optimizer, adam, model, model.layers[0], keras.callbacks.Callback()]
    names = {name for base in bases for name in dir(base)}
    names |= {name for instance in instances for name in vars(instance)}
    return {name for name in names if _private(name)}


def library_sources():
    return {path: path.read_text() for path in library_files().values() if path != COMPAT}


def violations(sources, keras_names):
    """'path:line name (why)' for each import of Keras's or TF's internals
    outside _compat, and each private name there that is not the library's
    own, or that is Keras's or TF's too: an attribute of ours by that name
    (it overrides or shadows theirs) unless ALLOWED says why, and any use of
    the name on another object than `self` (it may be theirs)."""
    defined, members, used, imports = private_names(sources)
    found = [f"{path}:{line} imports {what}" for path, line, what in imports]
    for name, places in sorted(members.items()):
        if name in keras_names and name not in ALLOWED:
            found += [f"{path}:{line} {name} (defines Keras's or TF's)" for path, line in places]
    for name, places in sorted(used.items()):
        for path, line, receiver in places:
            if any(receiver == owner and name.startswith(prefix) for owner, prefix in ALLOWED_ON):
                continue
            if name not in defined and name not in ALLOWED:
                found.append(f"{path}:{line} {name} (not the library's own)")
            elif name in keras_names and not (name in members and receiver in ("self", "cls")):
                found.append(f"{path}:{line} {name} (Keras's or TF's too, read from {receiver})")
    return found


@pytest.fixture(scope="module")
def keras_names():
    return keras_private_names()


def test_private_keras_and_tensorflow_names_only_in_compat(keras_names):
    # Sanity: what the scan is measured against is Keras's, in numbers.
    assert {"_iterations", "_trainable_variables", "_check_variables_are_known"} <= keras_names
    assert {"_compile_loss", "_model_variables_moving_average"} <= keras_names
    found = violations(library_sources(), keras_names)
    assert not found, (
        "private Keras/TF names outside keras_accum/_compat.py (move each into a "
        "_compat function, or add it to ALLOWED with the reason):\n" + "\n".join(found)
    )


def test_the_scan_sees_a_private_keras_name_added_to_base(keras_names):
    base = PACKAGE / "base.py"
    sources = library_sources()
    for added, expected in [
        ("x = optimizer._iterations\n", "_iterations (not the library's own)"),
        ("self._iterations = None\n", "_iterations (defines Keras's or TF's)"),
        ('x = getattr(self, "_trainable_variables")\n', "_trainable_variables"),
        (
            'x = getattr(optimizer, "_velocities")\n',
            "_velocities (Keras's or TF's too, read from optimizer)",
        ),
        ("from keras.src.backend import get_keras_mask\n", "imports keras.src.backend"),
        ("from tensorflow.python.ops import control_flow_util\n", "imports tensorflow.python"),
    ]:
        found = violations({**sources, base: sources[base] + added}, keras_names)
        assert len(found) == 1 and expected in found[0], (added, found)
        assert found[0].startswith(f"{base}:")


def test_no_stale_exception():
    _, members, used, _ = private_names(library_sources())
    for name in ALLOWED:
        assert name in members or name in used, f"ALLOWED lists {name}, which nothing uses"
    for owner, prefix in ALLOWED_ON:
        assert any(
            receiver == owner and name.startswith(prefix)
            for name, places in used.items()
            for _, _, receiver in places
        ), f"ALLOWED_ON lists {owner}.{prefix}, which the library no longer uses"


# -- a driver's form never shadows a rule's method by accident ------------------

# Methods a form may define over a rule's or Keras's on purpose: the portable
# InvariantAdamForm's `build` (the data-parallel warning), the portable
# GradientAccumulationForm's `stateless_apply` (JAX's lax.cond).
FORM_OVERRIDES = {"build", "stateless_apply"}


def shadowed_by_forms(cls):
    """Names a class of `keras_accum.drivers` defines in `cls`'s MRO that a
    class outside the drivers (a rule, or Keras's Optimizer) also defines,
    beyond `FORM_OVERRIDES`: a form method that takes the place of a rule's
    method of the same name (as a form's `_prepare` once took the place of
    `AccumulationOptimizer`'s)."""
    import keras

    form_names, other_names = set(), set(dir(keras.optimizers.Optimizer))
    for klass in cls.__mro__:
        names = {n for n in vars(klass) if not n.startswith("__")}
        if klass.__module__.startswith("keras_accum.drivers"):
            if klass.__name__ != "Driver":  # the driver's own hooks are its API
                form_names |= names
        elif klass.__module__.startswith("keras_accum"):
            other_names |= names
    return sorted((form_names & other_names) - FORM_OVERRIDES)


def test_the_shadow_scan_sees_a_form_method_named_as_a_rules():
    import keras_accum as ka
    from keras_accum import drivers

    form = type("Form", (), {"_checked_pairs": lambda self: None})
    form.__module__ = drivers.__name__
    shadowing = type("Shadowing", (form, ka.InvariantAdam), {})
    assert shadowed_by_forms(shadowing) == ["_checked_pairs"]


@pytest.mark.parametrize(
    "name", ["GradientAccumulation", "InvariantAdam", "UpdateAccumulationAdam"]
)
def test_no_form_shadows_a_rules_method(name):
    """On this process's backend (TensorFlow in the fast tier; the forms of
    JAX and PyTorch are one module, checked the same way by name below)."""
    import keras_accum as ka

    assert shadowed_by_forms(getattr(ka, name)) == []


def test_no_portable_form_shadows_a_rules_method():
    """The JAX/PyTorch forms, read without importing them as the driver."""
    import keras

    from keras_accum import base

    source = (PACKAGE / "drivers" / "portable.py").read_text()
    tree = ast.parse(source)
    rule_names = set(dir(base.AccumulationOptimizer)) | set(dir(keras.optimizers.Optimizer))
    for module in ("gradient_accumulation", "invariant_adam", "update_accumulation_adam"):
        rule = ast.parse((PACKAGE / f"{module}.py").read_text())
        rule_names |= {n.name for n in ast.walk(rule) if isinstance(n, ast.FunctionDef)}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name.endswith("Form"):
            names = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
            assert sorted((names & rule_names) - FORM_OVERRIDES) == [], node.name


# -- no module over 400 lines (experiments/ aside: the studies' scripts) ----------


def test_no_library_module_is_over_400_lines():
    long = {
        path.relative_to(PACKAGE).as_posix(): count
        for path in PACKAGE.rglob("*.py")
        if "experiments" not in path.relative_to(PACKAGE).parts
        and (count := len(path.read_text().splitlines())) > 400
    }
    assert long == {}


# -- TensorFlow plumbing lives under drivers/tensorflow/ ------------------------

TOP_LEVEL_TENSORFLOW = {
    "_backend.py",  # where `tf` comes from
    "_compat.py",  # Keras's and TensorFlow's private names
    "_noise_scale.py",  # GradientNoiseScale: a tf.Module, IndexedSlices norms
    "_replicas.py",  # tf.distribute's verbs (also weighing's replica scalar)
    "remat.py",  # tf.recompute_grad on TensorFlow
    "sharpness.py",  # TensorFlow-only diagnostics (GradientTape)
}


def test_at_most_six_top_level_modules_import_tensorflow():
    importers = {
        path.name
        for path in PACKAGE.glob("*.py")
        if any(
            line.strip() == "import tensorflow as tf" or "_backend import tf" in line
            for line in path.read_text().splitlines()
        )
    }
    assert importers == TOP_LEVEL_TENSORFLOW
