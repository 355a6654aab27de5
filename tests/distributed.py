"""Run a function on N gloo ranks of this host (CPU), as torchrun would start them:
RANK / LOCAL_RANK / WORLD_SIZE / LOCAL_WORLD_SIZE set, one process group.

The ranks fork from a forkserver that has imported torch and nothing else: importing torch
took 2-5 s per rank and test on two loaded cores (spawn), the fork takes milliseconds. The
server ran no computation, so a rank starts with no thread pool, no allocator cache and this
package not imported, as a fresh interpreter would. The caller's environment, as it is at
the call, applies from `_entry` on; importing the module `fn` is in runs before, in the
server's environment (the one of its start): nothing reads OFFLOAD_* at import.

The rendezvous is a file (no port to pick, so parallel test runs cannot collide). Each
rank's return value comes back through a file; an exception in any rank fails the caller
with that rank's traceback.
"""
from __future__ import annotations

import multiprocessing
import os
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(local_rank: int, world: int, fn: Callable, args: tuple, env: dict[str, str],
           work: str, timeout_s: float | None) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # N ranks on a 2-core machine: no oversubscription
    out = os.path.join(work, f"rank{local_rank}")
    try:
        timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        dist.init_process_group("gloo", init_method=f"file://{work}/rendezvous",
                                rank=local_rank, world_size=world, **timeout)
        # Every rank connected before any goes on: a rank that calls no collective (or
        # destroys the group at once) and leaves closes the sockets of a peer still
        # connecting ("Connection closed by peer" on a loaded machine). Not after `fn`:
        # there a peer that failed to pair a collective would wait out the timeout.
        dist.barrier()
        try:
            result = fn(*args)
        finally:
            dist.destroy_process_group()
        torch.save({"ok": result}, out)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)
        raise


def run_ranks(fn: Callable, *args: Any, world: int = 2,
              env: dict[str, str] | None = None, timeout_s: float | None = None) -> list[Any]:
    """`fn(*args)` on `world` ranks; returns each rank's result, rank 0 first.

    `fn` must be importable by name from a fresh process (a module-level function).
    `timeout_s`: the process group's timeout (a collective left unpaired fails after it;
    torch's default is 30 minutes).
    """
    environ = {**os.environ, **(env or {})}
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed"])
    with tempfile.TemporaryDirectory(prefix="offload-dist-") as work:
        try:
            mp.start_processes(_entry, args=(world, fn, args, environ, work, timeout_s),
                               nprocs=world, start_method="forkserver")
        except Exception as exc:
            errors = []
            for r in range(world):
                path = os.path.join(work, f"rank{r}")
                if os.path.exists(path):
                    errors += [f"rank {r}:\n{v}" for k, v in torch.load(path).items()
                               if k == "error"]
            raise AssertionError("\n".join(errors) or str(exc)) from None
        return [torch.load(os.path.join(work, f"rank{r}"), weights_only=False)["ok"]
                for r in range(world)]


def stop_forkserver() -> None:
    """Stop this process's forkserver, if one runs: the next user starts its own, with its
    own preload (one server per process, its preload fixed at its start: offload-bench's
    workers fork from one that has imported the benchmark's worker, and transformers for
    --hf). Private API of multiprocessing (3.8+); without it the server stays."""
    from multiprocessing import forkserver
    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is not None:
        stop()
