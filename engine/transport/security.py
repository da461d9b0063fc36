"""Keys, pairing and the ZAP gate of the control plane.

Every node has a CurveZMQ key pair (two files, mode 0600). A controller may
drive an agent only once the agent's owner has put the controller's public key
on the agent's allow-list, by pairing:

  1. the controller connects to the agent's *pairing* socket (CURVE; ZAP there
     admits any client key, and that socket only ever handles PairRequest);
  2. both sides compute pairing_code(agent key, controller key): six digits
     from SHA-256 of the two sorted keys, and show it;
  3. the owner checks the two screens agree and accepts on the agent, in the
     tray or with `flotilla agent pair --accept CODE`; typing the code shown
     on the *controller* proves the owner compared them.

A man in the middle has to substitute keys to read the traffic, which changes
the code on at least one side (1 in 10^6 to match by luck). The *control*
socket's ZAP handler admits only allow-listed keys, so an unpaired client never
completes a handshake there: no byte of its reaches the agent's parser.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth.thread

from engine.paths import read_json, write_json, write_private
from engine.protocol.control import is_z85_key

log = logging.getLogger(__name__)

CONTROL_DOMAIN = "flotilla-control"  # ZAP domain of the control socket: allow-list only
PAIR_DOMAIN = "flotilla-pair"  # ZAP domain of the pairing socket: any key
SECRET_FILE = "node_key.secret"
PUBLIC_FILE = "node_key.public"
ALLOW_FILE = "paired_controllers.json"  # keys this agent obeys
PENDING_FILE = "pairing_requests.json"  # keys waiting for the owner's yes (agent writes)
KNOWN_AGENTS_FILE = "paired_agents.json"  # agent keys a controller has confirmed
PENDING_TTL_S = 600.0  # a pairing request older than this is dropped
MAX_PENDING = 16  # unauthenticated clients cannot grow this file without bound


def fingerprint(public_z85: str) -> str:
    """16 hex digits people can compare at a glance (not a security boundary:
    the pairing code is)."""
    return hashlib.sha256(public_z85.encode()).hexdigest()[:16]


def pairing_code(key_a: str, key_b: str) -> str:
    """Six digits both sides derive from the two public keys (order-free).
    Numeric comparison as in Bluetooth SSP: a substituted key changes it."""
    lo, hi = sorted((key_a, key_b))
    digest = hashlib.sha256(b"flotilla-pairing-v1\0" + lo.encode() + b"\0" + hi.encode()).digest()
    return f"{int.from_bytes(digest[:8], 'big') % 1_000_000:06d}"


@dataclass(frozen=True)
class KeyPair:
    public: str  # Z85, 40 characters
    secret: str  # Z85, 40 characters; never leaves this machine

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public)

    @classmethod
    def generate(cls) -> KeyPair:
        public, secret = zmq.curve_keypair()
        return cls(public.decode("ascii"), secret.decode("ascii"))

    @classmethod
    def load_or_create(cls, directory: Path) -> KeyPair:
        """The key pair in directory; a new one if there is none (or it is damaged)."""
        try:
            secret = (directory / SECRET_FILE).read_text().strip()
            public = zmq.curve_public(secret.encode("ascii")).decode("ascii")
            if is_z85_key(secret) and is_z85_key(public):
                if (directory / SECRET_FILE).stat().st_mode & 0o077 and os.name == "posix":
                    os.chmod(directory / SECRET_FILE, 0o600)  # repair a loosened mode
                return cls(public, secret)
        except (OSError, ValueError, zmq.ZMQError):
            pass
        pair = cls.generate()
        write_private(directory / SECRET_FILE, pair.secret + "\n")
        write_private(directory / PUBLIC_FILE, pair.public + "\n")
        return pair

    @staticmethod
    def delete(directory: Path) -> None:
        for name in (SECRET_FILE, PUBLIC_FILE):
            try:
                (directory / name).unlink()
            except FileNotFoundError:
                pass


class KeyBook:
    """A persisted {Z85 key: {"name", "added"}} map, reloaded when the file
    changes (the CLI and the tray edit it while the agent runs). Thread-safe:
    the ZAP thread reads it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._keys: dict[str, dict] = {}

    def _reload(self) -> None:
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = None
        if stamp != self._stamp:
            raw = read_json(self.path, {}) if stamp else {}
            self._keys = {k: v for k, v in raw.items() if is_z85_key(k) and isinstance(v, dict)} \
                if isinstance(raw, dict) else {}
            self._stamp = stamp

    def __contains__(self, key: object) -> bool:
        with self._lock:
            self._reload()
            return key in self._keys

    def entries(self) -> dict[str, dict]:
        with self._lock:
            self._reload()
            return dict(self._keys)

    def add(self, key: str, name: str) -> None:
        if not is_z85_key(key):
            raise ValueError("not a Z85 public key")
        with self._lock:
            self._reload()
            self._keys[key] = {"name": name[:255], "added": time.time()}
            self._save()

    def revoke(self, what: str) -> list[str]:
        """Remove every key whose Z85 text, fingerprint (prefix of at least 6
        hex digits) or name equals what. Returns the names removed."""
        with self._lock:
            self._reload()
            gone = [k for k, v in self._keys.items()
                    if what in (k, v.get("name")) or (len(what) >= 6 and fingerprint(k).startswith(what))]
            names = [str(self._keys[k].get("name", k)) for k in gone]
            for k in gone:
                del self._keys[k]
            if gone:
                self._save()
            return names

    def _save(self) -> None:
        write_json(self.path, self._keys)
        st = self.path.stat()
        self._stamp = (st.st_mtime_ns, st.st_size)


