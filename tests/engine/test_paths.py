"""engine/paths.py: settings, keys, chat history and data in separate folders on every OS, and
earlier versions' files moved into them without losing one. The OS is faked through
sys.platform (engine.platform.system() reads it on every call) and a fake environment."""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from engine import paths

REPO = Path(__file__).resolve().parents[2]
OS_PLATFORM = {"windows": "win32", "macos": "darwin", "linux": "linux"}


@pytest.fixture
def fake_os(monkeypatch, tmp_path):
    """fake_os("windows") -> the faked home folder; the environment holds only what that OS sets."""

    def make(system: str) -> Path:
        home = tmp_path / "home"
        home.mkdir(exist_ok=True)
        monkeypatch.setattr(sys, "platform", OS_PLATFORM[system])
        for var in ("FLOTILLA_CONFIG", "FLOTILLA_DATA", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "LOCALAPPDATA",
                    "USERPROFILE"):
            monkeypatch.delenv(var, raising=False)
        if system == "windows":
            monkeypatch.setenv("USERPROFILE", str(home))
            monkeypatch.setenv("LOCALAPPDATA", str(home / "AppData" / "Local"))
        else:
            monkeypatch.setenv("HOME", str(home))
        return home

    return make


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under root: relative path -> content."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _separate(f: paths.Folders) -> None:
    dirs = [f.settings, f.keys, f.history, f.data]
    assert len(set(dirs)) == 4
    for a in dirs:
        for b in dirs:
            assert a == b or a not in b.parents, f"{b} is inside {a}: removing {a.name} would remove it"


@pytest.mark.parametrize("system", ["windows", "macos", "linux"])
def test_each_os_has_four_separate_folders(fake_os, system):
    home = fake_os(system)
    f = paths.folders()
    _separate(f)
    expected_root = {"windows": home / "AppData" / "Local" / "flotilla",
                     "macos": home / "Library" / "Application Support" / "flotilla",
                     "linux": home / ".config" / "flotilla"}[system]
    assert f.settings == expected_root / "settings" and f.keys == expected_root / "keys"
    data_root = home / ".local" / "share" / "flotilla" if system == "linux" else expected_root
    assert f.history == data_root / "history" and f.data == data_root / "data"
    # Through the fleet's and the catalog's accessors too (the same folders, created):
    from engine.fleet.paths import config_dir, data_dir
    from engine.models.catalog import config_dir as models_dir

    assert config_dir() == f.keys and data_dir() == f.data and models_dir() == f.settings
    assert f.keys.is_dir() and f.data.is_dir()  # the fleet's accessors create theirs
    assert not f.settings.exists() and paths.settings_dir().is_dir()  # listing models writes nothing


def test_removing_settings_keeps_the_chat_history_on_windows(fake_os):
    """The uninstaller's "remove settings" removes exactly that folder (installers/windows)."""
    fake_os("windows")
    (paths.settings_dir() / "app_settings.json").write_text("{}")
    (paths.history_dir() / "conversations.sqlite3").write_bytes(b"chats")
    (paths.keys_dir() / "node_key.secret").write_text("secret")
    shutil.rmtree(paths.folders().settings)
    assert (paths.folders().history / "conversations.sqlite3").read_bytes() == b"chats"
    assert (paths.folders().keys / "node_key.secret").read_text() == "secret"


def test_linux_xdg_variables_and_relative_ones_ignored(fake_os, monkeypatch, tmp_path):
    home = fake_os("linux")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.setenv("XDG_DATA_HOME", "relative/data")  # the XDG spec says: ignore it
    f = paths.resolve()
    assert f.keys == tmp_path / "cfg" / "flotilla" / "keys"
    assert f.history == home / ".local" / "share" / "flotilla" / "history"


def test_the_legacy_roots_are_where_platformdirs_put_earlier_versions_files():
    """On the OS this runs on (Linux here; Windows and macOS on the hosted runners)."""
    import platformdirs

    config, data = paths.platform_roots()
    assert config == Path(platformdirs.user_config_dir("flotilla", appauthor=False))
    assert data == Path(platformdirs.user_data_dir("flotilla", appauthor=False))


