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
from typing import Any, Callable, Mapping

from .config_parse import PARSERS, POLICIES, TIERS, knob
from .errors import ConfigError
from .tiers import nvme_space
from .util.figures import ProbeSetting
from .util import logs
from .util.disk_space import RAM_FS_TYPES, StripedRoom, fs_type, striped_room
from .util.memory_limits import available_memory, memory_floor_bytes
from .util.ranks import Ranks, agreed_total
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
_DROP_NVME = "drop 'nvme' from the tiers"   # validate()'s default: the runtime's own fix


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
        doc="Capacity of the `host` tier; a percentage is of the memory available at entry "
            "(RAM, or less inside a memory cgroup: Docker, Kubernetes, Slurm), divided among "
            "the processes of this host (LOCAL_WORLD_SIZE); a size is per process.")
    nvme_bytes: SizeSpec = _knob(
        SizeSpec(fraction=0.5), env="OFFLOAD_NVME_BYTES", kind="size or %", example="64GiB",
        doc="What this process may keep in the NVMe directories, shared by every context alive "
            "at once (one budget per directory set); reserved with fallocate when the first "
            "context opens it and kept open between steps. A percentage is of what fits at that "
            "moment in equal shares over the directories (the directory with the least free "
            "space per share sets it), divided among the processes of this host "
            "(LOCAL_WORLD_SIZE); a size is per process, at least 1 MiB per directory, and is "
            "refused when the context is "
            "built if a directory's share does not fit. When it is full, tensors spill to the "
            "next tier, stay with a warning, or raise TierFullError (OFFLOAD_STRICT).")
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
            "bytes the first step saves); unset means 0: move or recompute everything that "
            "can be, choosing the cheaper way per tensor.")
    strict: bool = _knob(
        False, env="OFFLOAD_STRICT", kind="bool", example="1",
        doc="When every tier is full, raise TierFullError instead of keeping the tensor on the "
            "device with a warning said once per process and tier list (every step's "
            "`ctx.stats.full_kept_bytes` counts what stayed).")
    log: str | None = _knob(
        None, env="OFFLOAD_LOG", kind="log level", example="INFO", default_doc="unset",
        doc="Level of the `offload` logger; per-step stats are logged at INFO. Unset leaves "
            "logging as the application configured it.")
    log_ranks: tuple[int, ...] | None = _knob(
        (0,), env="OFFLOAD_LOG_RANKS", kind="ranks or all", example="all",
        doc="In a distributed run, the ranks (RANK) whose INFO and DEBUG lines, the per-step "
            "stats among them, are logged: one rank, a list such as `0,4`, or `all`. Every "
            "rank logs warnings and errors, and every line names its rank.")
    prefetch_bytes: int = _knob(
        _DEFAULT_PREFETCH_BYTES, env="OFFLOAD_PREFETCH_BYTES", kind="size", example="512MiB",
        doc="Bytes of reads kept in flight ahead of backward (reverse pack order); keep it "
            "below OFFLOAD_STAGING_BYTES so reads land in the arena.")
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
            "once touched (pinned at once on a GPU).")
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
        doc="Write a Chrome-trace JSON of each step (forward / backward compute, NVMe writes "
            "and reads, copies, stalls) to this file at the end of the step; opens in "
            "ui.perfetto.dev. Its directory must exist.")
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
                raw, where = overrides[name], f"{name}={overrides[name]!r}"
            elif env.get(envname, "").strip() != "":
                raw, where = env[envname], f"{envname}={env[envname]!r}"
            else:
                continue
            values[name] = PARSERS[name](raw, where, env)
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

    def validate(self, *, nvme_dir_alternative: str | None = _DROP_NVME) -> None:
        """Cross-checks that need more than one knob or a look at the file system.

        Read-only: stats the NVMe directories but creates nothing.

        Args:
            nvme_dir_alternative: what a message about an unusable NVMe directory offers
                besides pointing it elsewhere (the runtime's: drop 'nvme' from the tiers;
                a CLI says its own, None offers nothing else).

        Raises:
            ConfigError: naming the variable, the value and what to do.
        """
        if not self.enabled:
            return  # turned off: nothing else may stop the run (OFFLOAD_ENABLED)
        if "nvme" in self.tiers and self.policy != "keep":
            self.check_nvme_dirs(nvme_dir_alternative)
            self._validate_nvme_size()
        if self.trace is not None:
            self._validate_trace()
        if self.budget is not None and self.policy != "auto":
            _warn_once(f"budget_unused_{self.policy}",
                       f"offload: {self.where('budget')} applies to policy='auto' only; under "
                       f"{self.where('policy')} it is not used")
        self._validate_host_sizes()
        if "nvme" in self.tiers and self.prefetch_bytes > self.staging_bytes:
            _warn_once("prefetch_over_staging",
                       f"offload: {self.where('prefetch_bytes')} is more than "
                       f"{self.where('staging_bytes')}: read-ahead beyond the staging arena "
                       "lands in buffers allocated per read (more allocations and RSS); lower "
                       "the first or raise the second")

    def _validate_host_sizes(self) -> None:
        if max(self.staging_bytes, self.prefetch_bytes) <= memory_floor_bytes():
            return  # below any limit this process has: no need to look now
        limit = available_memory()
        for name in ("staging_bytes", "prefetch_bytes"):
            value = getattr(self, name)
            if value > limit.total_bytes:
                where = "this machine's RAM" if limit.source == "RAM available" \
                    else f"this process's memory limit ({limit.source})"
                raise ConfigError(
                    f"{self.where(name)}: more than {where} ({format_bytes(limit.total_bytes)}); "
                    "both live in host memory (give a size such as \"256MiB\")")

    def _validate_trace(self) -> None:
        where = self.where("trace")
        directory = os.path.dirname(os.path.abspath(self.trace))
        fix = "point it at a file in an existing, writable directory, or unset OFFLOAD_TRACE"
        if os.path.isdir(self.trace):
            raise ConfigError(f"{where}: {self.trace!r} is a directory ({fix})")
        if not os.path.isdir(directory):
            raise ConfigError(f"{where}: directory {directory!r} does not exist ({fix})")
        if not os.access(directory, os.W_OK | os.X_OK):
            raise ConfigError(f"{where}: directory {directory!r} is not writable by this "
                              f"process ({fix})")

    def check_nvme_dirs(self, alternative: str | None = _DROP_NVME) -> None:
        """The NVMe directories' checks of `validate` (they exist, are writable, on a disk),
        whatever the policy; `alternative` as validate()'s `nvme_dir_alternative`."""
        tiers = self.where("tiers")
        if alternative is _DROP_NVME:
            alternative = f"drop 'nvme' from {knob(tiers, 'tiers')}"
        if not self.nvme_dir:
            unset, fix = ("OFFLOAD_NVME_DIR is not set", "set OFFLOAD_NVME_DIR to") \
                if tiers.startswith("OFFLOAD_") else \
                ("nvme_dir= is not given (nor OFFLOAD_NVME_DIR set)", "pass nvme_dir=")
            raise ConfigError(
                f"{unset} but {tiers} includes 'nvme' ({fix} a writable directory on a "
                f"local SSD, or drop 'nvme' from {knob(tiers, 'tiers')})")
        where = self.where("nvme_dir")
        for path in self.nvme_dir:
            fix = "point it at a writable directory on a local SSD" + \
                (f", or {alternative}" if alternative else "")
            if not os.path.exists(path):
                raise ConfigError(f"{where}: {path!r} does not exist ({fix})")
            if not os.path.isdir(path):
                raise ConfigError(f"{where}: {path!r} is not a directory ({fix})")
            fs = os.statvfs(path)
            if fs.f_blocks == 0:   # its free space cannot be known; ramfs is RAM besides
                raise ConfigError(
                    f"{where}: {path!r} is on a file system that reports no size (ramfs, "
                    "which keeps files in RAM, or a virtual one such as /proc or /sys); the "
                    f"nvme tier needs a disk-backed directory ({fix})")
            if fs.f_flag & os.ST_RDONLY:
                raise ConfigError(f"{where}: {path!r} is on a read-only file system ({fix})")
            if not os.access(path, os.W_OK | os.X_OK):
                raise ConfigError(f"{where}: {path!r} is not writable by this process ({fix})")
            kind = _fs_type_of(path)
            if kind in RAM_FS_TYPES:   # ramfs reports no size: refused above
                _warn_once(f"nvme_dir_in_ram:{os.path.realpath(path)}",
                           f"offload: {where}: {path!r} is on {kind}, whose files are RAM: "
                           f"the nvme tier reserves its capacity ({self.nvme_bytes}) there "
                           "in host memory, and nothing it writes leaves RAM (fine for a "
                           "test; for training point it at a directory on a local SSD)")

    # ---------------------------------------------------------------- capacities
    def host_capacity_bytes(self) -> int:
        """Capacity of the host tier in bytes (see `host_capacity`)."""
        return self.host_capacity()[0]

    def host_capacity(self) -> tuple[int, str]:
        """Capacity of the host tier in bytes, and what it was taken of: a percentage is of
        the memory this process may use now (the RAM available, or less in a memory cgroup:
        memory_limits NOTE [Memory limits]), divided among the processes of this host
        (NOTE [Host share] in ranks.py)."""
        global _host_seen
        if self.host_bytes.fraction is None:
            return self.host_bytes.nbytes, "OFFLOAD_HOST_BYTES"
        limit = available_memory()   # the same object while its reading stands
        seen = _host_seen
        if seen is not None and seen[0] is self and seen[1] is limit:
            return seen[2]   # asked every step: worked out once per reading
        capacity = (self._resolve_share(self.host_bytes, lambda: limit.available_bytes, "ram"),
                    f"{self.host_bytes} of {limit.source}")
        _host_seen = (self, limit, capacity)
        return capacity

    def nvme_capacity_bytes(self) -> int:
        """Capacity of the nvme tier in bytes, checked against the free space as the store
        stripes it (NOTE [Striped room] in util/disk_space.py: an equal share in each
        directory); a percentage is of what fits now, divided among the processes of this
        host.

        Raises:
            ConfigError: an absolute size whose share does not fit in some directory.
        """
        room = striped_room(self.nvme_dir)   # once: the share and the check read the same
        capacity = self._resolve_share(self.nvme_bytes, lambda: room.capacity_bytes, room.key)
        self._check_nvme_fits(capacity, room)
        return capacity

    def nvme_capacity_source(self) -> str:
        """What `nvme_capacity_bytes` is taken of, in words (Stats' capacity_source)."""
        if self.nvme_bytes.fraction is None:
            return "OFFLOAD_NVME_BYTES"
        return f"{self.nvme_bytes} of the free space in {', '.join(self.nvme_dir)}"

    def _validate_nvme_size(self) -> None:
        """An absolute OFFLOAD_NVME_BYTES must fit now; slabs of this process's own that
        opening the store gives back first count as free (nvme_space.slabs_given_back)."""
        if self.nvme_bytes.fraction is not None:
            return  # a percentage is of what fits when the store opens
        smallest = nvme_space.smallest_store_bytes(len(self.nvme_dir))
        if self.nvme_bytes.nbytes < smallest:
            raise ConfigError(
                f"{self.where('nvme_bytes')}: is under the nvme tier's smallest store, "
                f"{format_bytes(smallest)} (1 MiB per directory; give a size such as "
                "'64GiB' or a percentage such as '50%')")
        held = nvme_space.slabs_given_back(self.nvme_dir)
        self._check_nvme_fits(self.nvme_bytes.nbytes, striped_room(self.nvme_dir, held))

    def _check_nvme_fits(self, capacity: int, room: StripedRoom) -> None:
        short = room.short_for(capacity)
        if short is None:
            return
        where = self.where("nvme_bytes")
        ranks = self.ranks.local_world_size
        fix = (f"each of the {ranks} processes of this host takes this size: lower it, or "
               "give a percentage, which is divided among them" if ranks > 1 else
               "lower it, or give a percentage such as '50%'")
        free = format_bytes(short.free_bytes)
        if len(room.file_systems) == 1:
            raise ConfigError(f"{where}: only {free} free in {', '.join(self.nvme_dir)} ({fix})")
        # Striped over file systems of unequal room: name the one that is short.
        raise ConfigError(
            f"{where}: only {free} free in {' and '.join(map(repr, short.dirs))}, whose share "
            f"would be {format_bytes(room.share_bytes(short, capacity))}: the store puts an "
            f"equal share in each of the {room.n_dirs} directories of "
            f"{self.where('nvme_dir')}, so at most {format_bytes(room.capacity_bytes)} fits "
            f"({fix}; or free space there, or leave that directory out)")

    def _resolve_share(self, spec: SizeSpec, measure: Callable[[], int], what: str) -> int:
        """Bytes of `spec` for this process; a percentage of the host-wide total `measure`
        returns is divided among the local ranks (ranks.py NOTE [Host share])."""
        if spec.fraction is None:
            return spec.nbytes  # a size is per process, as given
        if self.ranks.local_size_unknown:
            _warn_once("local_size_unknown",
                       "offload: LOCAL_RANK is set but LOCAL_WORLD_SIZE is not, so percentage "
                       "capacities (OFFLOAD_HOST_BYTES, OFFLOAD_NVME_BYTES) are not divided "
                       "among the processes of this host; every process takes the whole "
                       "percentage (set LOCAL_WORLD_SIZE, launch with torchrun, or give sizes "
                       "per process such as '8GiB')")
        if self.ranks.local_world_size == 1:
            return spec.resolve(measure())
        now = measure()
        share = self.ranks.local_share(spec.resolve(agreed_total(what, lambda: now)))
        # The agreed total is from the job's first measurement: never take more than the
        # percentage of what is there now (the disk may have filled up since).
        return min(share, spec.resolve(now))

    def apply_log_level(self) -> None:
        """Set the `offload` logger's level from OFFLOAD_LOG (kept when unset) and which
        ranks log INFO lines from OFFLOAD_LOG_RANKS (offload/util/logs.py)."""
        logs.configure(self.log, self.log_ranks)


# (config, the MemoryLimit it read, its host capacity): the last answer of `host_capacity`.
_host_seen: tuple | None = None


def _knobs():
    """The fields that are settings (each has an env var); not `sources` or `ranks`."""
    return [f for f in fields(Config) if "env" in f.metadata]


_warned_once: set[str] = set()


def forget_warnings() -> None:
    """Say the once-per-process warnings again (offload.process.reset)."""
    _warned_once.clear()
    _warned_unknown.clear()
    _last_scan[0] = None
    _from_env_cache.clear()
    _fs_types.clear()


# Directory -> its file system type, read once: /proc/self/mountinfo costs ~90 us with 20
# mounts, and a context is often built every step.
_fs_types: dict[str, str | None] = {}


def _fs_type_of(path: str) -> str | None:
    real = os.path.realpath(path)
    if real not in _fs_types:
        _fs_types[real] = fs_type(real)
    return _fs_types[real]


def _warn_once(key: str, message: str) -> None:
    if key not in _warned_once:
        _warned_once.add(key)
        logging.getLogger("offload").warning(message)


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