class PairingBook:
    """The agent's side of pairing: pending requests (written by the agent
    only) and the allow-list (written by whoever the owner accepts through)."""

    def __init__(self, config: Path) -> None:
        self.allowed = KeyBook(config / ALLOW_FILE)
        self.pending_path = config / PENDING_FILE

    def pending(self) -> dict[str, dict]:
        raw = read_json(self.pending_path, {})
        now = time.time()
        if not isinstance(raw, dict):
            return {}
        return {k: v for k, v in raw.items() if is_z85_key(k) and isinstance(v, dict)
                and isinstance(v.get("time"), (int, float)) and now - v["time"] < PENDING_TTL_S}

    def request(self, controller_key: str, name: str, agent_key: str) -> tuple[str, str]:
        """Record a pairing request; (state, code) for the reply."""
        code = pairing_code(agent_key, controller_key)
        if controller_key in self.allowed:
            return "accepted", code
        pending = self.pending()
        if controller_key not in pending:
            log.warning("pairing request from %r (key %s): code %s; accept with "
                        "`flotilla agent pair --accept %s`", name, fingerprint(controller_key), code, code)
        pending[controller_key] = {"name": name, "code": code, "time": time.time()}
        # Oldest out first: a flood of throw-away keys cannot block a real request for long.
        keep = sorted(pending.items(), key=lambda kv: kv[1]["time"])[-MAX_PENDING:]
        write_json(self.pending_path, dict(keep))
        return "pending", code

    def accept(self, code: str) -> str:
        """Allow the pending controller whose code is `code`; its name. Raises
        LookupError when no (or more than one) pending request has that code."""
        hits = [(k, v) for k, v in self.pending().items() if v.get("code") == code]
        if not hits:
            raise LookupError(f"no pending pairing request with code {code} (they expire after "
                              f"{int(PENDING_TTL_S // 60)} minutes; ask the controller to try again)")
        if len(hits) > 1:
            raise LookupError("more than one pending request has that code; ask again")
        key, entry = hits[0]
        self.allowed.add(key, str(entry.get("name", "controller")))
        return str(entry.get("name", "controller"))


class FleetAuthenticator:
    """ZAP for the agent's two CURVE sockets, in its own thread (so a busy
    event loop never stalls handshakes): the control domain admits allow-listed
    keys only; the pairing domain admits any key."""

    def __init__(self, context: zmq.Context, allowed: KeyBook) -> None:
        self.allowed = allowed
        self._auth = zmq.auth.thread.ThreadAuthenticator(context, log=logging.getLogger("flotilla.zap"))
        self.denied = 0  # handshakes refused on the control socket

        book = self

        class _Control:
            def callback(self, domain: str, key: bytes) -> bool:
                z85 = key.decode("ascii", "replace")
                ok = z85 in book.allowed
                if not ok:
                    book.denied += 1
                    log.info("refused control connection from unpaired key %s", fingerprint(z85))
                return ok

        class _Pair:
            def callback(self, domain: str, key: bytes) -> bool:
                return True

        self._providers = (_Control(), _Pair())

    def start(self) -> None:
        self._auth.start()
        self._auth.configure_curve_callback(CONTROL_DOMAIN, credentials_provider=self._providers[0])
        self._auth.configure_curve_callback(PAIR_DOMAIN, credentials_provider=self._providers[1])

    def stop(self) -> None:
        self._auth.stop()


def curve_server(sock: zmq.Socket, keys: KeyPair, domain: str) -> None:
    """Make sock a CURVE server authenticated by ZAP in `domain`."""
    sock.curve_secretkey = keys.secret.encode("ascii")
    sock.curve_publickey = keys.public.encode("ascii")
    sock.curve_server = True
    sock.zap_domain = domain.encode()


def curve_client(sock: zmq.Socket, keys: KeyPair, server_public: str) -> None:
    """Make sock a CURVE client of the server with that public key."""
    sock.curve_secretkey = keys.secret.encode("ascii")
    sock.curve_publickey = keys.public.encode("ascii")
    sock.curve_serverkey = server_public.encode("ascii")
