"""Imports flow one way: experiments -> jaxlm -> {sharding, data, pallas_kernels}; sharding may use pallas_kernels,
data and pallas_kernels use nothing of the project; and no two modules import each other, even through a chain or
inside a function. Read from the source (ast), so an import inside a function counts as much as one at
the top."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("experiments", "jaxlm", "sharding", "data", "pallas_kernels")
MAY_IMPORT = {  # besides itself
    "experiments": {"jaxlm", "sharding", "data", "pallas_kernels"},
    "jaxlm": {"sharding", "data", "pallas_kernels"},
    "sharding": {"pallas_kernels"},
    "data": set(),
    "pallas_kernels": set(),
}


def module_files() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports (the longest known prefix of each dotted name)."""

    def known(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package_parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package_parts[: len(package_parts) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            module = known(target)
            # a package's own submodules, and a module's own package, are not edges of the graph
            if module and module != name and not module.startswith(name + ".") and not name.startswith(module + "."):
                found.add(module)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(root):
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def test_the_graph_is_read():
    graph = import_graph()
    assert "jaxlm.sharding" not in graph and "jaxlm.trainer" in graph and "jaxlm.train" in graph["jaxlm.trainer"]
    assert "jaxlm.diloco.config" in graph["jaxlm.config"]  # a from-import of a submodule


def test_no_package_imports_a_higher_one():
    upward = [
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        for target in targets
        if target.split(".")[0] != module.split(".")[0] and target.split(".")[0] not in MAY_IMPORT[module.split(".")[0]]
    ]
    assert not upward, upward


def test_no_import_cycle():
    assert not cycles(import_graph())


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
