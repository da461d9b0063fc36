"""Where Flotilla keeps a user's files: one folder per kind, so each can be removed alone.

    settings  the app's preferences (app_settings.json) and remembered model folders (models.json)
    keys      this PC's fleet identity: its CurveZMQ key pair, node id, paired controllers and
              agents, pending pairings, and the agent files read beside them (sharing policy,
              manual peers, tray state): engine.fleet.paths.config_dir()
    history   chat history (conversations.sqlite3)
    data      the agent's shards, logs and worker run files (big; re-created on demand)

The model cache (demo models, exported IRs) is $FLOTILLA_CACHE or the user cache folder
(engine/models/demo.py); it is not one of these.

Per OS, when no override is set (engine.platform.system() decides, read on every call, so tests
fake the OS with monkeypatch.setattr(sys, "platform", "win32") and a fake environment):

    Windows  %LOCALAPPDATA%\\flotilla\\{settings,keys,history,data}
    macOS    ~/Library/Application Support/flotilla/{settings,keys,history,data}
    Linux    $XDG_CONFIG_HOME/flotilla/{settings,keys}  $XDG_DATA_HOME/flotilla/{history,data}

Why subfolders: earlier versions used platformdirs' config and data folders, which on Windows
and macOS are the same folder, so the uninstaller's "remove settings" also deleted the chat
history. Files found flat in those earlier folders (LEGACY_NAMES) are moved into their kind's
folder on first use in a process (migrate): a rename on the same disk, never a copy; a file
whose new place is taken is kept beside it as NAME.pre-migration (never overwritten); an
unknown file stays where it is. Nothing is ever deleted here.

Overrides (tests, a second agent on one PC, `flotilla demo`): $FLOTILLA_CONFIG holds settings
and keys flat, as it always did; $FLOTILLA_DATA holds history and data; with only
$FLOTILLA_CONFIG set, data and history are its data/ and history/ subfolders, so one variable
isolates everything. No migration touches an overridden folder.

    python -m engine.paths            # the folders, as JSON
    python -m engine.paths migrate    # move earlier versions' files now (the Windows uninstaller
                                      # runs this before it asks which folders to remove)
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

APP = "flotilla"
SETTINGS, KEYS, HISTORY, DATA = "settings", "keys", "history", "data"
KINDS = (SETTINGS, KEYS, HISTORY, DATA)
CONFLICT_SUFFIX = ".pre-migration"
SQLITE_SIDE = ("-wal", "-shm", "-journal")  # SQLite's files beside a database, named after it

# Every file or folder earlier versions wrote flat into their config/data folders, by kind.
# (= the constants of the modules that write them; tests/engine/test_paths.py checks they agree.)
LEGACY_NAMES: dict[str, str] = {
    "app_settings.json": SETTINGS,  # app/settings.py FILE
    "models.json": SETTINGS,  # engine/models/catalog.py MODELS_FILE
    "node_key.secret": KEYS,  # engine/transport/security.py SECRET_FILE
    "node_key.public": KEYS,  # PUBLIC_FILE
    "paired_controllers.json": KEYS,  # ALLOW_FILE
    "pairing_requests.json": KEYS,  # PENDING_FILE
    "paired_agents.json": KEYS,  # KNOWN_AGENTS_FILE
    "identity.json": KEYS,  # engine/fleet/identity.py IDENTITY_FILE
    "sharing_policy.json": KEYS,  # engine/fleet/policy.py POLICY_FILE (the agent reads it from its config)
    "manual_peers.json": KEYS,  # engine/fleet/discovery.py MANUAL_FILE
    "tray.json": KEYS,  # engine/client/agent.py TRAY_FILE
    "conversations.sqlite3": HISTORY,  # app/chat/store.py DB_NAME, with SQLite's side files:
    "conversations.sqlite3-wal": HISTORY,
    "conversations.sqlite3-shm": HISTORY,
    "conversations.sqlite3-journal": HISTORY,
    "shards": DATA,  # engine/fleet/agent.py: data/shards, data/logs, data/run
    "logs": DATA,
    "run": DATA,
}

log = logging.getLogger("flotilla.paths")


@dataclass(frozen=True)
class Folders:
    """The four folders of one user, and where earlier versions kept their files."""

    settings: Path  # app preferences, remembered model folders
    keys: Path  # fleet identity and pairing (the fleet's config_dir)
    history: Path  # chat history
    data: Path  # shards, logs, worker run files
    legacy: tuple[Path, ...] = ()  # earlier versions' flat folders to migrate from (none when overridden)

    def of(self, kind: str) -> Path:
        return getattr(self, kind)


@dataclass(frozen=True)
class Move:
    """One migrated entry."""

    source: Path  # where it was
    target: Path  # where it is now
    conflict: bool  # its new place was taken: kept as NAME.pre-migration beside it


def _system() -> str:
    from engine.platform import system

    return system()


def _home(system: str, env: Mapping[str, str]) -> Path:
    # Path.home() reads USERPROFILE on Windows and HOME elsewhere; read the same from env so a
    # faked OS in a test sees the fake environment.
    raw = env.get("USERPROFILE") if system == "windows" else env.get("HOME")
    return Path(raw) if raw else Path.home()


def _xdg(env: Mapping[str, str], var: str, default: Path) -> Path:
    raw = (env.get(var) or "").strip()
    return Path(raw) if raw and os.path.isabs(raw) else default  # the XDG spec ignores relative values


def platform_roots(system: str | None = None, env: Mapping[str, str] | None = None) -> tuple[Path, Path]:
    """(config root, data root) of this OS: where earlier versions kept their files flat (the
    same folders platformdirs names) and the parents of the new folders. One folder on
    Windows and macOS."""
    system = system or _system()
    env = os.environ if env is None else env
    home = _home(system, env)
    if system == "windows":
        root = Path(env.get("LOCALAPPDATA") or home / "AppData" / "Local") / APP
        return root, root
    if system == "macos":
        root = home / "Library" / "Application Support" / APP
        return root, root
    return (_xdg(env, "XDG_CONFIG_HOME", home / ".config") / APP,
            _xdg(env, "XDG_DATA_HOME", home / ".local" / "share") / APP)


def default_folders(system: str | None = None, env: Mapping[str, str] | None = None) -> Folders:
    """The folders of this OS with no override, plus the legacy roots to migrate from."""
    config, data = platform_roots(system, env)
    legacy = (config,) if config == data else (config, data)
    return Folders(settings=config / SETTINGS, keys=config / KEYS, history=data / HISTORY, data=data / DATA,
                   legacy=legacy)


def resolve(system: str | None = None, env: Mapping[str, str] | None = None) -> Folders:
    """The folders in effect: overrides applied (see the module docstring), not created."""
    env = os.environ if env is None else env
    cfg = Path(env["FLOTILLA_CONFIG"]).expanduser() if env.get("FLOTILLA_CONFIG") else None
    dat = Path(env["FLOTILLA_DATA"]).expanduser() if env.get("FLOTILLA_DATA") else None
    if cfg is not None:  # nothing of the OS's folders is used: nothing to migrate
        return Folders(cfg, cfg, dat or cfg / HISTORY, dat or cfg / DATA, legacy=())
    base = default_folders(system, env)
    if dat is not None:  # settings and keys are the OS's (migrated); history and data are not
        return Folders(base.settings, base.keys, dat, dat, legacy=base.legacy)
    return base


def _free_name(target: Path) -> Path:
    """NAME.pre-migration, or NAME.pre-migration-2, ... whichever does not exist."""
    candidate = target.with_name(target.name + CONFLICT_SUFFIX)
    n = 2
    while candidate.exists() or candidate.is_symlink():
        candidate = target.with_name(f"{target.name}{CONFLICT_SUFFIX}-{n}")
        n += 1
    return candidate


def _move(source: Path, target: Path) -> Move | None:
    conflict = target.exists() or target.is_symlink()
    dest = _free_name(target) if conflict else target
    try:
        # A rename on the same disk (the new folders are inside the old ones): all or nothing.
        # On Windows os.rename refuses an existing target, so a racing process cannot be
        # overwritten there; on POSIX the window between the check and the rename is one call.
        os.rename(source, dest)
    except FileNotFoundError:
        return None  # another process moved it first
    except OSError as e:  # e.g. a file held open by a running older agent on Windows: left in place
        log.warning("paths: could not move %s to %s (%s); left where it is", source, dest, e)
        return None
    log.info("paths: moved %s to %s%s", source, dest, " (its new place was taken)" if conflict else "")
    return Move(source, dest, conflict)


def migrate(folders: Folders) -> list[Move]:
    """Move every known entry of the legacy roots into its kind's folder (only kinds whose
    folder is not overridden, i.e. is inside a legacy root). Unknown entries stay. A SQLite
    database moves with its side files (-wal, -shm, -journal), which take its new name: a
    write-ahead log must never end up beside another database; side files whose database
    did not move stay where they are."""
    moves: list[Move] = []
    for root in folders.legacy:
        try:
            entries = sorted(p for p in root.iterdir())
        except OSError:
            continue  # no earlier version here
        for entry in entries:
            kind = LEGACY_NAMES.get(entry.name)
            if kind is None or _side_of(entry.name):
                continue
            target_dir = folders.of(kind)
            if target_dir.parent != root:
                continue  # that kind is overridden (or lives under the other root): not ours to move
            ensure_private_dir(target_dir)
            done = _move(entry, target_dir / entry.name)
            if done is None:
                continue
            moves.append(done)
            for suffix in SQLITE_SIDE:
                side = root / (entry.name + suffix)
                if side.name in LEGACY_NAMES and (side.exists() or side.is_symlink()):
                    moved = _move(side, done.target.with_name(done.target.name + suffix))
                    if moved is not None:
                        moves.append(moved)
    return moves


def _side_of(name: str) -> str | None:
    """The database a SQLite side file belongs to ("x.sqlite3-wal" -> "x.sqlite3"), else None."""
    for suffix in SQLITE_SIDE:
        if name.endswith(suffix) and name[: -len(suffix)] in LEGACY_NAMES:
            return name[: -len(suffix)]
    return None


def ensure_private_dir(path: Path) -> Path:
    """mkdir -p with mode 0700: other local users must not read our keys or chats."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


