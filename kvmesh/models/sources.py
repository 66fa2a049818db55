"""Where a ``--model`` comes from: a local folder, or a hub id (``org/name``) found in the Hugging Face cache.

The cache is read as ``huggingface_hub`` lays it out, offline (nothing here ever touches the network, nor
imports ``huggingface_hub``: the gateway's process stays light)::

    $HF_HUB_CACHE/                       default $HF_HOME/hub, $HF_HOME default $XDG_CACHE_HOME/huggingface
      models--org--name/                 (XDG_CACHE_HOME default ~/.cache)
        refs/main                        a file holding a commit hash (a branch or tag name: refs/<name>)
        snapshots/<commit>/config.json   symlinks into ../../blobs/<hash>
        blobs/<hash>

``resolve_model(value, revision)``: an existing folder wins; else a value shaped like a hub id is looked up in
the cache (``revision``: a name in ``refs/``, or a commit hash under ``snapshots/``; default ``main``); else
``ModelLoadError`` naming every place it looked. Torch-free, below the engine and the services.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvmesh.errors import ModelLoadError

DEFAULT_REVISION = "main"
REVISION_HELP = "with a hub id --model: a branch or tag in the cache's refs/, or a commit hash (default: main)"
# huggingface_hub's repo id: an optional namespace and a name, each of letters, digits, '-', '_', '.'.
_HUB_ID = re.compile(r"^(?!\.)[A-Za-z0-9_.-]{1,96}/(?!\.)[A-Za-z0-9_.-]{1,96}$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def hub_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """The hub cache folder, as huggingface_hub finds it: $HF_HUB_CACHE, else $HUGGINGFACE_HUB_CACHE (its
    older name), else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    env = os.environ if env is None else env
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return _expand(env[name])
    if env.get("HF_HOME"):
        return _expand(env["HF_HOME"]) / "hub"
    xdg = env.get("XDG_CACHE_HOME")
    return (_expand(xdg) if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def _expand(text: str) -> Path:
    return Path(os.path.expandvars(text)).expanduser()


def is_hub_id(value: str) -> bool:
    """Shaped like ``org/name`` (no leading '/', '.', '~', one '/', no '..')."""
    return bool(_HUB_ID.match(value)) and ".." not in value


def repo_folder(hub_id: str, cache: Path) -> Path:
    """``cache/models--org--name``, huggingface_hub's folder of a model repo."""
    return cache / ("models--" + hub_id.replace("/", "--"))


@dataclass(frozen=True)
class ModelSource:
    """A ``--model`` value resolved: the folder to read, and where it came from."""

    path: Path
    hub_id: str | None = None  # set when it came from the hub cache
    revision: str | None = None  # the revision asked for (a hub id's; default main)
    commit: str | None = None  # the snapshot's commit hash

    @property
    def name(self) -> str:
        """The served model's default name: the hub id as given (vLLM's rule), else the folder's name."""
        return self.hub_id or self.path.resolve().name


def served_name(value: str | os.PathLike) -> str:
    """The name a ``--model`` value is served under, without resolving it (no cache read, never raises):
    ``resolve_source(value).name`` wherever that resolves."""
    text = os.fspath(value)
    folder = Path(text).expanduser()
    return text if is_hub_id(text) and not folder.is_dir() else folder.resolve().name


def resolve_source(
    value: str | os.PathLike, revision: str | None = None, env: Mapping[str, str] | None = None
) -> ModelSource:
    """``value`` (a folder, or a hub id in the HF cache) as a local folder; ``ModelLoadError`` naming every
    place looked when there is none. ``revision`` is a hub id's: with an existing folder it is refused."""
    text = os.fspath(value)
    folder = Path(text).expanduser()
    if folder.is_dir():
        if revision:
            raise ModelLoadError(
                f"--model {text} is a local folder ({folder.resolve()}): --revision {revision} applies to a hub id only"
            )
        return ModelSource(folder)
    looked = [f"the folder {folder.resolve()}: {'not a folder' if folder.exists() else 'no such folder'}"]
    if not is_hub_id(text):
        raise ModelLoadError(_not_found(text, looked, "and it is not a hub id (org/name)"))
    cache = hub_cache_dir(env)
    repo = repo_folder(text, cache)
    rev = revision or DEFAULT_REVISION
    if not repo.is_dir():
        looked.append(f"the Hugging Face cache {cache} ({_cache_from(env)}): no {repo.name} in it ({repo})")
        raise ModelLoadError(_not_found(text, looked, _download_hint(text, revision)))
    looked.append(f"the Hugging Face cache {cache} ({_cache_from(env)}): {repo}")
    if Path(rev).is_absolute() or ".." in Path(rev).parts:
        raise ModelLoadError(_not_found(text, looked, f"--revision {rev!r} is not a branch, tag or commit"))
    ref = repo / "refs" / rev
    if ref.is_file():
        commit = ref.read_text().strip()
        how = f"{ref} names commit {commit}"
    elif _COMMIT.match(rev):
        commit = rev
        how = f"no {ref}; {rev} taken as a commit hash"
    else:
        known = sorted(str(p.relative_to(repo / "refs")) for p in (repo / "refs").rglob("*") if p.is_file())
        looked.append(f"the ref {ref}: missing (refs there: {', '.join(known) or 'none'})")
        raise ModelLoadError(_not_found(text, looked, _download_hint(text, revision)))
    snapshot = repo / "snapshots" / commit
    if not snapshot.is_dir():
        looked.append(f"{how}; the snapshot {snapshot}: missing")
        raise ModelLoadError(_not_found(text, looked, _download_hint(text, revision)))
    return ModelSource(snapshot, hub_id=text, revision=rev, commit=commit)


def resolve_model(value: str | os.PathLike, revision: str | None = None) -> Path:
    """The local folder of a ``--model`` value (``resolve_source``'s path)."""
    return resolve_source(value, revision).path


def _cache_from(env: Mapping[str, str] | None) -> str:
    env = os.environ if env is None else env
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        if env.get(name):
            return f"from ${name}"
    return "the default; $HF_HUB_CACHE or $HF_HOME move it"


def _not_found(value: str, looked: list[str], hint: str) -> str:
    return f"--model {value}: no model found; looked at " + "; ".join(looked) + f" ({hint})"


def _download_hint(hub_id: str, revision: str | None) -> str:
    rev = f" --revision {revision}" if revision else ""
    return f"kvmesh never downloads: fetch it first, e.g. `huggingface-cli download {hub_id}{rev}`, or pass a folder"


@dataclass(frozen=True)
class HubModel:
    """A model repo in the HF cache: its id, its refs (name -> commit) and snapshot folders (commit -> path)."""

    hub_id: str
    folder: Path
    refs: dict[str, str]
    snapshots: dict[str, Path]


def hub_models(env: Mapping[str, str] | None = None) -> list[HubModel]:
    """Every model repo in the HF cache that has at least one snapshot, by id."""
    cache = hub_cache_dir(env)
    if not cache.is_dir():
        return []
    found = []
    for repo in sorted(cache.glob("models--*")):
        snaps_dir, refs_dir = repo / "snapshots", repo / "refs"
        try:
            snapshots = {p.name: p for p in sorted(snaps_dir.iterdir()) if p.is_dir()} if snaps_dir.is_dir() else {}
            refs = {
                str(ref.relative_to(refs_dir)): ref.read_text().strip()
                for ref in sorted(refs_dir.rglob("*") if refs_dir.is_dir() else ())
                if ref.is_file()
            }
        except OSError:
            continue  # a repo this user cannot read: not listed
        if not snapshots:
            continue
        hub_id = repo.name.removeprefix("models--").replace("--", "/", 1)
        found.append(HubModel(hub_id, repo, refs, snapshots))
    return found
