"""Platform selection (HP_PLATFORM), its errors, the capability table, the rule that
``hyper_parallel/core`` never imports a framework, and -- on torch and on MindSpore -- process
groups, custom autograd functions and the attention kernels."""
import ast
import importlib.util
import pathlib
import re

import pytest

from hyper_parallel.platform import VALID_PLATFORMS, get_platform, reset_platform
from hyper_parallel.platform import selection
from tests.cases import platform_surface as surface
from tests.harness import run_dist
from tests.harness.frameworks import FRAMEWORKS, framework_worlds, run_on

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORE = ROOT / "hyper_parallel" / "core"
FRAMEWORK_MODULES = ("torch", "torch_npu", "mindspore")


@pytest.fixture
def clean_platform(monkeypatch):
    """No platform env vars and no cached platform; the cache is reset again afterwards."""
    monkeypatch.delenv("HP_PLATFORM", raising=False)
    monkeypatch.delenv("HYPER_PARALLEL_PLATFORM", raising=False)
    reset_platform()
    yield monkeypatch
    monkeypatch.undo()
    reset_platform()


def _hide(monkeypatch, *missing):
    """Make ``importlib.util.find_spec`` (as the selection module sees it) report ``missing``
    as not installed."""
    real = importlib.util.find_spec

    def fake(name, *args, **kwargs):
        if name.split(".")[0] in missing:
            return None
        return real(name, *args, **kwargs)
    monkeypatch.setattr(selection.importlib.util, "find_spec", fake)


# ---------------------------------------------------------------------------- selection
def test_valid_names():
    assert VALID_PLATFORMS == ("torch", "npu", "mindspore")


def test_default_is_torch(clean_platform):
    platform = get_platform()
    assert platform.name == "torch"
    assert get_platform() is platform  # cached


@pytest.mark.parametrize("env", ["HP_PLATFORM", "HYPER_PARALLEL_PLATFORM"])
def test_bogus_name_is_value_error_listing_valid_ones(clean_platform, env):
    clean_platform.setenv(env, "bogus")
    with pytest.raises(ValueError) as info:
        get_platform()
    text = str(info.value)
    assert env in text and "bogus" in text
    for name in VALID_PLATFORMS:
        assert name in text


@pytest.mark.parametrize("value", ["torch", "TORCH", "Torch", " torch "])
def test_alias_and_case_insensitive(clean_platform, value):
    clean_platform.setenv("HYPER_PARALLEL_PLATFORM", value)
    assert get_platform().name == "torch"
    reset_platform()
    clean_platform.delenv("HYPER_PARALLEL_PLATFORM")
    clean_platform.setenv("HP_PLATFORM", value)
    assert get_platform().name == "torch"


def test_hp_platform_wins_over_alias(clean_platform):
    clean_platform.setenv("HP_PLATFORM", "torch")
    clean_platform.setenv("HYPER_PARALLEL_PLATFORM", "bogus")
    assert get_platform().name == "torch"


def test_missing_chosen_framework_is_import_error(clean_platform):
    _hide(clean_platform, "torch")
    clean_platform.setenv("HP_PLATFORM", "torch")
    with pytest.raises(ImportError) as info:
        get_platform()
    text = str(info.value)
    assert "'torch'" in text and "pip install" in text
    assert "HP_PLATFORM" in text


def test_missing_mindspore_names_it_and_the_extra(clean_platform):
    _hide(clean_platform, "mindspore")
    clean_platform.setenv("HP_PLATFORM", "MindSpore")
    with pytest.raises(ImportError) as info:
        get_platform()
    text = str(info.value)
    assert "mindspore" in text and "hyper-parallel[mindspore]" in text


def test_neither_framework_installed(clean_platform):
    _hide(clean_platform, "torch", "mindspore")
    with pytest.raises(ImportError) as info:
        get_platform()
    text = str(info.value)
    assert "torch" in text and "mindspore" in text.lower()
    assert "hyper-parallel[mindspore]" in text and "pip install" in text


def test_unset_falls_back_to_mindspore_when_torch_missing(clean_platform):
    """Without torch the default choice is mindspore (reported missing here if it is)."""
    _hide(clean_platform, "torch")
    if importlib.util.find_spec("mindspore") is not None:
        pytest.skip("mindspore is installed; the fallback would really import it")
    with pytest.raises(ImportError, match="mindspore"):
        get_platform()  # neither importable -> the 'install one' error, naming mindspore


