"""N torchrun ranks on one host, each offloading: what each got, and what all of them took.

    python benchmarks/ranks_share.py --nproc 8 --nvme-root /mnt/nvme -- --steps 3

Runs `examples/ddp_torchrun.py` under `torchrun --standalone --nproc-per-node N` with
`OFFLOAD_NVME_DIR=<nvme-root>/{rank}` and prints:

- the configured share of the host: OFFLOAD_HOST_BYTES of the RAM available and
  OFFLOAD_NVME_BYTES of the free space of <nvme-root>'s file system, both measured before
  the launch (the defaults are 50 %);
- the capacities each rank reported (`ctx.stats.host_capacity_bytes`,
  `nvme_capacity_bytes`) and their sums;
- sampled every 20 ms during the run: the disk space reserved (free space before the launch
  minus free space now, by statvfs of <nvme-root>) and the RSS of all rank processes
  together (torch, model and data included, so an upper bound on what offload holds).

Give <nvme-root> a file system of its own (a loop-mounted image will do) so that nothing
else changes its free space during the run. Exits 1 if the ranks' capacities or the disk
space reserved exceed the configured share.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from offload.util.sizes import format_bytes, parse_size  # noqa: E402

MiB = 1 << 20
LINE = re.compile(r"rank (\d+)/\d+ .*host capacity ([\d.]+) MiB, nvme capacity ([\d.]+) MiB")


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class Sampler(threading.Thread):
    """Peak disk reserved under `path` and peak summed RSS of `proc`'s descendants."""

    def __init__(self, proc: subprocess.Popen, path: str, free_before: int) -> None:
        super().__init__(daemon=True)
        self.proc, self.path, self.free_before = proc, path, free_before
        self.peak_reserved = 0
        self.peak_rss = 0
        self.samples = 0

    def run(self) -> None:
        parent = psutil.Process(self.proc.pid)
        while self.proc.poll() is None:
            self.peak_reserved = max(self.peak_reserved, self.free_before - free_bytes(self.path))
            rss = 0
            try:
                for child in parent.children(recursive=True):
                    try:
                        rss += child.memory_info().rss
                    except psutil.NoSuchProcess:
                        pass
            except psutil.NoSuchProcess:
                break
            self.peak_rss = max(self.peak_rss, rss)
            self.samples += 1
            time.sleep(0.02)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--nvme-root", required=True, help="directory; rank r uses <root>/r")
    p.add_argument("example_args", nargs="*", help="passed to examples/ddp_torchrun.py")
    args = p.parse_args()

    host_spec = parse_size(os.environ.get("OFFLOAD_HOST_BYTES", "50%"), allow_percent=True)
    nvme_spec = parse_size(os.environ.get("OFFLOAD_NVME_BYTES", "50%"), allow_percent=True)
    available = psutil.virtual_memory().available
    free_before = free_bytes(args.nvme_root)
    # A percentage is of the whole host; a size is per rank (README, Distributed).
    host_share = host_spec.resolve(available) * (1 if host_spec.fraction else args.nproc)
    nvme_share = nvme_spec.resolve(free_before) * (1 if nvme_spec.fraction else args.nproc)

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.nproc}", os.path.join(ROOT, "examples", "ddp_torchrun.py"),
           "--nvme-dir", os.path.join(args.nvme_root, "{rank}"), *args.example_args]
    print("$", " ".join(cmd), flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = Sampler(proc, args.nvme_root, free_before)
    sampler.start()
    out = proc.stdout.read()
    proc.wait()
    sampler.join()
    wall = time.perf_counter() - start
    sys.stdout.write(out)
    if proc.returncode != 0:
        sys.exit(f"torchrun exited {proc.returncode}")

    ranks = {int(r): (float(h) * MiB, float(n) * MiB) for r, h, n in LINE.findall(out)}
    if len(ranks) != args.nproc:
        sys.exit(f"expected {args.nproc} rank reports, found {len(ranks)}")
    host_sum = sum(h for h, _ in ranks.values())
    nvme_sum = sum(n for _, n in ranks.values())
    print(f"\n{args.nproc} ranks, {wall:.0f} s, {sampler.samples} samples")
    print(f"host: RAM available before {format_bytes(available)}; share "
          f"(OFFLOAD_HOST_BYTES={host_spec}) {format_bytes(host_share)}")
    print(f"nvme: {args.nvme_root} free before {format_bytes(free_before)}; share "
          f"(OFFLOAD_NVME_BYTES={nvme_spec}) {format_bytes(nvme_share)}")
    print("rank  host capacity  nvme capacity")
    for r in sorted(ranks):
        h, n = ranks[r]
        print(f"{r:>4}  {format_bytes(h):>13}  {format_bytes(n):>13}")
    print(f" sum  {format_bytes(host_sum):>13}  {format_bytes(nvme_sum):>13}")
    print(f"peak disk reserved (statvfs): {format_bytes(sampler.peak_reserved)} "
          f"= {sampler.peak_reserved / nvme_share:.1%} of the nvme share")
    print(f"peak RSS of all ranks together: {format_bytes(sampler.peak_rss)} "
          f"= {sampler.peak_rss / host_share:.1%} of the host share")
    slack = MiB  # capacities are printed to 0.1 MiB
    over = [what for what, used, share in [("host capacities", host_sum, host_share),
                                           ("nvme capacities", nvme_sum, nvme_share),
                                           ("disk reserved", sampler.peak_reserved, nvme_share)]
            if used > share + slack]
    print("within the configured share" if not over else f"OVER THE SHARE: {', '.join(over)}")
    sys.exit(1 if over else 0)


if __name__ == "__main__":
    main()
