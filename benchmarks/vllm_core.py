"""vLLM's v1 core imported from its wheel (or source tree) with every heavy import stubbed.

``load_vllm(PATH)`` runs vLLM's own ``KVCacheManager`` and what it calls
(``vllm/v1/core``, ``vllm/v1/request.py`` and a few small modules, listed in
``VLLM_REAL``) unmodified; every other ``vllm.*`` import, and torch, cbor2,
msgspec and zmq, is a stub that accepts anything and does nothing. Used by
``bench_requests.py``; nothing of vLLM is copied here, and vLLM is not a
dependency of pagedkv. Get a wheel without installing it::

    pip download --no-deps vllm==0.33.0 -d /tmp/vllm
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import tempfile
import types
import zipfile
from collections.abc import Sequence
from typing import Any, Generic, TypeVar, overload

__all__ = ["VLLM_REAL", "load_vllm"]


#: The vLLM modules run as they are; every other ``vllm.*`` import is a stub.
VLLM_REAL = {
    "vllm.v1.core.kv_cache_manager",
    "vllm.v1.core.kv_cache_coordinator",
    "vllm.v1.core.single_type_kv_cache_manager",
    "vllm.v1.core.block_pool",
    "vllm.v1.core.kv_cache_utils",
    "vllm.v1.core.kv_cache_metrics",
    "vllm.v1.request",
    "vllm.v1.kv_cache_interface",
    "vllm.v1.kv_cache_spec_registry",
    "vllm.v1.kv_cache_layout",
    "vllm.v1.hisparse.block_pool",
    "vllm.utils.math_utils",
    "vllm.utils.hashing",
}
_STUBBED_TOPS = ("vllm", "torch", "cbor2", "msgspec", "zmq")


class _Anything:
    """What a stubbed name is: accepts any call, attribute or subscript and does nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _Anything()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __class_getitem__(cls, item: Any) -> Any:
        return cls

    def __getitem__(self, item: Any) -> Any:
        return _Anything()

    def __bool__(self) -> bool:
        return False


class _AnythingType(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __or__(cls, other: Any) -> Any:
        return cls

    def __ror__(cls, other: Any) -> Any:
        return cls


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        if full in VLLM_REAL:
            return importlib.import_module(full)
        made = _AnythingType(name, (_Anything,), {"__module__": self.__name__})
        setattr(self, name, made)
        return made


class _VllmFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Real files for ``VLLM_REAL``, stubs for every other vllm/torch/... module."""

    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name.split(".")[0] not in _STUBBED_TOPS:
            return None
        if name in VLLM_REAL:
            path = os.path.join(self.root, *name.split(".")) + ".py"
            return importlib.util.spec_from_file_location(name, path)
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _compile_from_source(
    root: str, path: str, names: set[str], namespace: dict[str, Any]
) -> dict[str, Any]:
    """Run only the top-level definitions ``names`` of ``root/path`` (vLLM's own source) in ``namespace``."""
    with open(os.path.join(root, path), encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    body = [node for node in tree.body if getattr(node, "name", None) in names]
    exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), namespace)
    return namespace


def _vllm_root(path: str) -> tuple[str, str]:
    """A folder holding ``vllm/`` (a wheel's .py files are extracted to a temporary one), and the version."""
    if os.path.isdir(path):
        root = path
    else:
        root = tempfile.mkdtemp(prefix="vllm-core-")
        with zipfile.ZipFile(path) as wheel:
            names = [n for n in wheel.namelist() if n.startswith("vllm/") and n.endswith(".py")]
            wheel.extractall(root, names)
    version = "?"
    try:
        with open(os.path.join(root, "vllm", "_version.py"), encoding="utf-8") as handle:
            for line in handle:
                if line.startswith(("__version__", "version")) and "=" in line:
                    version = line.rsplit("=", 1)[1].strip().strip("'\"")
                    break
    except OSError:
        pass
    return root, version


def load_vllm(path: str) -> tuple[types.SimpleNamespace, str]:
    """vLLM's ``KVCacheManager`` and friends, from a wheel or an extracted folder."""
    root, version = _vllm_root(path)
    sys.meta_path.insert(0, _VllmFinder(root))
    envs = importlib.import_module("vllm.envs")
    envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES = False  # type: ignore[attr-defined]
    importlib.import_module("vllm.logger").init_logger = logging.getLogger  # type: ignore[attr-defined]
    v1_utils = importlib.import_module("vllm.v1.utils")
    generic = {"Generic": Generic, "Sequence": Sequence, "T": TypeVar("T"), "overload": overload}
    v1_utils.ConstantList = _compile_from_source(  # type: ignore[attr-defined]
        root, "vllm/v1/utils.py", {"ConstantList"}, generic
    )["ConstantList"]
    utils = importlib.import_module("vllm.utils")
    utils.length_from_prompt_token_ids_or_embeds = _compile_from_source(  # type: ignore[attr-defined]
        root, "vllm/utils/__init__.py", {"length_from_prompt_token_ids_or_embeds"},
        {"torch": importlib.import_module("torch")},
    )["length_from_prompt_token_ids_or_embeds"]

    class NoStructuredOutput:
        @staticmethod
        def from_sampling_params(sampling_params: Any) -> None:
            return None

    importlib.import_module("vllm.v1.structured_output.request").StructuredOutputRequest = (  # type: ignore[attr-defined]
        NoStructuredOutput
    )
    modules = types.SimpleNamespace(
        manager=importlib.import_module("vllm.v1.core.kv_cache_manager"),
        utils=importlib.import_module("vllm.v1.core.kv_cache_utils"),
        request=importlib.import_module("vllm.v1.request"),
        interface=importlib.import_module("vllm.v1.kv_cache_interface"),
        hashing=importlib.import_module("vllm.utils.hashing"),
    )
    return modules, version
