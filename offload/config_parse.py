"""How each OFFLOAD_* setting is read: one parser per knob, each raising a ConfigError that
names the variable (or argument), the value and what to do (config.py holds the knobs).
"""
from __future__ import annotations

import difflib
import logging
import numbers
import os
from collections.abc import Iterable
from typing import Any, Callable, Mapping

from . import tiers as tier_registry
from .errors import ConfigError, short_repr
from .util.figures import ProbeSetting, parse_probe_setting
from .util.ranks import Ranks
from .util.sizes import parse_size

__all__ = ["PARSERS", "TIERS", "POLICIES", "CPU_HEAP_MODES", "MAX_IO_WORKERS", "parse_nvme_dirs"]

TIERS = tier_registry.names()  # fastest first
POLICIES = ("keep", "offload", "recompute", "auto")
CPU_HEAP_MODES = ("reuse", "release")
MAX_IO_WORKERS = 1024  # the engine's own limit (csrc/nvme_store.cpp)
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")   # "" is no answer: an empty variable is unset


def _fail(where: str, reason: str, fix: str) -> ConfigError:
    return ConfigError(f"{where}: {reason} ({fix})")


def _items(raw: Any, where: str, fix: str) -> list:
    """A comma-separated string's items, or any other iterable's (a list, a range, a numpy
    array, dict keys)."""
    if isinstance(raw, str):
        return raw.split(",")
    if isinstance(raw, Iterable) and not isinstance(raw, bytes):
        return list(raw)
    raise _fail(where, f"{short_repr(raw)} is not a list", fix)


def knob(where: str, name: str) -> str:
    """How a fix names another knob: `name=` when the value in `where` came from a keyword
    argument, its environment variable when it came from the environment."""
    return f"OFFLOAD_{name.upper()}" if where.startswith("OFFLOAD_") else f"{name}="


def unset(where: str, name: str) -> str:
    """How a fix says to drop a knob: unset its variable, or leave its keyword out."""
    return f"unset OFFLOAD_{name.upper()}" if where.startswith("OFFLOAD_") \
        else f"leave {name}= out"


def setting(where: str, name: str, value: bool) -> str:
    """`knob` set to a switch's value: `OFFLOAD_NAME=1` / `0`, or `name=True` / `False`."""
    return f"OFFLOAD_{name.upper()}={int(value)}" if where.startswith("OFFLOAD_") \
        else f"{name}={value}"


