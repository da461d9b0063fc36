"""Demo mode: `flotilla demo` pairs its own throw-away agents without a human.

Pairing normally needs the owner to type a code on the agent. `flotilla
demo` starts two agents on this PC and wants to pair them unattended, so the
agent has a hidden flag, `--demo-auto-pair`, which accepts ONE controller key
without a code. Why this is not a hole:

- The flag only works with a config dir that `flotilla demo` created: a
  fresh folder under the system temp dir, inside a demo root, both mode 0700
  and owned by the user running the agent, holding a marker file (0600)
  that names the one controller key to accept. The agent refuses to start
  otherwise; a real agent's config dir never passes. On Windows, where
  st_mode reads 0o777 (files 0o666) whatever the ACL and st_uid reads 0,
  the mode and owner checks do not apply: there the temp dir is the user's
  own (%LOCALAPPDATA%\\Temp), whose ACL other standard users cannot pass,
  and folders made in it inherit it.
- Whoever can write that marker can already write the agent's
  paired_controllers.json directly (same folder, same permissions): the flag
  grants nothing that file access did not already grant.
- Only the key named in the marker is accepted; any other key stays
  "pending" as usual. The agent must also bind loopback only (refused
  otherwise), so nothing off this PC can even reach it.
- A demo agent exits when the demo process that created it is gone (its pid
  and creation time: a reused pid does not keep it alive).
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from engine.fleet.paths import ensure_private_dir, write_private
from engine.platform import WINDOWS, system
from engine.platform.process import ProcessRef
from engine.protocol.control import is_z85_key

MARKER = "flotilla-demo.json"
ROOT_PREFIX = "flotilla-demo-"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
MAX_AGE_S = 24 * 3600.0  # a demo dir older than this is not trusted any more


@dataclass(frozen=True)
class DemoGrant:
    controller_key: str  # the one key the agent accepts without a code
    parent_pid: int  # the demo process; the agent exits when it is gone
    parent_created: float = 0.0  # its creation time (psutil), 0 = unknown: then the pid alone counts


def make_demo_root() -> Path:
    """A fresh private folder under the temp dir for one demo run."""
    return Path(tempfile.mkdtemp(prefix=ROOT_PREFIX))  # mkdtemp: mode 0700, ours


def make_agent_dir(root: Path, name: str, controller_key: str) -> Path:
    """A demo agent's config dir with its marker."""
    config = ensure_private_dir(root / name)
    me = ProcessRef.of(os.getpid())
    write_private(config / MARKER, json.dumps({"controller_key": controller_key, "parent_pid": os.getpid(),
                                               "parent_created": me.created if me else 0.0,
                                               "created": time.time()}))
    return config


def _private(path: Path, mode: int) -> bool:
    """path is of this kind (folder / file, not a link) and, where POSIX modes mean
    something, ours and closed to group and others (see the module docstring for Windows)."""
    st = path.lstat()
    if stat.S_IFMT(st.st_mode) != mode:
        return False
    if system() == WINDOWS:
        return True
    mine = not hasattr(os, "getuid") or st.st_uid == os.getuid()
    return mine and stat.S_IMODE(st.st_mode) & 0o077 == 0


def check_demo_dir(config: Path, bind: str) -> DemoGrant:
    """The grant of a genuine demo config dir; ValueError saying why not."""
    if bind not in LOOPBACK:
        raise ValueError("--demo-auto-pair needs --bind 127.0.0.1 (a demo agent is reachable from this PC only)")
    config = Path(config)
    root = config.resolve().parent
    temp = Path(tempfile.gettempdir()).resolve()
    marker = config / MARKER
    try:
        ok = (root.parent == temp and root.name.startswith(ROOT_PREFIX)
              and _private(root, stat.S_IFDIR) and _private(config, stat.S_IFDIR)
              and _private(marker, stat.S_IFREG))
    except OSError:
        ok = False
    if not ok:
        raise ValueError("--demo-auto-pair works only in a private config dir made by `flotilla demo`")
    try:
        raw = json.loads(marker.read_text())
        key, pid, created = raw["controller_key"], int(raw["parent_pid"]), float(raw["created"])
        parent_created = float(raw.get("parent_created", 0.0))
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError("the demo marker is damaged") from None
    if not is_z85_key(key) or not time.time() - MAX_AGE_S < created <= time.time() + 60:
        raise ValueError("the demo marker is stale or damaged")
    return DemoGrant(key, pid, parent_created)


def parent_alive(grant: DemoGrant) -> bool:
    """The demo process that made this agent's dir still runs. psutil, not os.kill(pid, 0):
    on Windows that call sends CTRL_C_EVENT to the pid's console group."""
    import psutil

    if grant.parent_created:
        return ProcessRef(grant.parent_pid, grant.parent_created).alive()
    return psutil.pid_exists(grant.parent_pid)
