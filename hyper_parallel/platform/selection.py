"""Choosing the platform from the environment, once per process."""
from typing import Any
import importlib
import importlib.util
import os
import threading

VALID_PLATFORMS = ("torch", "npu", "mindspore")
_ENV_NAMES = ("HP_PLATFORM", "HYPER_PARALLEL_PLATFORM")

# Each name maps to (module holding the Platform class, class name, frameworks it imports).
_IMPLEMENTATIONS = {
    "torch": ("hyper_parallel.platform.torch.platform", "TorchPlatform", ("torch",)),
    "npu": ("hyper_parallel.platform.npu.platform", "NpuPlatform", ("torch", "torch_npu")),
    "mindspore": ("hyper_parallel.platform.mindspore.platform", "MindSporePlatform", ("mindspore",)),
}
_EXTRAS = {"torch": "pip install 'hyper-parallel' torch", "npu": "pip install 'hyper-parallel[npu]'",
           "mindspore": "pip install 'hyper-parallel[mindspore]'"}

_lock = threading.Lock()
_platform = None


def _requested_name():
    for env in _ENV_NAMES:
        value = os.environ.get(env)
        if value:
            name = value.strip().lower()
            if name not in VALID_PLATFORMS:
                raise ValueError(
                    f"{env}={value!r} is not a platform; valid values are {', '.join(VALID_PLATFORMS)} "
                    f"(case-insensitive), or leave it unset to pick torch, else mindspore.")
            return name
    return None


def _installed(module_name):
    return importlib.util.find_spec(module_name) is not None


def _default_name():
    if _installed("torch"):
        return "torch"
    if _installed("mindspore"):
        return "mindspore"
    raise ImportError(
        "hyper_parallel needs PyTorch or MindSpore and neither is installed. Install one: "
        "`pip install torch` (CPU: `pip install torch --index-url <cpu wheels>`), "
        "`pip install 'hyper-parallel[npu]'` for Ascend, or `pip install 'hyper-parallel[mindspore]'`.")


def _create(name):
    module_name, class_name, frameworks = _IMPLEMENTATIONS[name]
    for framework in frameworks:
        if not _installed(framework):
            raise ImportError(
                f"HP_PLATFORM={name} needs the framework '{framework}', which is not installed. "
                f"Install it ({_EXTRAS[name]}) or choose another platform with HP_PLATFORM.")
    module = importlib.import_module(module_name)
    return getattr(module, class_name)()


def get_platform() -> Any:
    """The process-wide platform, created on first use."""
    global _platform
    if _platform is None:
        with _lock:
            if _platform is None:
                _platform = _create(_requested_name() or _default_name())
    return _platform


_on_reset: list[Any] = []


def on_reset(callback: Any) -> None:
    """Call ``callback()`` at every ``reset_platform()``: caches of values built for one platform
    (core's bounded caches) empty themselves there, without platform/ importing them."""
    _on_reset.append(callback)


def reset_platform() -> None:
    """Forget the cached platform (tests that switch HP_PLATFORM use this) and everything cached
    for it."""
    global _platform
    with _lock:
        _platform = None
    for callback in list(_on_reset):
        callback()