def test_the_legacy_roots_of_windows_and_macos_are_platformdirs_ones(monkeypatch, tmp_path):
    """platformdirs' own Windows and macOS classes, run here with their OS call faked: earlier
    versions' folders are where migration looks, and the model cache folder (which the
    uninstaller offers to remove, installers/windows/flotilla.iss CacheDir) is inside the root."""
    import platformdirs.macos
    import platformdirs.windows

    local = tmp_path / "Local"
    monkeypatch.setattr(platformdirs.windows, "get_win_folder",
                        lambda csidl: {"CSIDL_LOCAL_APPDATA": str(local)}[csidl])
    win = platformdirs.windows.Windows("flotilla", appauthor=False)
    root = paths.platform_roots("windows", {"LOCALAPPDATA": str(local), "USERPROFILE": str(tmp_path)})
    assert root == (Path(win.user_config_dir), Path(win.user_data_dir))
    assert Path(win.user_cache_dir) == root[0] / "Cache"
    monkeypatch.setenv("HOME", str(tmp_path))
    mac = platformdirs.macos.MacOS("flotilla", appauthor=False)
    assert paths.platform_roots("macos", {"HOME": str(tmp_path)}) == (Path(mac.user_config_dir),
                                                                      Path(mac.user_data_dir))


def _legacy_files(root: Path, names) -> None:
    for name in names:
        if paths.LEGACY_NAMES[name] == paths.DATA:
            (root / name / "sub").mkdir(parents=True)
            (root / name / "sub" / "f.bin").write_bytes(f"{name}-content".encode())
        else:
            (root / name).write_bytes(f"{name}-content".encode())


@pytest.mark.parametrize("system", ["windows", "macos"])
def test_migration_from_one_flat_folder(fake_os, system):
    """Windows and macOS: earlier versions kept config and data flat in one folder."""
    fake_os(system)
    root = paths.platform_roots()[0]
    root.mkdir(parents=True)
    _legacy_files(root, paths.LEGACY_NAMES)
    (root / "notes.txt").write_text("unknown: stays")
    (root / "Cache").mkdir()  # platformdirs' cache folder on Windows: not ours to move
    (root / "Cache" / "model.bin").write_bytes(b"m")
    before = _tree(root)
    f = paths.folders()
    for name, kind in paths.LEGACY_NAMES.items():
        assert not (root / name).exists(), name
        moved = f.of(kind) / name
        assert moved.exists(), f"{name} not in {kind}"
    assert (root / "notes.txt").read_text() == "unknown: stays" and (root / "Cache" / "model.bin").exists()
    after = _tree(root)
    assert sorted(before.values()) == sorted(after.values()), "a file was lost or changed"
    assert paths.migrate(f) == []  # idempotent


def test_migration_on_linux_from_config_and_data_roots(fake_os):
    home = fake_os("linux")
    cfg_root, data_root = home / ".config" / "flotilla", home / ".local" / "share" / "flotilla"
    cfg_root.mkdir(parents=True)
    data_root.mkdir(parents=True)
    _legacy_files(cfg_root, [n for n, k in paths.LEGACY_NAMES.items() if k in (paths.SETTINGS, paths.KEYS)])
    _legacy_files(data_root, [n for n, k in paths.LEGACY_NAMES.items() if k in (paths.HISTORY, paths.DATA)])
    f = paths.folders()
    assert (f.keys / "node_key.secret").read_bytes() == b"node_key.secret-content"
    assert (f.settings / "app_settings.json").exists() and (f.history / "conversations.sqlite3-wal").exists()
    assert (f.data / "shards" / "sub" / "f.bin").read_bytes() == b"shards-content"
    assert sorted(p.name for p in cfg_root.iterdir()) == ["keys", "settings"]
    assert sorted(p.name for p in data_root.iterdir()) == ["data", "history"]


def test_a_taken_place_keeps_both_files(fake_os):
    """An older version ran again after the move and wrote a new key flat: neither is lost."""
    fake_os("windows")
    f = paths.folders()
    root = f.legacy[0]
    (paths.keys_dir() / "node_key.secret").write_text("new")
    (root / "node_key.secret").write_text("old")
    (f.keys / "node_key.secret.pre-migration").write_text("older")
    moves = paths.migrate(f)
    assert [(m.target.name, m.conflict) for m in moves] == [("node_key.secret.pre-migration-2", True)]
    assert (f.keys / "node_key.secret").read_text() == "new"
    assert (f.keys / "node_key.secret.pre-migration").read_text() == "older"
    assert (f.keys / "node_key.secret.pre-migration-2").read_text() == "old"


def test_a_database_moves_with_its_write_ahead_log_and_never_joins_another(fake_os):
    """A new history database exists already: the old one is kept beside it, and its -wal
    takes the old one's new name, not the new database's (SQLite would replay it into that)."""
    fake_os("windows")
    f = paths.folders()
    root = f.legacy[0]
    (paths.history_dir() / "conversations.sqlite3").write_bytes(b"new db")
    (root / "conversations.sqlite3").write_bytes(b"old db")
    (root / "conversations.sqlite3-wal").write_bytes(b"old wal")
    (root / "conversations.sqlite3-shm").write_bytes(b"old shm")
    paths.migrate(f)
    assert (f.history / "conversations.sqlite3").read_bytes() == b"new db"
    assert not (f.history / "conversations.sqlite3-wal").exists()
    assert (f.history / "conversations.sqlite3.pre-migration").read_bytes() == b"old db"
    assert (f.history / "conversations.sqlite3.pre-migration-wal").read_bytes() == b"old wal"
    assert (f.history / "conversations.sqlite3.pre-migration-shm").read_bytes() == b"old shm"


