"""BrokerConfig: where the SEE broker listens and how much it holds (re-exported by exchange.broker)."""

from __future__ import annotations

import msgspec

from exchange.codec import DEFAULT_MAX_FRAME_BYTES
from exchange.log import DEFAULT_SEGMENT_BYTES

_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")


class ConfigError(ValueError):
    """A BrokerConfig value that cannot work; the message names the field and the fix."""


class BrokerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Where the broker listens and how much it holds."""

    frontend: str = "tcp://127.0.0.1:5557"  # publishers connect here
    backend: str = "tcp://127.0.0.1:5558"  # subscribers connect here
    log_dir: str | None = None  # experience log directory; None: no log
    segment_bytes: int = DEFAULT_SEGMENT_BYTES  # log segment size before rolling over
    hwm_frames: int = 64  # ZeroMQ queue bound per socket/peer, in frames
    backlog_messages: int = 16384  # per-subscriber backlog bound kept by the broker
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES  # larger frames are rejected unread
    max_rejects_per_sender: int = 1000  # bad messages from one connection before it is cut off
    dedupe_ids: int = 1 << 21  # at most this many ids remembered to refuse re-sends, the newest half at least
    stats_interval_s: float = 1.0
    drain_timeout_s: float = 5.0  # on stop, how long to keep delivering backlogs
    name: str = "broker"  # Control target and Stats worker id
    run_id: str = ""  # if set, an Experience of another run id is rejected (counted against its sender), never logged
    allow_remote: bool = False  # bind tcp on non-loopback addresses (needs the two CURVE settings below)
    curve_secret_key: str | None = None  # the broker's NAME.key_secret (launch.py keys): CurveZMQ on
    curve_allowed_dir: str | None = None  # directory of the client public keys (*.key) let in
    allow_plaintext: bool = False  # beyond loopback without CURVE: a private network (MUTUAL_RL_CLUSTER_INSECURE)

    @property
    def curve(self) -> bool:
        return self.curve_secret_key is not None and self.curve_allowed_dir is not None

    def check(self) -> None:
        for key in ("frontend", "backend"):
            endpoint = getattr(self, key)
            scheme, _, rest = endpoint.partition("://")
            if scheme not in ("tcp", "ipc", "inproc") or not rest:
                raise ConfigError(f"{key} = {endpoint!r}: use tcp://HOST:PORT, ipc://PATH or inproc://NAME")
            host = rest.rsplit(":", 1)[0]
            if scheme == "tcp" and host not in _LOOPBACK_HOSTS:
                if not self.allow_remote:
                    raise ConfigError(f"{key} = {endpoint!r} is not loopback; set allow_remote = true to expose "
                                      "the exchange")
                if not self.curve and not self.allow_plaintext:
                    raise ConfigError(f"{key} = {endpoint!r} is not loopback: set curve_secret_key and "
                                      "curve_allowed_dir (make keys with `python launch.py keys DIR`)")
        if (self.curve_secret_key is None) != (self.curve_allowed_dir is None):
            raise ConfigError("curve_secret_key and curve_allowed_dir go together: set both, or neither")
        if self.frontend == self.backend:
            raise ConfigError("frontend and backend must be different endpoints")
        for key in ("segment_bytes", "hwm_frames", "backlog_messages", "max_frame_bytes", "max_rejects_per_sender",
                    "dedupe_ids"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key} = {getattr(self, key)} must be > 0")
        if not self.stats_interval_s > 0 or not self.drain_timeout_s >= 0:
            raise ConfigError("stats_interval_s must be > 0 and drain_timeout_s >= 0")
