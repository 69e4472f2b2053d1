"""fastbwd's modules import one another without a circle: the graph of every import in fastbwd/
(at the top of a module or inside a function, where a circle is only put off) has no cycle.
Read from the sources, so it needs neither torch nor jax."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def modules():
    """``{dotted name: (path, is a package)}`` for every module under fastbwd/."""
    found = {}
    for path in sorted((ROOT / "fastbwd").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


def imports(name, path, package, known):
    """The modules of ``known`` that module ``name`` imports. ``from package import name`` is an
    import of the submodule when there is one (else of the package); the parent packages a
    submodule's import loads first are not edges (Python loads them before the module itself)."""
    here = name if package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in known:
                    found.add(submodule)
                elif target in known:
                    found.add(target)
    found.discard(name)
    return found


def import_graph():
    known = modules()
    return {name: imports(name, path, package, known) for name, (path, package) in known.items()}


def cycles(graph):
    """The strongly connected components of more than one module (each holds a circle), sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_finder_sees_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    assert "fastbwd.jax._reach" in graph["fastbwd.jax.linen"]  # from . import ... at the top
    assert "fastbwd.jax.linen" in graph["fastbwd.jax"]  # from . import linen inside a function


def test_no_import_circle_in_fastbwd():
    found = cycles(import_graph())
    assert not found, f"import circles in fastbwd/ (each: modules that import one another): {found}"
