"""What every script in examples/ shares: the model-size arguments, `--check` (the weights
trained with offload against the same training without it, bit for bit), and the torchrun
setup of the two distributed examples. The scripts import it as `support` (Python puts the
script's folder on the path); copy this file along with a script you take elsewhere."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

import torch

__all__ = ["example_parser", "check_weights", "say", "torchrun_device", "rank_dirs",
           "remove_dirs", "run_trainer_example"]


def example_parser(doc: str, *, steps: int, tiers: str,
                   check_help: str = "train again without offload and compare the weights "
                                     "bit for bit") -> argparse.ArgumentParser:
    """--steps/--batch/--hidden/--layers/--heads/--seq-len/--tiers/--check; add your own.
    Every example calls it first: from here a SIGTERM exits through the script's `finally`
    blocks too, as Ctrl-C does (`timeout`, Slurm and Kubernetes stop a job with SIGTERM;
    it left the example's scratch directory in /var/tmp)."""
    _exit_on_sigterm()
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--tiers", default=os.environ.get("OFFLOAD_TIERS", tiers))
    p.add_argument("--check", action="store_true", help=check_help)
    return p


def say(line: str) -> None:
    """One line in one write, so lines of several ranks never interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def check_weights(weights: Sequence[torch.Tensor], plain: Sequence[torch.Tensor],
                  what: str = "weights vs no offload") -> None:
    """Print whether the two trainings ended with the same weights; exit 1 if not."""
    same = all(torch.equal(a, b) for a, b in zip(weights, plain))
    say(f"{what}: {'bit-exact' if same else 'DIFFERENT'}")
    if not same:
        raise SystemExit(1)


def _exit_on_sigterm() -> None:
    import signal

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def torchrun_device() -> torch.device:
    """This rank's device, and its process group (NCCL on GPUs, gloo on CPU). A SIGTERM
    (torchrun stopping the ranks: a Ctrl-C to it, another rank failing) exits through the
    script's `finally` blocks, which remove what the rank made."""
    import torch.distributed as dist

    _exit_on_sigterm()

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # N ranks share the host's cores: one compute thread each, not N x all of them.
        torch.set_num_threads(max(1, os.cpu_count() // int(os.environ["LOCAL_WORLD_SIZE"])))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def rank_dirs(spec: str) -> tuple[list[str], list[str]]:
    """Make this rank's NVMe directories that do not exist yet, with their parents; return
    (them, the parents the ranks of this host made) for `remove_dirs` afterwards. Call it on
    every rank once the process group is up."""
    import socket

    import torch.distributed as dist
    from offload.config_parse import parse_nvme_dirs

    made = [d for d in parse_nvme_dirs(spec) if not os.path.isdir(d)]
    parents = set()
    for d in made:
        parent = os.path.dirname(os.path.abspath(d))
        while not os.path.isdir(parent):
            parents.add(parent)
            parent = os.path.dirname(parent)
    for d in made:
        os.makedirs(d)
    if dist.is_initialized():  # another rank of this host may have made a parent first
        host, everyone = socket.gethostname(), [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (host, sorted(parents)))
        parents = {p for h, theirs in everyone if h == host for p in theirs}
    return made, sorted(parents, key=len, reverse=True)  # deepest first


def remove_dirs(made: tuple[list[str], list[str]]) -> None:
    """Remove what `rank_dirs` made: this rank's directories with os.rmdir, which fails if
    anything was left behind, then each parent once it is empty (so the last rank to finish
    removes the default /var/tmp/offload-ddp)."""
    own, parents = made
    for d in own:
        os.rmdir(d)
    for parent in parents:
        try:
            os.rmdir(parent)
        except OSError:  # another rank's directory is still in it: that rank removes it
            pass


def run_trainer_example(args, train, offload_trainer, plain_trainer, prefix: str) -> None:
    """The Hugging Face Trainer examples' run: `train(args, out_dir, trainer_class)` with the
    offload trainer (NVMe in a temporary directory unless OFFLOAD_NVME_DIR says where), one
    line of its last micro-batch's stats, then with `--check` the same with the plain
    trainer and the weights compared. Returns (weights, trainer) of the offload run."""
    import shutil
    import tempfile

    import offload

    work = tempfile.mkdtemp(prefix=prefix, dir="/var/tmp")
    nvme_dir = os.environ.get("OFFLOAD_NVME_DIR") or os.path.join(work, "nvme")
    os.makedirs(nvme_dir, exist_ok=True)
    try:
        # Keyword settings win over OFFLOAD_* variables (same names, lower case).
        offload_trainer.offload_settings = {"tiers": args.tiers, "nvme_dir": nvme_dir}
        weights, trainer = train(args, os.path.join(work, "out"), offload_trainer)
        s = trainer.offload_context.stats
        say(f"last micro-batch: saved {s.saved_bytes >> 20} MiB, nvme {s.nvme_bytes >> 20} "
            f"MiB, kept {s.kept_bytes >> 20} MiB, stall {s.stall_s:.3f} s")
        offload.empty_cache()
        if args.check:
            plain, _ = train(args, os.path.join(work, "plain"), plain_trainer)
            check_weights(weights, plain, f"weights vs plain {plain_trainer.__name__}")
    finally:
        shutil.rmtree(work)
