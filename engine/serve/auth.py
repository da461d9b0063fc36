"""Who may call the API: a key is required whenever the server listens beyond this PC.

An inference server bound to the LAN with no key serves anyone who finds it (exposed
Ollama servers end up on public scanners). So a bind to any address but loopback --
`flotilla serve --host 0.0.0.0`, or engine.client.start_api_server with such a host --
requires `Authorization: Bearer KEY`, with KEY

  1. the one given (`--api-key`, $FLOTILLA_API_KEY), else
  2. the one stored in the keys folder (KEY_FILE, owner-only: written 0600 from its first
     byte by engine.paths.write_private; on Windows the folder under %LOCALAPPDATA%
     is the user's own by its ACL), generated there on first use and kept, so the apps a
     user configured once keep working across restarts,

unless the user explicitly turns it off (`--no-auth`). Either way the notice names the
address; the caller shows it. A loopback bind needs no key (only this PC reaches it), but
one given is still enforced.
"""

from __future__ import annotations

import ipaddress
import secrets
from dataclasses import dataclass
from pathlib import Path

KEY_FILE = "api_key.secret"  # in engine.paths.keys_dir(), beside the fleet's keys


@dataclass(frozen=True)
class Access:
    """What a server at one address enforces, and what to tell the user about it."""

    api_key: str | None  # required bearer key (None: open)
    key_file: Path | None  # where the key is kept (None: given by the user, or no key)
    generated: bool  # the key was made just now
    notice: str | None  # one line for the user (None: loopback, nothing to say)


def is_loopback(host: str) -> bool:
    """True for addresses only this PC reaches: 127.0.0.0/8, ::1, "localhost". Anything else
    -- a LAN address, 0.0.0.0 / :: (every interface), a host name -- counts as the network."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def stored_key(folder: Path) -> tuple[str, bool]:
    """(the key kept in folder/KEY_FILE, whether it was generated now)."""
    from engine.paths import ensure_private_dir, write_private

    path = Path(folder) / KEY_FILE
    try:
        key = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        key = ""
    if key:
        return key, False
    key = "flt-" + secrets.token_urlsafe(32)
    ensure_private_dir(path.parent)
    write_private(path, key + "\n")
    return key, True


def decide(host: str, port: int, api_key: str | None, no_auth: bool, folder: Path | None = None) -> Access:
    """The access rule for a server bound to host:port (see the module docstring)."""
    url = f"http://{host}:{port}/v1"
    if is_loopback(host):
        return Access(api_key or None, None, False, None)
    if api_key:
        return Access(api_key, None, False, f"serving beyond this PC at {url}: requests need the API key given")
    if no_auth:
        return Access(None, None, False, f"WARNING: serving beyond this PC at {url} with no API key (--no-auth): "
                                         "anyone who can reach this address can use it")
    if folder is None:
        from engine.paths import keys_dir

        folder = keys_dir()
    key, generated = stored_key(folder)
    return Access(key, Path(folder) / KEY_FILE, generated,
                  f"serving beyond this PC at {url}: requests need `Authorization: Bearer {key}` "
                  f"({'generated now and ' if generated else ''}kept in {Path(folder) / KEY_FILE}; "
                  "--api-key KEY to choose one, --no-auth to serve without)")
