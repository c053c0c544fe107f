"""The package's import graph has no cycle, counting imports deferred into functions: each layer
imports the ones below it only, so any module can be read (and loaded) without the ones above.
Static (ast), no framework imported; every ``hyper_parallel`` import is resolved to the module it
loads (``from pkg import name`` to ``pkg.name`` when that is a module, else ``pkg``)."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "hyper_parallel"


def _modules():
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _target(modules, name):
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(modules, name, path):
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield _target(modules, full if full in modules else base)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield _target(modules, alias.name)


def _graph():
    modules = _modules()
    return {name: {t for t in _imports(modules, name, path) if t and t != name and t in modules}
            for name, path in modules.items()}


def _cycles(graph):
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
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
                    found.append(sorted(component))
    return found


def test_no_import_cycle_even_deferred():
    assert _cycles(_graph()) == []


def test_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_context_parallel_top_level_is_small():
    """The modes are visible at a glance; masks, ring, overlap and the q/k/v movement live in
    subpackages."""
    top = [p.name for p in (ROOT / "core" / "context_parallel").glob("*.py")]
    assert len(top) <= 12, sorted(top)
