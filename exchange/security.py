"""CurveZMQ for an exchange that listens beyond loopback: who may connect, and proof of it.

A key pair is two files made by ``make_keys`` (``launch.py keys``): ``NAME.key`` (public,
safe to copy to the broker's allow-list directory) and ``NAME.key_secret`` (keep it
private). The broker's sockets are CURVE servers with the broker's secret key; a ZAP
authenticator admits a client only if its public key is one of the ``*.key`` files in the
allow-list directory, and says so on stderr when it refuses one. Clients (publishers,
subscribers, taps) are CURVE clients with their own key pair and the broker's public key.
Everything on the wire is then encrypted and authenticated; on loopback or ipc it is off
by default.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import msgspec
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


class KeyFileError(ValueError):
    """A key file is missing or unreadable; the message names the path."""


class ClientKeys(msgspec.Struct, frozen=True):
    """What a client needs to reach a CURVE broker: its own key pair and the broker's public key."""

    secret_file: str  # the client's NAME.key_secret (holds its public key too)
    server_public_file: str  # the broker's NAME.key


def make_keys(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write NAME.key and NAME.key_secret in ``directory``; refuses to overwrite a key pair."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    if public.exists() or secret.exists():
        raise FileExistsError(f"{public} or {secret} exists already; choose another name or directory")
    made_public, made_secret = zmq.auth.create_certificates(str(directory), name)
    Path(made_secret).chmod(0o600)
    return Path(made_public), Path(made_secret)


def _load(path: str | Path, secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret_key = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"{path}: not a readable CurveZMQ key file ({exc})") from None
    if secret and secret_key is None:
        raise KeyFileError(f"{path}: holds no secret key (give the NAME.key_secret file)")
    return public, secret_key


class _AllowList:
    """The ZAP callback: a client key is allowed iff its public key file is in ``directory``; refusals counted."""

    def __init__(self, directory: Path):
        self.allowed = {_load(p, secret=False)[0] for p in sorted(directory.glob("*.key"))}
        self.refused = 0
        self._lock = threading.Lock()

    def callback(self, domain: str, client_key: bytes) -> bool:
        if client_key in self.allowed:
            return True
        with self._lock:
            self.refused += 1
        print(f"exchange: refused a client whose CURVE key {client_key.decode()[:12]}... is not in the allow-list",
              file=sys.stderr, flush=True)
        return False


class CurveServer:
    """The broker side: ``apply(socket)`` before bind; ``start()`` runs the authenticator, ``stop()`` ends it."""

    def __init__(self, context: zmq.Context, secret_file: str, allowed_dir: str):
        if not Path(allowed_dir).is_dir():
            raise KeyFileError(f"{allowed_dir}: the allow-list directory of client public keys does not exist")
        self.public, self.secret = _load(secret_file, secret=True)
        self.allow = _AllowList(Path(allowed_dir))
        self._auth = ThreadAuthenticator(context)

    def start(self) -> None:
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=self.allow)

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def stop(self) -> None:
        self._auth.stop()


class KeyRefused(ConnectionError):
    """The broker refused this client's CURVE key (ZAP said no: the key is not on its allow-list)."""


def apply_client(sock: zmq.Socket, keys: ClientKeys | None) -> None:
    """Make ``sock`` a CURVE client of the broker (before connect); no-op without keys."""
    if keys is None:
        return
    public, secret = _load(keys.secret_file, secret=True)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = _load(keys.server_public_file, secret=False)[0]