_lock = threading.Lock()
_migrated: set[Folders] = set()


def folders() -> Folders:
    """The folders in effect, migrated from earlier versions once per process (not created)."""
    f = resolve()
    if f.legacy and f not in _migrated:
        with _lock:
            if f not in _migrated:
                migrate(f)
                _migrated.add(f)
    return f


def settings_dir() -> Path:
    """The app's preferences (created)."""
    return ensure_private_dir(folders().settings)


def keys_dir() -> Path:
    """This PC's fleet identity and pairing keys (created): the fleet's config_dir()."""
    return ensure_private_dir(folders().keys)


def history_dir() -> Path:
    """Chat history (created)."""
    return ensure_private_dir(folders().history)


def data_dir() -> Path:
    """Shards, logs, worker run files (created)."""
    return ensure_private_dir(folders().data)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["migrate"]:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        moves = migrate(resolve())
        print(f"moved {len(moves)} entries")
        return 0
    if argv:
        print("usage: python -m engine.paths [migrate]", file=sys.stderr)
        return 2
    f = resolve()
    print(json.dumps({k: str(v) for k, v in asdict(f).items() if k != "legacy"}
                     | {"legacy": [str(p) for p in f.legacy]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())


def write_private(path: Path, data: bytes | str) -> None:
    """Atomically replace path with data, mode 0600 from the first byte on
    (a temp file created 0600, then renamed): a crash leaves the old file or
    the new one, never half of one, and the secret is never world-readable."""
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o600) if hasattr(os, "fchmod") else None
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_json(path: Path, default: Any) -> Any:
    """The JSON in path, or default if it is missing or unreadable (a corrupt
    settings file must not keep the agent from starting; it is rewritten)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def write_json(path: Path, obj: Any) -> None:
    write_private(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")
