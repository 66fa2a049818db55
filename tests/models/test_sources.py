"""``--model`` sources: a folder wins, else a hub id from a fake HF cache laid out as huggingface_hub writes it;
a miss names every place looked."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from kvmesh.errors import ModelLoadError
from kvmesh.models.sources import hub_cache_dir, hub_models, is_hub_id, resolve_model, resolve_source

from .hf_cache import add_snapshot

ID = "acme/tiny-chat"
MAIN = "a" * 40
V2 = "b" * 40
PINNED = "c" * 40


def _files(root: Path, config: str) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(config)
    (root / "model.safetensors").write_bytes(b"weights-" + config.encode())
    (root / "sub").mkdir()
    (root / "sub" / "notes.txt").write_text("x")
    return root


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    """HF_HOME set (and nothing else); its hub/ holds ID at three commits: main, the branch v2, one only by hash."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)
    cache = tmp_path / "hf" / "hub"
    add_snapshot(cache, ID, _files(tmp_path / "src-main", '{"v": "main"}'), MAIN)
    add_snapshot(cache, ID, _files(tmp_path / "src-v2", '{"v": "v2"}'), V2, refs=("v2",))
    add_snapshot(cache, ID, _files(tmp_path / "src-pinned", '{"v": "pinned"}'), PINNED, refs=())
    return cache


def test_the_fake_cache_is_huggingface_hubs_layout(hf_home):
    repo = hf_home / "models--acme--tiny-chat"
    link = repo / "snapshots" / MAIN / "sub" / "notes.txt"
    assert link.is_symlink() and os.readlink(link).startswith("../../../blobs/")
    assert (repo / "refs" / "main").read_text() == MAIN
    # huggingface_hub's own reader of the layout agrees (offline: it only scans the folder)
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(hf_home)
    (repo_info,) = info.repos
    assert repo_info.repo_id == ID and {r.commit_hash for r in repo_info.revisions} == {MAIN, V2, PINNED}
    assert {ref for r in repo_info.revisions for ref in r.refs} == {"main", "v2"}


def test_a_hub_id_resolves_to_its_snapshot_by_ref_or_commit(hf_home):
    src = resolve_source(ID)
    assert src.path == hf_home / "models--acme--tiny-chat" / "snapshots" / MAIN
    assert (src.hub_id, src.revision, src.commit, src.name) == (ID, "main", MAIN, ID)
    assert (src.path / "config.json").read_text() == '{"v": "main"}'  # through the symlink into blobs/
    assert (resolve_model(ID, "v2") / "config.json").read_text() == '{"v": "v2"}'
    assert (resolve_model(ID, PINNED) / "config.json").read_text() == '{"v": "pinned"}'
    assert resolve_source(ID, PINNED).commit == PINNED


def test_an_existing_folder_wins_over_the_cache(hf_home, tmp_path):
    folder = _files(tmp_path / "acme" / "tiny-chat", '{"v": "folder"}')  # the id is also a relative path here
    src = resolve_source(ID)
    assert src.path == Path(ID) and src.hub_id is None and src.name == "tiny-chat"
    assert (src.path / "config.json").read_text() == '{"v": "folder"}'
    assert resolve_source(folder).path == folder
    with pytest.raises(ModelLoadError, match="is a local folder .* --revision v2 applies to a hub id only"):
        resolve_source(ID, "v2")


def test_hf_hub_cache_wins_over_hf_home(hf_home, tmp_path, monkeypatch):
    assert hub_cache_dir() == hf_home
    other = tmp_path / "elsewhere"
    add_snapshot(other, ID, _files(tmp_path / "src-other", '{"v": "other"}'), V2)
    monkeypatch.setenv("HF_HUB_CACHE", str(other))
    assert hub_cache_dir() == other
    assert (resolve_model(ID) / "config.json").read_text() == '{"v": "other"}'
    env = {"XDG_CACHE_HOME": "/x"}
    assert hub_cache_dir(env) == Path("/x/huggingface/hub")
    assert hub_cache_dir({}) == Path.home() / ".cache" / "huggingface" / "hub"
    assert hub_cache_dir({"HF_HOME": "/h", "XDG_CACHE_HOME": "/x"}) == Path("/h/hub")