def test_a_file_that_cannot_move_stays(fake_os, monkeypatch):
    """Windows refuses to rename a file another process holds open: it stays, nothing breaks."""
    fake_os("windows")
    root = paths.platform_roots()[0]
    root.mkdir(parents=True)
    (root / "conversations.sqlite3").write_bytes(b"chats")
    (root / "models.json").write_text("[]")
    real = os.rename

    def rename(src, dst):
        if Path(src).name == "conversations.sqlite3":
            raise PermissionError(32, "The process cannot access the file")
        return real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    (root / "conversations.sqlite3-wal").write_bytes(b"log")
    moves = paths.migrate(paths.resolve())
    assert [m.source.name for m in moves] == ["models.json"]
    assert (root / "conversations.sqlite3").read_bytes() == b"chats"
    assert (root / "conversations.sqlite3-wal").read_bytes() == b"log"  # stays with its database


def test_overrides_are_flat_and_never_migrate(fake_os, monkeypatch, tmp_path):
    fake_os("windows")
    root = paths.platform_roots()[0]
    root.mkdir(parents=True)
    (root / "node_key.secret").write_text("real user's key")
    monkeypatch.setenv("FLOTILLA_CONFIG", str(tmp_path / "cfg"))
    f = paths.folders()
    assert f.settings == f.keys == tmp_path / "cfg"
    assert f.history == tmp_path / "cfg" / "history" and f.data == tmp_path / "cfg" / "data"
    assert f.legacy == () and (root / "node_key.secret").exists()
    monkeypatch.setenv("FLOTILLA_DATA", str(tmp_path / "data"))
    f = paths.folders()
    assert f.history == f.data == tmp_path / "data" and f.keys == tmp_path / "cfg"


def test_data_override_alone_migrates_settings_and_keys_only(fake_os, monkeypatch, tmp_path):
    fake_os("windows")
    root = paths.platform_roots()[0]
    root.mkdir(parents=True)
    (root / "node_key.public").write_text("k")
    (root / "conversations.sqlite3").write_bytes(b"c")
    monkeypatch.setenv("FLOTILLA_DATA", str(tmp_path / "data"))
    f = paths.folders()
    assert f.history == f.data == tmp_path / "data"
    assert (f.keys / "node_key.public").exists()
    assert (root / "conversations.sqlite3").exists()  # the user moved their data elsewhere: not ours


def test_legacy_names_are_the_files_the_code_writes():
    """Every name the migration knows is a constant of the module that writes it, and every file
    the fleet writes into its data folder is known."""
    from app.settings import FILE as APP_SETTINGS
    from app.chat.store import DB_NAME
    from engine.client.agent import TRAY_FILE
    from engine.transport import security
    from engine.fleet.discovery import MANUAL_FILE
    from engine.fleet.identity import IDENTITY_FILE
    from engine.fleet.policy import POLICY_FILE
    from engine.models.catalog import MODELS_FILE

    writers = {APP_SETTINGS: paths.SETTINGS, MODELS_FILE: paths.SETTINGS, DB_NAME: paths.HISTORY,
               TRAY_FILE: paths.KEYS, MANUAL_FILE: paths.KEYS, IDENTITY_FILE: paths.KEYS, POLICY_FILE: paths.KEYS,
               security.SECRET_FILE: paths.KEYS, security.PUBLIC_FILE: paths.KEYS, security.ALLOW_FILE: paths.KEYS,
               security.PENDING_FILE: paths.KEYS, security.KNOWN_AGENTS_FILE: paths.KEYS}
    for name, kind in writers.items():
        assert paths.LEGACY_NAMES.get(name) == kind, name
    agent_src = "".join((REPO / "engine" / "fleet" / name).read_text(encoding="utf-8")
                        for name in ("agent.py", "agent_process.py"))
    data_names = set(re.findall(r'\.data / "(\w+)"', agent_src)) | set(re.findall(r'\bdata / "(\w+)"', agent_src))
    assert data_names and all(paths.LEGACY_NAMES.get(n) == paths.DATA for n in data_names), data_names


def test_module_cli_prints_the_folders(fake_os, capsys):
    fake_os("macos")
    assert paths.main([]) == 0
    out = capsys.readouterr().out
    assert '"history"' in out and "Application Support" in out
    assert paths.main(["migrate"]) == 0
