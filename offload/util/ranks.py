"""Where this process stands among the ranks of a distributed run, and what follows from it.

The launcher tells each process its place through environment variables: RANK and
WORLD_SIZE over the whole job, LOCAL_RANK and LOCAL_WORLD_SIZE among the processes of this
host (torchrun sets all four; a missing one takes its single-process default, and LOCAL_RANK
without LOCAL_WORLD_SIZE gets one warning). They are the launcher's variables, not ours, and
are read once per `Config` (they do not change during a run).

NOTE [Host share] A percentage capacity (`OFFLOAD_HOST_BYTES=50%`, `OFFLOAD_NVME_BYTES=50%`)
is a share of something every process of the host draws from: its RAM, the free space of a
file system. With `torchrun --nproc-per-node 8` each of the 8 processes resolving "50 %" on
its own would claim 400 % of the RAM between them and `fallocate` half of what the ranks
before it left. So a percentage is divided among the local ranks (`local_share`); an
absolute size is what the user gave for one process and stays as it is.

The ranks must also divide the *same* total. Each process resolves its capacity when it
first needs it, and the free space it sees then already lacks what the ranks before it
reserved (on 2 ranks the second got 75 % of the first's share; 8 ranks opening one after
the other would take 40 % of the disk instead of 50 %, the last 64 % of the first's). So when a process group is up, the first local rank to
measure a host-wide total (free space of a file system, available RAM) publishes it in the
job's key-value store (`compare_set`: one atomic write, no collective, so ranks that never
offload or arrive late block nobody) and every local rank divides that figure
(`agreed_total`). Without a process group each process uses what it measures.
"""
from __future__ import annotations

import os
import socket
import sys
from typing import Callable, Mapping, NamedTuple

from ..errors import ConfigError

__all__ = ["Ranks", "current_rank", "agreed_total"]


class Ranks(NamedTuple):
    """This process's place in the job (a single process: rank 0 of 1)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    # LOCAL_RANK set without LOCAL_WORLD_SIZE: a launcher that does not say how many
    # processes share the host, so percentages cannot be divided (Config warns once).
    local_size_unknown: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Ranks":
        """Read RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE (each defaults to a single
        process).

        Raises:
            ConfigError: a value that is not a whole number, or not in range.
        """
        env = os.environ if env is None else env
        rank = _int(env, "RANK", 0, minimum=0)
        local_rank = _int(env, "LOCAL_RANK", 0, minimum=0)
        world = _int(env, "WORLD_SIZE", 1, minimum=1)
        local_world = _int(env, "LOCAL_WORLD_SIZE", 1, minimum=1)
        if local_world > world and "WORLD_SIZE" in env:
            raise ConfigError(
                f"LOCAL_WORLD_SIZE={local_world} is more than WORLD_SIZE={world} (the launcher "
                "sets both: start the job with torchrun, or set them consistently)")
        unknown = "LOCAL_RANK" in env and "LOCAL_WORLD_SIZE" not in env
        return cls(rank, local_rank, world, local_world, unknown)

    def local_share(self, total_bytes: int) -> int:
        """This process's part of a host-wide quantity (NOTE [Host share])."""
        return total_bytes // self.local_world_size

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _int(env: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: not a whole number (the launcher sets it, e.g. "
                          "torchrun; unset it for a single-process run)") from None
    if value < minimum:
        raise ConfigError(f"{name}={raw!r}: must be at least {minimum} (the launcher sets it, "
                          "e.g. torchrun; unset it for a single-process run)")
    return value


def current_rank() -> int | None:
    """The global rank for log lines: RANK, else torch.distributed's rank when a process
    group is up (`mp.spawn` scripts often set no RANK); None for a single process."""
    raw = os.environ.get("RANK", "").strip()
    world = os.environ.get("WORLD_SIZE", "").strip()
    if raw.isdigit() and world.isdigit() and int(world) > 1:
        return int(raw)
    dist = _initialized_dist()
    if dist is not None and dist.get_world_size() > 1:
        return dist.get_rank()
    return None


def agreed_total(name: str, measure: Callable[[], int]) -> int:
    """A host-wide total as the first local rank to ask measured it (NOTE [Host share]).

    Args:
        name: What is measured, unique on this host (e.g. the file systems' device ids).
        measure: Measures it now; its value is used as is without a process group.
    """
    value = measure()
    dist = _initialized_dist()
    if dist is None:
        return value
    try:
        store = dist.distributed_c10d._get_default_store()
        key = f"offload/host-total/{socket.gethostname()}/{name}"
        return int(store.compare_set(key, "", str(value)))
    except Exception:  # a store without compare_set, or gone: the local figure is safe too
        return value


def _initialized_dist():
    """torch.distributed when a process group is up; never imports it."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist
    return None