def test_a_missing_repo_names_the_folder_the_cache_and_the_repo_folder(hf_home, tmp_path):
    with pytest.raises(ModelLoadError) as e:
        resolve_model("acme/absent")
    msg = e.value.message
    assert f"the folder {tmp_path / 'acme' / 'absent'}: no such folder" in msg
    assert f"the Hugging Face cache {hf_home} (from $HF_HOME)" in msg
    assert str(hf_home / "models--acme--absent") in msg
    assert "never downloads" in msg


def test_a_missing_ref_names_the_ref_and_the_refs_there(hf_home):
    with pytest.raises(ModelLoadError) as e:
        resolve_model(ID, "v3")
    msg = e.value.message
    assert str(hf_home / "models--acme--tiny-chat" / "refs" / "v3") + ": missing (refs there: main, v2)" in msg
    assert "the folder " in msg and str(hf_home / "models--acme--tiny-chat") in msg


def test_a_missing_snapshot_names_the_ref_its_commit_and_the_snapshot(hf_home):
    repo = hf_home / "models--acme--tiny-chat"
    (repo / "refs" / "broken").write_text("d" * 40)
    with pytest.raises(ModelLoadError) as e:
        resolve_model(ID, "broken")
    msg = e.value.message
    assert f"{repo / 'refs' / 'broken'} names commit {'d' * 40}" in msg
    assert f"the snapshot {repo / 'snapshots' / ('d' * 40)}: missing" in msg
    with pytest.raises(ModelLoadError, match=re.escape(f"{repo / 'snapshots' / ('e' * 40)}: missing")):
        resolve_model(ID, "e" * 40)


def test_neither_a_folder_nor_a_hub_id(hf_home):
    with pytest.raises(ModelLoadError, match="no such folder.*not a hub id"):
        resolve_model("/nowhere/model")
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("org/a.b_c-d")
    assert not any(map(is_hub_id, ["/abs/path", "./x/y", "a/b/c", "../x", "x", "~/m", "a/.."]))


def test_hub_models_lists_each_repo_its_refs_and_snapshots(hf_home):
    (model,) = hub_models()
    assert model.hub_id == ID
    assert model.refs == {"main": MAIN, "v2": V2}
    assert set(model.snapshots) == {MAIN, V2, PINNED}


def test_models_list_shows_the_hub_models_beside_the_installed_ones(hf_home, tmp_path, monkeypatch, capsys):
    from kvmesh.cli import main

    monkeypatch.setenv("KVMESH_MODELS_DIR", str(tmp_path / "no-installs"))
    repo = hf_home / "models--acme--tiny-chat"
    assert main(["models", "list", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["name"] == ID and row["source"] == "hf-cache"
    assert row["path"] == str(repo / "snapshots" / MAIN)
    assert row["refs"] == {"main": MAIN, "v2": V2}
    assert row["snapshots"] == {c: str(repo / "snapshots" / c) for c in (MAIN, V2, PINNED)}
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert f"no models installed in {tmp_path / 'no-installs'}" in out
    assert f"hub models in the Hugging Face cache {hf_home}" in out
    assert f"  {ID}\n" in out
    assert f"    {MAIN[:12]} (main)  {repo / 'snapshots' / MAIN}" in out
    assert f"    {V2[:12]} (v2)  {repo / 'snapshots' / V2}" in out
    assert f"    {PINNED[:12]} (no ref: --revision <commit>)" in out


def test_served_name_is_the_resolved_sources_name_without_reading_the_cache(hf_home, tmp_path):
    from kvmesh.models.sources import served_name

    assert served_name(ID) == resolve_source(ID).name == ID
    assert served_name("acme/absent") == "acme/absent"  # never raises
    assert served_name("/models/tiny-llama") == "tiny-llama"
    folder = _files(tmp_path / "acme" / "tiny-chat", "{}")
    assert served_name(ID) == resolve_source(ID).name == "tiny-chat" == served_name(folder)
