"""Mount configuration: one frozen dataclass, validated at the edge.

Sizes are bytes here; human units ("64MiB") are parsed only by `parse_size`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ckptfs.errors import ConfigError
from ckptfs.parts import MAX_PART_SIZE, MIN_PART_SIZE, GiB, MiB

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
# Bucket names as S3 allows them (the dotted, 3-63 character form).
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-_]{1,61}[a-z0-9]$")
LOG_LEVELS = ("debug", "info", "warning", "error")
DURABILITY = ("close", "async")
PASSTHROUGH = ("auto", "on", "off")
COLD_OPEN = ("whole", "stream")


def parse_size(text: str | int) -> int:
    """Bytes from `64MiB`, `1GiB`, `1.5GiB`, or a plain integer."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    match = _SIZE_RE.match(str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"invalid size {text!r}: use bytes or a unit like 64MiB, 1GiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def human_size(n: float) -> str:
    """`1.5 GiB` for 1610612736: the inverse of parse_size, for people."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def parse_addr(addr: str) -> tuple[str, int]:
    """(host, port) from HOST:PORT (an empty host means 127.0.0.1)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"invalid address {addr!r}: expected HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """(bucket, prefix) from s3://bucket[/prefix]; the prefix is '' or ends with '/'."""
    if not isinstance(uri, str) or not uri.startswith("s3://"):
        raise ConfigError(f"invalid source {uri!r}: expected s3://BUCKET[/PREFIX]")
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    if not _BUCKET_RE.match(bucket):
        raise ConfigError(f"invalid bucket name {bucket!r} in {uri!r}")
    parts = [p for p in prefix.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise ConfigError(f"invalid prefix in {uri!r}: '.' and '..' are not allowed")
    prefix = "/".join(parts)
    return bucket, (prefix + "/" if prefix else "")


_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str | float) -> float:
    """Seconds from `90`, `90s`, `30m`, `12h`, `1d`."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    match = _DURATION_RE.match(str(text).lower())
    if not match:
        raise ConfigError(f"invalid duration {text!r}: use seconds or a unit like 30m, 12h, 1d")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]


def default_cache_dir(mountpoint: str) -> str:
    base = os.environ.get("XDG_CACHE_HOME") or (
        "/var/cache" if os.geteuid() == 0 else os.path.expanduser("~/.cache"))
    name = os.path.abspath(mountpoint).strip("/").replace("/", "-") or "root"
    return os.path.join(base, "ckptfs", name)


@dataclass(frozen=True)
class Config:
    source: str
    mountpoint: str
    cache_dir: str = ""
    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    part_size: int = 16 * MiB
    concurrency: int = 8
    cache_size: int = 8 * GiB
    # Request bodies read from staged files, and read chunks, held in memory at once. Chunks
    # fetched for reads are received into the disk cache's files (prefetch.py); the read
    # buffers serve only a cache smaller than 1 GiB or one whose disk is full.
    upload_memory: int = 48 * MiB
    read_memory: int = 48 * MiB
    foreground: bool = False
    allow_other: bool = False
    read_only: bool = False
    log_level: str = "info"
    durability: str = "close"
    drain_timeout: float = 600.0
    upload_timeout: float = 120.0
    abort_stale_uploads_after: float = 86400.0
    spot_termination_watch: bool = False
    imds_endpoint: str = "http://169.254.169.254"
    spot_poll_interval: float = 5.0
    metrics_addr: str | None = None
    metadata_ttl: float = 1.0  # how long S3's answers about names and attributes are trusted
    passthrough: str = "auto"  # the kernel reads and writes local files itself (passthrough.py)
    # The first open of an object not in the read cache, with passthrough: "whole" fetches all
    # of it at full parallelism into the cache and opens it through passthrough; "stream"
    # has the daemon serve it from the first byte, as it arrives.
    cold_open: str = "whole"

    @property
    def bucket(self) -> str:
        return parse_s3_uri(self.source)[0]

    @property
    def prefix(self) -> str:
        return parse_s3_uri(self.source)[1]

    def validate(self) -> Config:
        """Return a normalised copy, or raise ConfigError with a one-line reason."""
        parse_s3_uri(self.source)
        if not self.mountpoint:
            raise ConfigError("no mount point given")
        if not MIN_PART_SIZE <= self.part_size <= MAX_PART_SIZE:
            raise ConfigError("--part-size must be between 5MiB and 5GiB")
        if not 1 <= self.concurrency <= 256:
            raise ConfigError("--concurrency must be between 1 and 256")
        if self.upload_memory < MIN_PART_SIZE:
            raise ConfigError("--upload-memory must be at least 5MiB")
        if self.read_memory < 16 * MiB:
            raise ConfigError("--read-memory must be at least 16MiB")
        if self.durability not in DURABILITY:
            raise ConfigError(f"--durability must be one of {', '.join(DURABILITY)}")
        if self.passthrough not in PASSTHROUGH:
            raise ConfigError(f"--passthrough must be one of {', '.join(PASSTHROUGH)}")
        if self.cold_open not in COLD_OPEN:
            raise ConfigError(f"--cold-open must be one of {', '.join(COLD_OPEN)}")
        if not self.drain_timeout > 0:
            raise ConfigError("--drain-timeout must be a positive number of seconds")
        if not self.upload_timeout > 0:
            raise ConfigError("--upload-timeout must be a positive number of seconds")
        if not self.abort_stale_uploads_after >= 0:
            raise ConfigError("--abort-stale-uploads-after must be a duration >= 0")
        if not 0 <= self.metadata_ttl <= 86400:
            raise ConfigError("--metadata-ttl must be between 0 and 86400 seconds")
        if not self.spot_poll_interval > 0:
            raise ConfigError("--spot-poll-interval must be a positive number of seconds")
        # Here, not at the top: `ckptfs sync` and `status` never validate a Config, and
        # importing botocore was 60 of their 120 ms.
        import botocore.utils
        if (not re.match(r"^https?://[^/\s]+/?$", self.imds_endpoint)
                or not botocore.utils.is_valid_uri(self.imds_endpoint)):
            raise ConfigError(f"invalid --imds-endpoint {self.imds_endpoint!r}: "
                              "expected http://HOST[:PORT]")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ConfigError(f"--log-level must be one of {', '.join(LOG_LEVELS)}")
        if self.metrics_addr is not None:
            try:
                parse_addr(self.metrics_addr)
            except ValueError as exc:
                raise ConfigError(f"--metrics-addr: {exc}") from None
        mountpoint = os.path.abspath(self.mountpoint)
        cache_dir = os.path.abspath(self.cache_dir or default_cache_dir(mountpoint))
        endpoint = self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None
        return dataclasses.replace(self, mountpoint=mountpoint, cache_dir=cache_dir,
                                   endpoint_url=endpoint, log_level=self.log_level.lower())


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}
OPTION_KEYS = tuple(_FIELDS)
_SIZE_KEYS = {"part_size", "cache_size", "upload_memory", "read_memory"}
_BOOL_KEYS = {"foreground", "allow_other", "read_only", "spot_termination_watch"}
_INT_KEYS = {"concurrency"}
_FLOAT_KEYS = {"drain_timeout", "upload_timeout", "spot_poll_interval", "metadata_ttl"}
_DURATION_KEYS = {"abort_stale_uploads_after"}


def coerce(key: str, value: object) -> object:
    """Convert a config-file or CLI value to the field's type."""
    if key in _SIZE_KEYS:
        return parse_size(value)  # type: ignore[arg-type]
    if key in _DURATION_KEYS:
        if isinstance(value, bool):
            raise ConfigError(f"config key {key!r} must be a duration")
        return parse_duration(value)  # type: ignore[arg-type]
    if key in _BOOL_KEYS:
        if not isinstance(value, bool):
            raise ConfigError(f"config key {key!r} must be true or false")
        return value
    if key in _INT_KEYS:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"config key {key!r} must be an integer")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"config key {key!r} must be an integer") from None
    if key in _FLOAT_KEYS:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"config key {key!r} must be a number")
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"config key {key!r} must be a number") from None
    if not isinstance(value, str):
        raise ConfigError(f"config key {key!r} must be a string")
    return value


def load_config_file(path: str) -> dict[str, object]:
    """Keys of a TOML config file, checked against the option names."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    out: dict[str, object] = {}
    for key, value in data.items():
        if key not in OPTION_KEYS:
            raise ConfigError(f"unknown key {key!r} in config file {path}")
        out[key] = coerce(key, value)
    return out
