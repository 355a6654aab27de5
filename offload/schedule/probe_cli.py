"""`offload-probe`: print the figures `auto` plans with, next to the physical ceilings.

    offload-probe                          # cached figures (measured on first use)
    offload-probe --refresh --nvme-dir /mnt/nvme0
    offload-probe --json figures.json

Ceilings: the PCIe link's theoretical rate per direction from NVML (generation x width of
the GPU found by its PCI bus id; needs the optional `nvidia-ml-py`,
`pip install 'offload[gpu]'`), host RAM from psutil, the
NVMe directory's file system, device and free space from psutil. Settings come from the
OFFLOAD_* variables like in a training run; the options override them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

__all__ = ["main", "pci_bus_id", "pcie_ceiling", "pcie_gbps"]

# Transfer rate per lane in GT/s and the line encoding's payload share, by PCIe generation.
_PCIE_GTS = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}


def pcie_gbps(generation: int, width: int) -> float | None:
    """Theoretical GB/s per direction of a PCIe link (before packet overhead)."""
    gts = _PCIE_GTS.get(generation)
    if gts is None or width <= 0:
        return None
    encoding = 8 / 10 if generation <= 2 else 128 / 130  # gen 6 (FLIT) is close to 1 too
    return gts * width * encoding / 8


def pci_bus_id(device_index: int) -> str | None:
    """The PCI address ("domain:bus:device.0", NVML's format) of torch's CUDA device
    `device_index`, or None when torch does not report it."""
    import torch

    props = torch.cuda.get_device_properties(device_index)
    try:
        domain, bus, dev = props.pci_domain_id, props.pci_bus_id, props.pci_device_id
    except AttributeError:
        return None
    return f"{domain:04x}:{bus:02x}:{dev:02x}.0"


def pcie_ceiling(device_index: int) -> tuple[str, float | None]:
    """(description, GB/s per direction) of the PCIe link of torch's CUDA device
    `device_index`, via NVML.

    NVML numbers every GPU of the machine in PCI order; torch numbers the visible ones
    (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER): the GPU is found by its PCI bus id, never
    by torch's index.
    """
    try:
        import pynvml  # the `gpu` extra (nvidia-ml-py); imported only here
    except ImportError:
        return "unknown (pip install 'offload[gpu]' for nvidia-ml-py)", None
    bus_id = pci_bus_id(device_index)
    if bus_id is None:
        return ("unknown (torch reports no PCI bus id for cuda:"
                f"{device_index}, so its NVML device cannot be told apart)"), None
    try:
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id.encode())
            gen = pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)
            width = pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle)
            max_gen = pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle)
            max_width = pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle)
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # NVML errors are their own class tree; report, don't fail
        return f"unknown (NVML, GPU at {bus_id}: {exc})", None
    rate = pcie_gbps(gen, width)
    text = f"PCIe gen {gen} x{width} (max gen {max_gen} x{max_width}) at {bus_id}"
    # An idle GPU may train its link down to save power: report the current one.
    return text, rate


def _disk_line(path: str) -> str:
    import psutil

    real = os.path.realpath(path)
    best = None
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint
        if (real == mp or real.startswith(mp.rstrip("/") + "/")) and \
                (best is None or len(mp) > len(best.mountpoint)):
            best = part
    free = psutil.disk_usage(path).free
    if best is None:
        return f"{path}: {free / 1e9:.1f} GB free"
    rotational = ""
    dev = os.path.basename(best.device)
    for candidate in (dev, dev.rstrip("0123456789"), dev.split("p")[0]):
        flag = f"/sys/block/{candidate}/queue/rotational"
        if os.path.exists(flag):
            with open(flag) as f:
                rotational = ", rotational" if f.read().strip() == "1" else ", solid state"
            break
    return (f"{path}: {best.device} ({best.fstype}{rotational}), {free / 1e9:.1f} GB free; "
            "the OS reports no bandwidth ceiling for it")


def rows(figures, device, ceilings: dict[str, str]) -> list[tuple[str, str, str, str]]:
    return [(name, text, source, ceilings.get(name, ""))
            for name, text, source in figures.entries()]


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:   # Ctrl-C: said, no traceback (the probe removes its files)
        sys.stderr.write("offload-probe: interrupted\n")
        return 130


def _main(argv: list[str] | None) -> int:
    import psutil
    import torch

    from ..config import Config
    from ..config_parse import parse_nvme_dirs
    from ..errors import ConfigError, StorageError
    from ..util.output_files import output_file_problem, write_output_file
    from . import probe

    p = argparse.ArgumentParser(prog="offload-probe", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default: cuda if "
                                                    "available)")
    p.add_argument("--nvme-dir", help="NVMe directory to measure (default $OFFLOAD_NVME_DIR)")
    p.add_argument("--io-workers", type=int, help="engine threads (default $OFFLOAD_IO_WORKERS)")
    p.add_argument("--refresh", action="store_true", help="measure again, update the cache")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    if args.io_workers is not None and args.io_workers < 1:
        p.error(f"--io-workers {args.io_workers}: must be at least 1 (leave it out for "
                "$OFFLOAD_IO_WORKERS, default 4)")
    # Written after measuring: a path that cannot be written fails now, not after it.
    problem = args.json is not None and output_file_problem(args.json, "figures.json")
    if problem:
        p.error(f"--json {args.json!r}: {problem}")
    text = args.device if args.device != "auto" else \
        ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        p.error(f"--device {args.device!r}: not a device (use cpu, cuda or cuda:N)")
    if device.type not in ("cpu", "cuda"):   # (meta, xpu: the probe has no figures for them)
        p.error(f"--device {args.device!r}: only cpu and cuda are supported")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device!r}: torch sees no CUDA device")
    overrides: dict[str, Any] = {}
    if args.nvme_dir:
        overrides["nvme_dir"] = args.nvme_dir
    if args.io_workers is not None:
        overrides["io_workers"] = args.io_workers
    if args.refresh:
        overrides["probe"] = "refresh"
    source = f"--nvme-dir {args.nvme_dir!r}"   # what the messages name
    try:
        if args.nvme_dir:   # the runtime's rules, before from_env names nvme_dir= instead
            parse_nvme_dirs(args.nvme_dir, source)
        config = Config.from_env(**overrides)
        if config.nvme_dir:
            config = config.with_overrides(tiers=",".join(dict.fromkeys((*config.tiers,
                                                                         "nvme"))))
            if args.nvme_dir:
                config = dataclasses.replace(config, sources={**config.sources,
                                                              "nvme_dir": source})
            # The probe measures the disk because a directory was given, whatever
            # OFFLOAD_POLICY / OFFLOAD_ENABLED say (validate() skips the directories under
            # keep or disabled): the alternative to fixing it is giving none.
            config.check_nvme_dirs("leave out --nvme-dir" if args.nvme_dir
                                   else "unset OFFLOAD_NVME_DIR to measure no disk")
        figures = probe.figures_for(config, device)
    except (ConfigError, StorageError) as exc:   # a bad setting; a disk it cannot measure
        text = str(exc)
        if args.io_workers is not None:   # named as given here, not as the keyword
            text = text.replace(f"io_workers={args.io_workers}:",
                                f"--io-workers {args.io_workers}:", 1)
        p.error(text)
    ceilings: dict[str, str] = {}
    if device.type == "cuda":
        link, rate = pcie_ceiling(device.index if device.index is not None
                                  else torch.cuda.current_device())
        for name in ("d2h_gbps", "h2d_gbps", "d2h_small_gbps"):
            ceilings[name] = link + (f": {rate:.1f} GB/s" if rate else "")
    for name in ("nvme_write_gbps", "nvme_read_gbps"):
        if config.nvme_dir:
            ceilings[name] = "; ".join(_disk_line(d) for d in config.nvme_dir)
    table = rows(figures, device, ceilings)
    width = [max(len(r[i]) for r in table + [("figure", "value", "source", "ceiling")])
             for i in range(3)]
    print(f"offload-probe: {probe._device_name(device)}, cache {probe.cache_path()}")
    print(f"{'figure':<{width[0]}}  {'value':<{width[1]}}  {'source':<{width[2]}}  ceiling")
    for r in table:
        print(f"{r[0]:<{width[0]}}  {r[1]:<{width[1]}}  {r[2]:<{width[2]}}  {r[3]}")
    if not config.nvme_dir:
        print("nvme: not measured (no --nvme-dir, no OFFLOAD_NVME_DIR)")
    vm = psutil.virtual_memory()
    print(f"host RAM: {vm.total / 2**30:.1f} GiB total, {vm.available / 2**30:.1f} GiB "
          f"available; {os.cpu_count()} CPUs")
    if args.json:   # replaced at once: a reader never sees half of it
        write_output_file(args.json, lambda f: json.dump(
            {"device": str(device), "figures": figures.as_dict(),
             "sources": dict(figures.sources), "ceilings": ceilings}, f, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
