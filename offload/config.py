"""Every knob of the runtime in one frozen dataclass: env var, type, default, example, doc.

`Config.from_env(**overrides)` reads `OFFLOAD_*` variables; keyword arguments (same names,
lower case, no prefix) win over the environment. Parsing errors and cross-checks raise
`ConfigError` naming the variable (or argument), the value and what to do. Validation only
*reads* the file system (stat, access, statvfs): nothing is created before it passes.

`env_table_markdown()` renders the README table from the same metadata, so docs and code
cannot drift (tests/test_config.py compares them).
"""
from __future__ import annotations

import difflib
import logging
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping

from . import config_checks
from . import config_parse
from .config_parse import PARSERS, POLICIES, TIERS
from .errors import ConfigError, short_repr
from .util.figures import ProbeSetting
from .util import logs
from .util.ranks import Ranks
from .util.sizes import SizeSpec, format_bytes

__all__ = ["Config", "TIERS", "POLICIES", "env_table_markdown"]


# MIN: below it a tensor's fixed cost on the nvme path outweighs its bytes. STAGING /
# PREFETCH: the smallest pair that did not stall the reference step; read-ahead stays under
# the arena so reads land in it. The measurements: docs/benchmarks.md, *Why the runtime's
# constants are what they are*.
_DEFAULT_MIN_BYTES = 256 << 10
_DEFAULT_PREFETCH_BYTES = 64 << 20
_DEFAULT_STAGING_BYTES = 256 << 20
_DEFAULT_IO_WORKERS = 4