def _parse_tiers(raw: Any, where: str, env: Mapping[str, str]) -> tuple[str, ...]:
    items = _items(raw, where, "give 'host', 'nvme' or 'host,nvme', or a list of tier names")
    tiers = tuple(str(t).strip().lower() for t in items if str(t).strip())
    if not tiers:
        off = setting(where, "enabled", False)
        raise _fail(where, "names no tier", f"use 'host', 'nvme' or 'host,nvme'; {off} turns "
                    "offloading off")
    for tier in tiers:
        if tier not in TIERS:
            close = difflib.get_close_matches(tier, TIERS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            words = set(tier.replace(";", " ").split())
            if words and words <= set(TIERS):   # 'host;nvme', 'host nvme'
                hint = "separate tiers with commas, e.g. 'host,nvme'; "
            raise _fail(where, f"unknown tier {tier!r}",
                        f"{hint}valid tiers, fastest first: {', '.join(TIERS)}")
    if len(set(tiers)) != len(tiers):
        raise _fail(where, "names a tier twice", "list each tier once, e.g. 'host,nvme'")
    return tiers


def _parse_dirs(raw: Any, where: str, env: Mapping[str, str]) -> tuple[str, ...]:
    if isinstance(raw, os.PathLike):
        raw = os.fspath(raw)
    try:
        items = raw.split(",") if isinstance(raw, str) else [os.fspath(p) for p in raw]
    except TypeError:
        raise _fail(where, f"{raw!r} is not a path",
                    "give a path, a comma-separated string of paths or a list of them") from None
    dirs: list[str] = []
    seen: dict[str, str] = {}   # real path -> as given: one directory listed twice
    for item in items:
        item = item.strip()
        if not item:
            continue
        path = _expand_rank(item, where, env)
        real = os.path.realpath(path)
        if real in seen:
            raise _fail(where, f"{path!r} is the directory {seen[real]!r} again",
                        "list each directory once")
        seen[real] = path
        dirs.append(path)
    if not dirs:
        raise _fail(where, "names no directory", "give a directory on a local SSD")
    return tuple(dirs)


_warned_once: set[str] = set()   # the keys of warnings said (`warn_once`)


def warn_once(key: str, message: str) -> None:
    """Log a settings warning once per process (per `key`) on the `offload` logger."""
    if key not in _warned_once:
        _warned_once.add(key)
        logging.getLogger("offload").warning(message)


def forget_warnings() -> None:
    """Say the once-per-process warnings again (offload.process.reset, via config.py)."""
    _warned_once.clear()


def _size_parser(allow_percent: bool, max_fraction: float | None = None,
                 what: str = "", zero_fix: str | None = None
                 ) -> Callable[[Any, str, Mapping[str, str]], Any]:
    """A size knob's parser; `zero_fix` (what to do instead) makes 0 / 0% an error."""
    def parse(raw: Any, where: str, env: Mapping[str, str]) -> Any:
        try:
            spec = parse_size(raw, allow_percent=allow_percent)
        except (ValueError, OverflowError) as exc:
            reason = str(exc)
            if '"' in reason:   # it gives its own example: say it once
                raise ConfigError(f"{where}: {reason}") from None
            example = '"8GiB", "512MiB"' + (', "50%"' if allow_percent else "")
            raise _fail(where, reason, f"give a size such as {example}") from None
        text = raw.strip() if isinstance(raw, str) else ""
        if allow_percent and text.isdigit() and 0 < int(text) <= 100:   # a share meant?
            warn_once(f"bare number:{where}", f"offload: {where} is {text} bytes; a share"
                      f"{what} is a percentage: '{text}%'")
        if max_fraction is not None and spec.fraction is not None and spec.fraction > max_fraction:
            raise _fail(where, f"{spec} is over {max_fraction * 100:g}%",
                        f"give at most 100%{what}, or an absolute size such as \"4GiB\"")
        if zero_fix is not None and not (spec.nbytes or spec.fraction):
            raise _fail(where, "leaves the tier no room",
                        zero_fix.format(tiers=knob(where, "tiers")))
        return spec if allow_percent else spec.nbytes
    return parse


def _one_of(value: str, choices, where: str, problem: str, listing: str) -> str:
    """`value` if it is in `choices`, else a ConfigError suggesting the closest choice."""
    if value not in choices:
        close = difflib.get_close_matches(value, choices, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise _fail(where, problem, f"{hint}{listing} {', '.join(choices)}")
    return value


def _parse_choice(raw: Any, where: str, env: Mapping[str, str]) -> str:
    value = str(raw).strip().lower()
    return _one_of(value, POLICIES, where, f"unknown policy {value!r}", "valid policies:")


def _parse_cpu_heap(raw: Any, where: str, env: Mapping[str, str]) -> str:
    value = str(raw).strip().lower()
    return _one_of(value, CPU_HEAP_MODES, where, f"unknown mode {value!r}", "valid modes:")


def _parse_bool(raw: Any, where: str, env: Mapping[str, str]) -> bool:
    if isinstance(raw, bool):
        return raw
    value = str(raw).strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise _fail(where, "not a boolean", "use 1/0, true/false, yes/no or on/off")


def _parse_log(raw: Any, where: str, env: Mapping[str, str]) -> str:
    return _one_of(str(raw).strip().upper(), _LOG_LEVELS, where,
                   f"unknown log level {raw!r}", "use one of")


def _expand_rank(item: str, where: str, env: Mapping[str, str]) -> str:
    """`item` with `{rank}` / `{local_rank}` from the launcher's RANK / LOCAL_RANK and `~`
    expanded: one path per rank of a job from one setting. The ranks as numbers, as the
    rest of offload reads them (an empty RANK is rank 0, " 1" is 1: not "nv/" or "nv/ 1")."""
    subst = {}
    if "{" in item:
        ranks = Ranks.from_env(env)
        subst = {"rank": ranks.rank, "local_rank": ranks.local_rank}
    try:
        return os.path.expanduser(item.format_map(subst))
    except (KeyError, ValueError, IndexError) as exc:
        raise _fail(where, f"bad placeholder in {item!r}: {exc}",
                    "only {rank} and {local_rank} are expanded; "
                    "write a literal brace twice: '{{' or '}}'") from None


def _parse_path(raw: Any, where: str, env: Mapping[str, str]) -> str:
    if isinstance(raw, bytes) or not isinstance(raw, (str, os.PathLike)):
        raise _fail(where, f"{raw!r} is not a path",
                    "give a file path such as /tmp/step.json")
    value = os.fspath(raw).strip() if not isinstance(raw, str) else raw.strip()
    if not value:
        raise _fail(where, "is empty", "give a file path such as /tmp/step.json")
    return _expand_rank(value, where, env)


MIN_BANDWIDTH = 10**6   # bytes per second: the lowest nvme_max_bw that is a cap, not a stall


def _parse_bandwidth(raw: Any, where: str, env: Mapping[str, str]) -> int:
    text = raw if not isinstance(raw, str) else raw.strip()
    if isinstance(text, str) and text.lower().endswith("/s"):
        text = text[:-2]  # "200MB/s" reads naturally; the unit is per second either way
    try:
        value = parse_size(text).nbytes
    except ValueError as exc:
        reason = str(exc).split(" (")[0].split(";")[0]   # our own example, not a size's
        raise _fail(where, reason, 'give bytes per second such as "200MB" or "1GiB"; '
                    "0 means no cap") from None
    if 0 < value < MIN_BANDWIDTH:
        # A cap this low turns a step's reads into hours of waiting, not a shared disk.
        raise _fail(where, "is under 1 MB per second", 'give a cap such as "200MB", or 0 '
                    "for none")
    return value


def _parse_probe(raw: Any, where: str, env: Mapping[str, str]) -> ProbeSetting:
    try:
        return parse_probe_setting(raw, where)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _parse_log_ranks(raw: Any, where: str, env: Mapping[str, str]) -> tuple[int, ...] | None:
    fix = "give a rank such as 0, a list such as 0,4, or all"
    if isinstance(raw, numbers.Integral) and not isinstance(raw, bool):   # numpy's too
        raw = [int(raw)]
    items = [str(i).strip().lower() for i in _items(raw, where, fix) if str(i).strip()]
    if items == ["all"]:
        return None
    if not items:
        raise _fail(where, "names no rank", fix)
    ranks = []
    for item in items:
        if not (item.isascii() and item.isdigit()):   # '²' is a digit int() refuses
            raise _fail(where, f"{item!r} is not a rank", fix)
        ranks.append(int(item))
    return tuple(sorted(set(ranks)))


def _parse_io_workers(raw: Any, where: str, env: Mapping[str, str]) -> int:
    try:
        if isinstance(raw, bool):
            raise ValueError
        value = int(str(raw).strip()) if not isinstance(raw, int) else raw
    except ValueError:
        raise _fail(where, "not a whole number", "give a count such as 4") from None
    if value < 1:
        raise _fail(where, "must be at least 1", "give a count such as 4")
    if value > MAX_IO_WORKERS:
        raise _fail(where, f"is more than the engine's {MAX_IO_WORKERS} threads",
                    "4 to 16 threads keep an NVMe SSD busy; give a count such as 8")
    return value


PARSERS: dict[str, Callable[[Any, str, Mapping[str, str]], Any]] = {
    "enabled": _parse_bool,
    "tiers": _parse_tiers,
    "nvme_dir": _parse_dirs,
    "host_bytes": _size_parser(True, max_fraction=1.0, what=" of the available RAM",
                               zero_fix="give a size such as \"8GiB\" or \"50%\", or drop "
                                        "'host' from {tiers}"),
    "nvme_bytes": _size_parser(True, max_fraction=1.0, what=" of the free disk space",
                               zero_fix="give a size such as \"64GiB\" or \"50%\", or drop "
                                        "'nvme' from {tiers}"),
    "min_bytes": _size_parser(False),
    "policy": _parse_choice,
    "budget": _size_parser(True, max_fraction=1.0,
                           what=" of the activation bytes the profiled step saves"),
    "strict": _parse_bool,
    "log": _parse_log,
    "log_ranks": _parse_log_ranks,
    "prefetch_bytes": _size_parser(False),
    "io_workers": _parse_io_workers,
    "nvme_checksum": _parse_bool,
    "staging_bytes": _size_parser(False),
    "cpu_heap": _parse_cpu_heap,
    "nvme_max_bw": _parse_bandwidth,
    "probe": _parse_probe,
    "trace": _parse_path,
}


def parse_nvme_dirs(raw: Any, where: str = "OFFLOAD_NVME_DIR",
                    env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """Directories from an OFFLOAD_NVME_DIR-style value, by the same rules as `Config`.

    Comma-separated, `{rank}` / `{local_rank}` expanded from RANK / LOCAL_RANK in `env`
    (default `os.environ`), `~` expanded. For tools that take such a list themselves
    (offload-bench's --nvme-dir); existence is not checked here (see `Config.validate`).

    Raises:
        ConfigError: an unknown placeholder, or no directory at all (message starts with
            `where`).
    """
    return _parse_dirs(raw, where, os.environ if env is None else env)
