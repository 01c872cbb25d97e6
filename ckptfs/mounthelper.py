"""`mount.ckptfs`: the helper mount(8) runs for a `ckptfs` line of /etc/fstab.

    s3://bucket/prefix  /mnt/checkpoints  ckptfs  _netdev,nofail,cache_dir=/nvme/ckptfs,durability=async  0 0

mount(8) calls `mount.ckptfs SOURCE DIR [-sfnv] [-o OPTIONS]`. OPTIONS are ckptfs's own
(`key=value` with the names of `ckptfs mount`'s options or the config file's keys, dashes or
underscores; `read_only`, `allow_other`, `spot_termination_watch` alone mean true; `ro` is
`read_only`; `config=FILE` reads a config file first) and mount(8)'s generic ones, which are
ignored here: `rw`, `defaults`, `auto`, `noauto`, `user`, `nouser`, `users`, `owner`,
`group`, `_netdev`, `nofail`, `x-*` (`x-systemd.*`), `comment=`, `suid`/`nosuid`,
`dev`/`nodev`, `exec`/`noexec`, the atime flags and `sync`/`async`/`dirsync`. The
helper returns once the mount is live, as `ckptfs mount` does (the daemon stays in the
background); errors are one line on stderr. Exit status as mount(8) expects: 0, 1 for a
bad invocation or option, 32 if the mount failed.
"""

from __future__ import annotations

import sys

from ckptfs.config import OPTION_KEYS, Config, coerce, load_config_file
from ckptfs.errors import CkptfsError, ConfigError

PROG = "mount.ckptfs"
USAGE, FAILED = 1, 32  # mount(8)'s exit codes for a helper
_GENERIC = {"rw", "defaults", "auto", "noauto", "user", "nouser", "users", "owner", "group",
            "_netdev", "nofail", "suid", "nosuid", "dev", "nodev", "exec", "noexec", "atime",
            "noatime", "relatime", "norelatime", "strictatime", "nostrictatime", "diratime",
            "nodiratime", "lazytime", "nolazytime", "sync", "async", "dirsync", "silent", "loud",
            "iversion", "noiversion", "mand", "nomand", "remount", "bind"}
_FLAGS = {"read_only", "allow_other", "spot_termination_watch", "foreground"}
_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}
# Set by the line's own fields, never by an option.
_POSITIONAL = {"source", "mountpoint"}


def parse_args(argv: list[str]) -> tuple[str, str, list[str], set[str]]:
    """(source, dir, options, flags) from mount(8)'s argument vector."""
    positional: list[str] = []
    options: list[str] = []
    flags: set[str] = set()
    args = iter(argv)
    for arg in args:
        if arg == "-o":
            value = next(args, None)
            if value is None:
                raise ConfigError("-o needs a list of options")
            options.extend(o for o in value.split(",") if o)
        elif arg.startswith("-o") and len(arg) > 2:
            options.extend(o for o in arg[2:].split(",") if o)
        elif arg == "-t":
            next(args, None)  # the type: ckptfs, or ckptfs.SUBTYPE
        elif arg.startswith("-") and len(arg) > 1 and set(arg[1:]) <= set("sfnvirw"):
            flags.update(arg[1:])
        elif arg.startswith("-"):
            raise ConfigError(f"unknown argument {arg}")
        else:
            positional.append(arg)
    if len(positional) != 2:
        raise ConfigError("usage: mount.ckptfs s3://BUCKET[/PREFIX] DIR [-sfnv] [-o OPTIONS]")
    return positional[0], positional[1], options, flags


def config_from(source: str, mountpoint: str, options: list[str], sloppy: bool = False) -> Config:
    """The mount's Config from an fstab line's fields and options."""
    values: dict[str, object] = {}
    given: dict[str, object] = {}
    for option in options:
        key, eq, value = option.partition("=")
        key = key.strip().replace("-", "_")
        if key in _GENERIC or key.startswith("x_") or option.startswith("x-") or key == "comment":
            continue
        if key == "ro" and not eq:
            key, value, eq = "read_only", "true", "="
        if key == "config" and eq:
            values.update(load_config_file(value))
            continue
        if key not in OPTION_KEYS or key in _POSITIONAL:
            if sloppy:
                continue
            raise ConfigError(f"unknown option {option!r}")
        if key in _FLAGS:
            if eq and value.lower() not in _TRUE | _FALSE:
                raise ConfigError(f"option {key} must be true or false, not {value!r}")
            given[key] = not eq or value.lower() in _TRUE
        elif not eq or not value:
            raise ConfigError(f"option {key} needs a value ({key}=...)")
        else:
            given[key] = coerce(key, value)
    values.update(given)  # the line's options win over its config file
    values.update(source=source, mountpoint=mountpoint, foreground=False)
    return Config(**values).validate()  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    from ckptfs.cli import _mount  # the same path as `ckptfs mount`

    try:
        source, mountpoint, options, flags = parse_args(sys.argv[1:] if argv is None else argv)
        config = config_from(source, mountpoint, options, sloppy="s" in flags)
    except ConfigError as exc:
        sys.stderr.write(f"{PROG}: {exc}\n")
        return USAGE
    if "f" in flags:  # mount -f: check everything, mount nothing
        return 0
    try:
        return FAILED if _mount(config) else 0
    except CkptfsError as exc:
        sys.stderr.write(f"{PROG}: {exc}\n")
        return FAILED
    except KeyboardInterrupt:
        return FAILED


if __name__ == "__main__":
    sys.exit(main())