def _knob(default: Any, *, env: str, kind: str, example: str, doc: str,
          default_doc: str | None = None) -> Any:
    meta = {"env": env, "type": kind, "example": example, "doc": doc,
            "default_doc": default_doc}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Config:
    """Settings of `offload.activations()`; build with `Config.from_env(**overrides)`."""

    enabled: bool = _knob(
        True, env="OFFLOAD_ENABLED", kind="bool", example="0",
        doc="`0` turns offload off: the context installs no hook and opens no tier (the other "
            "settings are parsed but not checked against the machine), so one flag, or "
            "`offload.activations(enabled=False)`, compares a run with and without it.")
    tiers: tuple[str, ...] = _knob(
        ("host",), env="OFFLOAD_TIERS", kind="list of tiers", example="host,nvme",
        doc="Where offloaded activations go, fastest first; a full tier spills to the next. "
            "On a CPU-only run `host` means keep in RAM.")
    nvme_dir: tuple[str, ...] = _knob(
        (), env="OFFLOAD_NVME_DIR", kind="path[,path...]", example="/mnt/nvme0/{rank},/mnt/nvme1",
        default_doc="unset",
        doc="Directory on a local SSD for the `nvme` tier; several are striped, each holding an "
            "equal share of OFFLOAD_NVME_BYTES. `{rank}` and `{local_rank}` expand from RANK / "
            "LOCAL_RANK; a literal brace is written twice (`{{`). Files are private and "
            "unlinked at once. On tmpfs (RAM) a warning says so; ramfs and read-only file "
            "systems are refused.")
    host_bytes: SizeSpec = _knob(
        SizeSpec(fraction=0.5), env="OFFLOAD_HOST_BYTES", kind="size or %", example="8GiB",
        doc="What this process may keep in the `host` tier, shared by every step alive at "
            "once (one budget per process); a percentage is of the memory available at entry "
            "(RAM, or less inside a memory cgroup: Docker, Kubernetes, Slurm), divided among "
            "the processes of this host (LOCAL_WORLD_SIZE); a size is per process.")
    nvme_bytes: SizeSpec = _knob(
        SizeSpec(fraction=0.5), env="OFFLOAD_NVME_BYTES", kind="size or %", example="64GiB",
        doc="What this process may keep in the NVMe directories, shared by every context alive "
            "at once (one budget per directory set); reserved with fallocate when the first "
            "context opens it and kept open between steps. A percentage is of what fits at that "
            "moment in equal shares over the directories (the directory with the least free "
            "space per share sets it), divided among the processes of this host "
            "(LOCAL_WORLD_SIZE); a size is per process, at least 1 MiB per directory, rounded "
            "down to whole slab chunks per directory (1 MiB each, 4 MiB from 256 MiB per "
            "directory: `3MiB` over two directories holds 2 MiB; `ctx.stats.nvme_capacity_bytes` "
            "says what it holds), and is refused when the context is "
            "built if a directory's share does not fit. When it is full, tensors spill to the "
            "next tier, stay with a warning, or raise TierFullError (OFFLOAD_STRICT); the "
            "space of a graph dropped without backward (a skipped batch) counts as free once "
            "its writes land, which a forward that needs it waits for (a stall in "
            "`ctx.stats`).")
    min_bytes: int = _knob(
        _DEFAULT_MIN_BYTES, env="OFFLOAD_MIN_BYTES", kind="size", example="1MiB",
        doc="Saved tensors whose storage is smaller stay where they are; `0` moves everything.")
    policy: str = _knob(
        "offload", env="OFFLOAD_POLICY", kind="keep, offload, recompute or auto", example="keep",
        doc="`offload` moves every eligible tensor to the tiers; `keep` leaves all in place "
            "(stats only); `recompute` checkpoints every repeated block of `model=` (its "
            "inputs go to the tiers); `auto` chooses keep, host, nvme or recompute per tensor "
            "and op from measured figures (offload/schedule/).")
    budget: SizeSpec | None = _knob(
        None, env="OFFLOAD_BUDGET", kind="size or %", example="30%", default_doc="unset",
        doc="Device-resident activation bytes allowed under `auto` (`%` of the activation "
            "bytes the profiled step saves; with gradient accumulation in one context, of "
            "the largest micro-batch's, and the budget holds per micro-batch); unset means "
            "0: move or recompute everything that can be, choosing the cheaper way per "
            "tensor.")
    strict: bool = _knob(
        False, env="OFFLOAD_STRICT", kind="bool", example="1",
        doc="When every tier is full (or a tensor is larger than every tier), raise "
            "TierFullError instead of keeping the tensor on the device with a warning said "
            "once per process and tier list (and once for a tensor too large; every step's "
            "`ctx.stats.full_kept_bytes` counts what stayed).")
    log: str | None = _knob(
        None, env="OFFLOAD_LOG", kind="log level", example="INFO", default_doc="unset",
        doc="Level of the `offload` logger; per-step stats are logged at INFO. Set, it sets "
            "the logger's level for the process when a context is built, before its settings "
            "are checked against the machine, and whenever it is entered (a context without "
            "it keeps the level it finds); unset leaves logging as the application configured "
            "it. Warnings about the variables themselves (an unknown `OFFLOAD_` name, a size "
            "given as a bare number) come as they are read, before it applies.")
    log_ranks: tuple[int, ...] | None = _knob(
        (0,), env="OFFLOAD_LOG_RANKS", kind="ranks or all", example="all",
        doc="In a distributed run, the ranks (RANK) whose INFO and DEBUG lines, the per-step "
            "stats among them, are logged: one rank, a list such as `0,4`, or `all`. Every "
            "rank logs warnings and errors, and every line names its rank.")
    prefetch_bytes: int = _knob(
        _DEFAULT_PREFETCH_BYTES, env="OFFLOAD_PREFETCH_BYTES", kind="size", example="512MiB",
        doc="Bytes of reads kept in flight ahead of backward (reverse pack order); keep it "
            "below OFFLOAD_STAGING_BYTES so reads land in the arena. One read is always in "
            "flight, so 0 means one at a time.")
    io_workers: int = _knob(
        _DEFAULT_IO_WORKERS, env="OFFLOAD_IO_WORKERS", kind="int", example="8",
        doc="I/O threads of the NVMe engine.")
    nvme_checksum: bool = _knob(
        False, env="OFFLOAD_NVME_CHECKSUM", kind="bool", example="1",
        doc="CRC32C of every chunk written to NVMe, checked when it is read back: a corrupted "
            "read raises StorageError in backward instead of giving a wrong gradient. Costs "
            "CPU time on the I/O threads (one CRC pass over every byte written and read).")
    staging_bytes: int = _knob(
        _DEFAULT_STAGING_BYTES, env="OFFLOAD_STAGING_BYTES", kind="size", example="1GiB",
        doc="Host staging of the `nvme` tier: the arena that read-ahead lands in (and, on "
            "a GPU, the pinned write-behind buffers), and on a CPU the most bytes of tensors "
            "held for writes in flight; the forward only waits when it is full. Counts in RSS "
            "once touched (pinned at once on a GPU). 0 keeps the least: one write in flight "
            "at a time.")
    cpu_heap: str = _knob(
        "reuse", env="OFFLOAD_CPU_HEAP", kind="reuse or release", example="release",
        doc="CPU runs of the `nvme` tier: `reuse` keeps freed activation memory in the heap "
            "for the next allocation (fastest; peak RSS is the heap's high-water mark), "
            "`release` hands every block of 1 MiB or more back to the OS when freed (lowest "
            "peak RSS, about twice the page faults). See offload/tiers/heap.py.")
    nvme_max_bw: int = _knob(
        0, env="OFFLOAD_NVME_MAX_BW", kind="size per second", example="200MB",
        default_doc="unset",
        doc="Cap on the NVMe engine's throughput (reads and writes together), for a disk "
            "shared with other jobs; `auto` plans with the cap. Unset or 0: no cap.")
    probe: ProbeSetting = _knob(
        ProbeSetting(), env="OFFLOAD_PROBE", kind="cached, refresh or figures",
        example="nvme_write_gbps=0.2", default_doc="cached",
        doc="Machine figures `auto` plans with: `cached` measures once per machine, device "
            "and NVMe file system (cached under ~/.cache/offload), `refresh` measures again, "
            "`name=value,...` gives figures (the rest are measured); `offload-probe` prints "
            "them.")
    trace: str | None = _knob(
        None, env="OFFLOAD_TRACE", kind="path", example="/tmp/step.json", default_doc="unset",
        doc="Write a Chrome-trace JSON of the step (forward / backward compute, NVMe writes "
            "and reads, copies, stalls) to this file at the end of each step, replacing the "
            "last step's; opens in ui.perfetto.dev. `{rank}` / `{local_rank}` are expanded "
            "as in OFFLOAD_NVME_DIR, so ranks write apart. Its directory must exist.")
    # Where each value came from ("OFFLOAD_TIERS='a'" or "tiers='a'"), for error messages.
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    # The launcher's RANK / LOCAL_WORLD_SIZE ... (offload/util/ranks.py), read with the knobs.
    ranks: Ranks = field(default_factory=Ranks, compare=False, repr=False)

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> "Config":
        """Read `OFFLOAD_*` from `env` (default `os.environ`); keyword arguments win.

        Raises:
            ConfigError: an unknown keyword, or a value that does not parse.
        """
        cache_key = _cache_key(overrides) if env is None else None
        if cache_key is not None:
            cached = _from_env_cache.get(cache_key)
            if cached is not None:
                return cached
        env = os.environ if env is None else env
        _warn_unknown_variables(env)
        names = {f.name: f for f in _knobs()}
        for key in overrides:
            if key not in names:
                as_setting = key.lower().removeprefix("offload_")   # OFFLOAD_TIERS= given
                close = [as_setting] if as_setting in names and as_setting != key else \
                    difflib.get_close_matches(key, list(names), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(f"offload.activations(): unknown argument {key!r}{hint}; "
                                  f"valid arguments: {', '.join(names)}, model, blocks "
                                  "(a variable's name in lower case without OFFLOAD_)")
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for name, f in names.items():
            envname = f.metadata["env"]
            if overrides.get(name) is not None:
                raw, where = overrides[name], f"{name}={short_repr(overrides[name])}"
            elif env.get(envname, "").strip() != "":
                raw, where = env[envname], f"{envname}={env[envname]!r}"
            else:
                continue
            try:
                values[name] = PARSERS[name](raw, where, env)
            except ConfigError:
                raise
            except (TypeError, ValueError) as exc:   # a value no parser's check foresaw
                raise ConfigError(f"{where}: not a valid value ({exc}; give a "
                                  f"{f.metadata['type']}, e.g. {f.metadata['example']!r})"
                                  ) from None
            sources[name] = where
        config = cls(**values, sources=sources, ranks=Ranks.from_env(env))
        if cache_key is not None:
            if len(_from_env_cache) >= 16:
                _from_env_cache.clear()
            _from_env_cache[cache_key] = config
        return config

    def with_overrides(self, **overrides: Any) -> "Config":
        """A copy with some knobs replaced (parsed like keyword arguments)."""
        extra = Config.from_env(env={}, **overrides)
        picked = {k: getattr(extra, k) for k in overrides}
        return replace(self, **picked, sources={**self.sources, **extra.sources})

    # ---------------------------------------------------------------- validation
    def where(self, name: str) -> str:
        """How to name a knob's value in a message: its source, or the env var's default."""
        env = _FIELDS[name].metadata["env"]
        return self.sources.get(name, f"{env} (default {_default_text(_FIELDS[name])!r})")

    # ---------------------------------------------------------------- on this machine
    # What the settings come to here (config_checks.py): `validate(*, nvme_dir_alternative)`
    # (read-only cross-checks: stats the NVMe directories, creates nothing; raises
    # ConfigError naming the variable, the value and what to do), `check_nvme_dirs`, and the
    # tiers' capacities. Its functions themselves, as methods: no call in between (a
    # context is built, and its settings checked, every step).
    validate = config_checks.validate
    check_nvme_dirs = config_checks.check_nvme_dirs
    host_capacity = config_checks.host_capacity
    nvme_capacity_bytes = config_checks.nvme_capacity_bytes
    nvme_capacity_source = config_checks.nvme_capacity_source

    def host_capacity_bytes(self) -> int:
        """Capacity of the host tier in bytes (see `host_capacity`)."""
        return config_checks.host_capacity(self)[0]

    def apply_log_level(self) -> None:
        """Set the `offload` logger's level from OFFLOAD_LOG (kept when unset) and which
        ranks log INFO lines from OFFLOAD_LOG_RANKS (offload/util/logs.py)."""
        logs.configure(self.log, self.log_ranks)


def _knobs():
    """The fields that are settings (each has an env var); not `sources` or `ranks`."""
    return [f for f in fields(Config) if "env" in f.metadata]


def forget_warnings() -> None:
    """Say the once-per-process warnings again (offload.process.reset)."""
    _warned_unknown.clear()
    _last_scan[0] = None
    _from_env_cache.clear()
    config_checks.forget_warnings()
    config_parse.forget_warnings()


_FIELDS = {f.name: f for f in fields(Config)}

# OFFLOAD_* variables that are not runtime settings (so no warning names them).
OTHER_VARIABLES = {
    "OFFLOAD_BUILD_CUDA": "pip install: 0 builds the core without the CUDA copy engine",
    "OFFLOAD_TEST_DIR": "the test suite: where its NVMe test directories go",
}
_warned_unknown: set[str] = set()


def known_variables() -> list[str]:
    """Every OFFLOAD_* variable offload reads (settings, the build, the tests)."""
    return sorted([f.metadata["env"] for f in _knobs()] + list(OTHER_VARIABLES))


# Configs made from os.environ, by what they were made of: a training loop builds a context
# (and so a Config) every step from the same variables and arguments. Config is frozen.
_from_env_cache: dict[tuple, "Config"] = {}
_LAUNCHER_VARIABLES = (b"RANK", b"LOCAL_RANK", b"WORLD_SIZE", b"LOCAL_WORLD_SIZE")


# os.environ's data at the last scan and what of it a Config depends on: an environment
# equal to the last one (one comparison in C) is not scanned again.
_last_scan: list = [None]   # [(a copy of the data, the key part)]: swapped whole


def _cache_key(overrides: Mapping[str, Any]) -> tuple | None:
    """What a Config from os.environ depends on: the OFFLOAD_* and launcher variables and
    the keyword arguments; None when an argument cannot be a key (then no cache)."""
    data = os.environ._data  # type: ignore[attr-defined]  (bytes, no decoding)
    last = _last_scan[0]
    if last is not None and data == last[0]:
        env = last[1]
    else:
        env = tuple(sorted((k, v) for k, v in data.items()
                           if k.startswith(b"OFFLOAD_") or k in _LAUNCHER_VARIABLES))
        _last_scan[0] = (dict(data), env)
    try:
        key = (env, tuple(sorted(overrides.items())))
        hash(key)
    except TypeError:
        return None
    return key


def _warn_unknown_variables(env: Mapping[str, str]) -> None:
    """One warning per unknown OFFLOAD_* variable (a typo such as OFFLOAD_TIRES is otherwise
    silently ignored), naming the closest known one."""
    known = None
    for key in env:
        if not key.startswith("OFFLOAD_") or key in _warned_unknown:
            continue
        known = known or known_variables()
        if key in known:
            continue
        _warned_unknown.add(key)
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else "known: " + ", ".join(known)
        logging.getLogger("offload").warning(
            "offload: %s=%r is not a variable offload knows, so it has no effect (%s)",
            key, env[key], hint)


# -------------------------------------------------------------------- docs
def _default_text(f) -> str:
    if f.metadata.get("default_doc"):
        return f.metadata["default_doc"]
    value = f.default
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int) and f.metadata["type"] == "size":
        return format_bytes(value).replace(" ", "")
    return str(value)


def env_table_markdown() -> str:
    """The README table of environment variables, rendered from `Config`'s metadata."""
    rows = ["| Variable | Type | Default | Example | Meaning |",
            "|---|---|---|---|---|"]
    for f in _knobs():
        m = f.metadata
        rows.append(f"| `{m['env']}` | {m['type']} | `{_default_text(f)}` | "
                     f"`{m['example']}` | {m['doc']} |")
    return "\n".join(rows) + "\n"
