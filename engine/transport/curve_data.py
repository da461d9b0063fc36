"""CURVE on the pipeline's data plane: every hop of the ring encrypted and authenticated.

The ring (engine/protocol/pipeline.py) has three kinds of sockets:

  worker inbox      ROUTER, CURVE *server* with its agent's node key. Its ZAP
                    handler admits the keys of the agent's paired controllers
                    (the agent's allow-list file, re-read when it changes) and
                    the ring keys the controller named in LoadRequest (the
                    other agents of the ring: the previous stage sends here).
  worker outbox     DEALER, CURVE *client* with its agent's node key, dialling
                    the next stage's inbox (server key = the next agent's
                    public key, handed out in StageConfigure.next_key) or, for
                    the last stage, the coordinator's return socket.
  coordinator       DEALERs to every stage (client, the controller's key) and
                    a return ROUTER (server, the controller's key; ZAP admits
                    the ring's agent keys only).

So a hop is admitted only when both ends hold keys the controller vouched
for: an unpaired host cannot feed a stage, read hidden states or fake
results. The agents' *secret* keys never move: a worker reads its agent's
secret key file (0600) itself, named by a small JSON file the agent writes
(also 0600) and passes as `--curve FILE`.

Plaintext stays possible for the local loopback runner only, and only when
asked (FleetConfig.curve=False); wherever a peer is remote the launcher
always uses CURVE.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth.thread

from engine.paths import ensure_private_dir, write_private
from engine.transport.security import KeyBook, KeyPair, curve_client, curve_server, fingerprint
from engine.protocol.control import is_z85_key

log = logging.getLogger(__name__)
DATA_DOMAIN = "flotilla-data"  # ZAP domain of every data-plane server socket


class DataZap:
    """The ZAP handler of one zmq context's data sockets (a thread of its own,
    so a busy compute loop never stalls a handshake). Admits `allow`, keys
    added later with admit(), and the keys of an optional KeyBook."""

    def __init__(self, ctx: zmq.Context, allow: Iterable[str] = (), book: KeyBook | None = None) -> None:
        self.allowed: set[str] = {k for k in allow if k}
        self.book = book
        self.denied = 0  # handshakes refused
        self._auth = zmq.auth.thread.ThreadAuthenticator(ctx, log=logging.getLogger("flotilla.zap.data"))
        zap = self

        class _Provider:
            def callback(self, domain: str, key: bytes) -> bool:
                z85 = key.decode("ascii", "replace")
                ok = z85 in zap.allowed or (zap.book is not None and z85 in zap.book)
                if not ok:
                    zap.denied += 1
                    log.warning("refused a data connection from unknown key %s", fingerprint(z85))
                return ok

        self._provider = _Provider()
        self._started = False

    def admit(self, key: str) -> None:
        if key:
            self.allowed.add(key)

    def start(self) -> DataZap:
        self._auth.start()
        self._auth.configure_curve_callback(DATA_DOMAIN, credentials_provider=self._provider)
        self._started = True
        return self

    def stop(self) -> None:
        if self._started:
            self._started = False
            self._auth.stop()


@dataclass(frozen=True)
class CurveEnd:
    """One end of the data plane that owns a key pair: a worker or a coordinator."""

    keys: KeyPair  # this end's key pair
    allow: tuple[str, ...] = ()  # keys its server socket admits
    allow_file: Path | None = None  # + the keys of this KeyBook file (an agent's paired controllers)

    @property
    def public(self) -> str:
        return self.keys.public

    def serve(self, ctx: zmq.Context, sock: zmq.Socket, extra_allow: Iterable[str] = ()) -> DataZap:
        """Make sock (not bound yet) a CURVE server and start ctx's ZAP handler;
        stop() the returned handler before terminating ctx."""
        book = KeyBook(self.allow_file) if self.allow_file is not None else None
        zap = DataZap(ctx, (*self.allow, *extra_allow), book).start()
        curve_server(sock, self.keys, DATA_DOMAIN)
        return zap

    def client(self, sock: zmq.Socket, server_key: str) -> None:
        """Make sock (not connected yet) a CURVE client of the server with that key."""
        if not is_z85_key(server_key):
            raise ValueError("the next hop has no CURVE key: refusing to send hidden states in the clear")
        curve_client(sock, self.keys, server_key)

    @classmethod
    def load(cls, path: Path) -> CurveEnd:
        """A worker's setup from the JSON file its agent (or the local runner) wrote:
        {"secret_file": PATH, "allow_file": PATH or null, "allow": [Z85, ...]}."""
        raw = json.loads(Path(path).read_text())
        secret = Path(raw["secret_file"]).read_text().strip()
        public = zmq.curve_public(secret.encode("ascii")).decode("ascii")
        allow = tuple(k for k in raw.get("allow", ()) if is_z85_key(k))
        allow_file = Path(raw["allow_file"]) if raw.get("allow_file") else None
        return cls(KeyPair(public, secret), allow, allow_file)


def write_curve_file(path: Path, secret_file: Path, allow: Iterable[str] = (),
                     allow_file: Path | None = None) -> Path:
    """Write a worker's --curve file (mode 0600). It names the secret key file;
    it does not copy the secret."""
    write_private(path, json.dumps({"secret_file": str(secret_file),
                                    "allow_file": str(allow_file) if allow_file else None,
                                    "allow": sorted({k for k in allow if is_z85_key(k)})}))
    return path


@dataclass
class LocalRingKeys:
    """Throw-away keys for a ring on this PC (the local runner, benchmarks):
    one pair for the coordinator and one per stage, in a private temp folder
    deleted by cleanup()."""

    stages: int
    folder: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="flotilla-ring-keys-")))

    def __post_init__(self) -> None:
        ensure_private_dir(self.folder)
        self.coordinator = CurveEnd(KeyPair.generate())
        self.stage_keys = [KeyPair.generate() for _ in range(self.stages)]
        everyone = [self.coordinator.public, *(k.public for k in self.stage_keys)]
        self.curve_files: list[Path] = []
        for i, keys in enumerate(self.stage_keys):
            secret = self.folder / f"stage-{i}.secret"
            write_private(secret, keys.secret + "\n")
            self.curve_files.append(write_curve_file(self.folder / f"stage-{i}.curve.json", secret, everyone))
        # The coordinator's return socket admits the stages' keys.
        self.coordinator = CurveEnd(self.coordinator.keys, tuple(k.public for k in self.stage_keys))

    @property
    def public_keys(self) -> list[str]:
        return [k.public for k in self.stage_keys]

    def cleanup(self) -> None:
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)
