"""The library's structure, read from its source with `ast`: no import
circle among its modules."""

import ast
import pathlib

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
    assert "keras_accum.window" in graph["keras_accum.base"]
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
