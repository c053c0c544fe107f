"""``platform/base.py`` is the complete contract between core and the frameworks.

* Every platform member that ``hyper_parallel/core`` and ``hyper_parallel/integrations`` use is
  declared on ``Platform`` (found statically: attribute reads on ``get_platform()``, on names and
  attributes bound to it, and on the conventional ``platform`` / ``_platform`` names, plus
  ``getattr``/``hasattr`` with a literal name).
* The platform is bound one way: ``get_platform()`` called where it is used (a function-local or
  instance variable is fine), never bound once at import time in a module global.
* The torch and MindSpore platforms implement (or inherit) every abstract member.
* The platform never imports core.
"""
import ast
import pathlib

import pytest

from hyper_parallel.platform.base import Platform
from tests.cases import platform_contract
from tests.harness.frameworks import FRAMEWORKS, run_on

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCANNED = [ROOT / "hyper_parallel" / "core", ROOT / "hyper_parallel" / "integrations"]
PLATFORM_NAMES = {"platform", "_platform"}


def _is_get_platform(node):
    return isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Name) and node.func.id == "get_platform")
        or (isinstance(node.func, ast.Attribute) and node.func.attr == "get_platform"))


def _bindings(tree):
    """(names, attribute names) bound to get_platform() anywhere in the module."""
    names, attrs = set(PLATFORM_NAMES), set(PLATFORM_NAMES)
    for node in ast.walk(tree):
        value = getattr(node, "value", None)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and _is_get_platform(value):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(target, ast.Name):
                    names.add(target.id)
                elif isinstance(target, ast.Attribute):
                    attrs.add(target.attr)
    return names, attrs


def platform_members_used(source):
    """{member: [line, ...]} of every platform member the module ``source`` uses."""
    tree = ast.parse(source)
    names, attrs = _bindings(tree)

    def is_platform(node):
        return _is_get_platform(node) or (isinstance(node, ast.Name) and node.id in names) or \
            (isinstance(node, ast.Attribute) and node.attr in attrs)
    used = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_platform(node.value):
            used.setdefault(node.attr, []).append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr") and len(node.args) >= 2 and \
                is_platform(node.args[0]) and isinstance(node.args[1], ast.Constant):
            used.setdefault(node.args[1].value, []).append(node.lineno)
    return used


def import_time_bindings(source):
    """Lines where a module-level statement binds the platform object itself to a name."""
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and _is_get_platform(node.value):
            found.append(node.lineno)
    return found


def declared_members():
    return {name for klass in Platform.__mro__ if klass is not object for name in vars(klass)}


def _sources():
    for root in SCANNED:
        for path in sorted(root.rglob("*.py")):
            yield path.relative_to(ROOT), path.read_text(encoding="utf-8")


@pytest.mark.parametrize("source, members", [
    ("from hyper_parallel.platform import get_platform\nget_platform().cat([], 0)\n", {"cat"}),
    ("def f():\n    p = get_platform()\n    return p.zeros((1,))\n", {"zeros"}),
    ("class A:\n    def __init__(self):\n        self.pf = get_platform()\n"
     "    def f(self):\n        return self.pf.all_reduce(1, None)\n", {"all_reduce"}),
    ("def f(platform):\n    return platform.sdpa(1, 2, 3)\n", {"sdpa"}),
    ("x = getattr(get_platform(), 'gradients_as_tuple', False)\n", {"gradients_as_tuple"}),
    ("def f(other):\n    return other.cat([])\n", set()),
])
def test_scanner_itself(source, members):
    assert set(platform_members_used(source)) == members


def test_core_uses_only_declared_platform_members():
    declared = declared_members()
    undeclared = {}
    for path, source in _sources():
        for member, lines in platform_members_used(source).items():
            if member not in declared:
                undeclared.setdefault(member, []).append(f"{path}:{lines[0]}")
    assert not undeclared, (f"core uses platform members that hyper_parallel/platform/base.py does not "
                            f"declare; declare each (with a one-line doc) in Platform: {undeclared}")


def test_contract_declares_the_members_core_is_known_to_use():
    """A guard against a scanner that silently finds nothing."""
    used = set()
    for _, source in _sources():
        used |= set(platform_members_used(source))
    assert {"make_autograd_function", "cat", "all_gather", "is_tensor", "sdpa"} <= used, sorted(used)


def test_platform_is_bound_at_call_time():
    assert import_time_bindings("p = get_platform()\ndef f():\n    q = get_platform()\n") == [1]
    offenders = {str(path): lines for path, source in _sources() if (lines := import_time_bindings(source))}
    assert not offenders, (f"bind the platform at call time (get_platform() where it is used), not in a "
                           f"module global: {offenders}")


def test_every_abstract_member_is_documented():
    undocumented = [name for name in Platform.__abstractmethods__
                    if not (getattr(Platform, name).__doc__ or "").strip()]
    assert not undocumented, undocumented


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_platform_implements_every_abstract_member(framework):
    results = run_on(framework, 2, platform_contract.unimplemented_abstract_members)
    assert results[0]["missing"] == [], results[0]


def test_npu_platform_inherits_every_abstract_member():
    from hyper_parallel.platform.npu.platform import NpuPlatform
    assert not NpuPlatform.__abstractmethods__


def test_platform_never_imports_core():
    offenders = []
    for path in sorted((ROOT / "hyper_parallel" / "platform").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                          if n.startswith("hyper_parallel.core")]
    assert not offenders, offenders
