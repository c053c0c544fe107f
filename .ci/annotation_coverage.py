"""Share of hyper_parallel's public functions and classes that carry full type annotations.

Public: a name without a leading underscore, in a module whose own name has none (a package's
__init__.py counts as public), at module level or a method of a public class. A function is annotated
when every parameter but self/cls and its return carry annotations (``__init__`` needs no return); a
class when its ``__init__`` is annotated (or it defines none). Nested functions are implementation
detail and not counted.

    python3 .ci/annotation_coverage.py [--min PERCENT] [--list] [ROOT]
"""
from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Union

FunctionNode = Union[ast.FunctionDef, ast.AsyncFunctionDef]


@dataclass(frozen=True)
class Item:
    """One public function or class and whether it is fully annotated."""

    where: str
    annotated: bool


def function_annotated(node: FunctionNode, is_method: bool) -> bool:
    """Every parameter (bar a method's first) and the return annotated; ``__init__`` needs no return."""
    args = node.args
    params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    if is_method and params and not _is_staticmethod(node):
        params = params[1:]
    if args.vararg is not None:
        params.append(args.vararg)
    if args.kwarg is not None:
        params.append(args.kwarg)
    if any(p.annotation is None for p in params):
        return False
    return node.returns is not None or node.name == "__init__"


def _is_staticmethod(node: FunctionNode) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)


def _public_module(path: Path, root: Path) -> bool:
    parts = path.relative_to(root).with_suffix("").parts
    return all(not p.startswith("_") or p == "__init__" for p in parts)


def items_of(path: Path, root: Path) -> Iterator[Item]:
    """The public functions and classes of one module."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    rel = path.relative_to(root.parent)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            yield Item(f"{rel}:{node.lineno} {node.name}", function_annotated(node, is_method=False))
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            yield from _class_items(node, f"{rel}:{node.lineno} {node.name}")


def _class_items(node: ast.ClassDef, where: str) -> Iterator[Item]:
    init_ok = True
    for child in node.body:
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if child.name == "__init__":
            init_ok = function_annotated(child, is_method=True)
        elif not child.name.startswith("_"):
            yield Item(f"{where}.{child.name}", function_annotated(child, is_method=True))
    yield Item(where, init_ok)


def collect(root: Path) -> list[Item]:
    """Every public item under ``root`` (a package directory)."""
    found: list[Item] = []
    for path in sorted(root.rglob("*.py")):
        if _public_module(path, root):
            found.extend(items_of(path, root))
    return found


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parent.parent / "hyper_parallel"))
    parser.add_argument("--min", type=float, default=0.0, help="fail below this percentage")
    parser.add_argument("--list", action="store_true", help="list the unannotated items")
    opts = parser.parse_args(argv)
    found = collect(Path(opts.root))
    done = sum(item.annotated for item in found)
    share = 100.0 * done / max(len(found), 1)
    if opts.list:
        for item in found:
            if not item.annotated:
                print(item.where)
    print(f"annotated: {done}/{len(found)} public functions and classes ({share:.1f} %)")
    if share < opts.min:
        print(f"below the required {opts.min:.1f} %", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