def test_npu_without_torch_npu(clean_platform):
    _hide(clean_platform, "torch_npu")
    clean_platform.setenv("HP_PLATFORM", "npu")
    with pytest.raises(ImportError) as info:
        get_platform()
    text = str(info.value)
    assert "torch_npu" in text and "hyper-parallel[npu]" in text


def test_npu_platform_class_without_torch_npu():
    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed")
    from hyper_parallel.platform.npu.platform import NpuPlatform
    with pytest.raises(ImportError, match="torch_npu"):
        NpuPlatform()


def test_failed_selection_is_not_cached(clean_platform):
    clean_platform.setenv("HP_PLATFORM", "bogus")
    with pytest.raises(ValueError):
        get_platform()
    clean_platform.setenv("HP_PLATFORM", "torch")
    assert get_platform().name == "torch"


# ---------------------------------------------------------------------------- capabilities
_EMULATED_ON_GLOO = ("all_gather", "all_to_all (list)", "reduce_scatter", "all_reduce avg")


def _capabilities_case(rank, world_size):
    from hyper_parallel.platform import get_platform
    return get_platform().capabilities()


def _check_gloo_table(table):
    assert table["backend"] == "gloo"
    for key in _EMULATED_ON_GLOO:
        assert table[key].startswith("emulated:"), (key, table[key])
    for key in ("all_to_all_single", "all_reduce", "broadcast"):
        assert table[key] == "native", (key, table[key])


def test_capability_table_on_gloo():
    tables = run_dist(2, _capabilities_case)
    assert tables[0] == tables[1]
    _check_gloo_table(tables[0])


def test_capability_table_before_init(clean_platform):
    platform = get_platform()
    if platform.default_backend != "gloo":
        pytest.skip("not a CPU machine")
    _check_gloo_table(platform.capabilities())


# ---------------------------------------------------------------------------- core imports no framework
_IMPORT_RE = re.compile(r"^\s*(import|from)\s+(torch|torch_npu|mindspore)\b", re.MULTILINE)


def _framework_imports(source, filename="<source>"):
    """Every way ``source`` imports a framework: regex on lines, then the AST (which also sees
    ``import os, torch``, ``importlib.import_module("torch")`` and ``__import__("mindspore")``)."""
    found = [f"line {source.count(chr(10), 0, m.start()) + 1}: {m.group(0).strip()}"
             for m in _IMPORT_RE.finditer(source)]
    for node in ast.walk(ast.parse(source, filename)):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in ("import_module", "__import__"):
                names = [node.args[0].value]
        for name in names:
            if name.split(".")[0] in FRAMEWORK_MODULES:
                found.append(f"line {node.lineno}: imports {name}")
    return found


@pytest.mark.parametrize("source, bad", [
    ("import torch\n", True),
    ("import torch.distributed as dist\n", True),
    ("from torch import nn\n", True),
    ("if True:\n    from mindspore.ops import operations\n", True),
    ("import os, torch_npu\n", True),
    ("def f():\n    import torch\n", True),
    ("import importlib\nm = importlib.import_module('torch.nn')\n", True),
    ("x = __import__('mindspore')\n", True),
    ("import torchvision_like\nfrom .torch import x\nimport hyper_parallel.platform.torch\n", False),
    ("# import torch in a comment\ns = 'import torch'\n", False),
])
def test_import_scanner_itself(source, bad):
    assert bool(_framework_imports(source)) == bad, _framework_imports(source)


def test_core_never_imports_a_framework():
    assert CORE.is_dir(), f"{CORE} is missing"
    offenders = {}
    for path in sorted(CORE.rglob("*.py")):
        found = _framework_imports(path.read_text(encoding="utf-8"), str(path))
        if found:
            offenders[str(path.relative_to(ROOT))] = found
    assert not offenders, ("hyper_parallel/core must reach frameworks only through get_platform(); "
                           f"framework imports found: {offenders}")


# ============================================================================ on every framework
@pytest.mark.parametrize("framework,world_size", framework_worlds(2, 4))
def test_process_groups(framework, world_size):
    """Groups keep their creation order (get_rank, group_ranks, all_gather), are cached by rank
    tuple, and DeviceMesh builds its groups through them (tests/cases/platform_surface.py)."""
    assert run_on(framework, world_size, surface.process_groups) == [True] * world_size


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_make_autograd_function(framework):
    assert run_on(framework, 2, surface.autograd_function) == [True, True]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_attention_kernels(framework):
    """SDPA (causal, bool mask, GQA) vs numpy and the ring block kernels vs autograd of SDPA."""
    assert run_on(framework, 2, surface.attention_kernels) == [True, True]
