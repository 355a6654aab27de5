"""`auto`'s clock on CUDA (offload/util/clock.py), against a fake device whose work runs
after the host launched it and whose events are done only once waited for, as CUDA's:
the step's forward and backward windows and its trial times are device time, not launch
time, and every event pair is waited for before it is read."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import offload
from offload.schedule import auto_session, search as search_mod
from offload.schedule.op_timer import OpTimer
from offload.schedule.profile import OpRecord

from schedule_models import SLOW


class FakeDevice:
    """Streams of queued work: `launch` queues seconds of work on the current stream and
    returns at once (the host does not wait); an event is done once it, or a later event of
    its stream, was synchronized."""

    def __init__(self) -> None:
        self.queued_s = 0.0
        self.stream = "compute"
        self.events: list["FakeEvent"] = []

    def launch(self, seconds: float) -> None:
        self.queued_s += seconds

    def event(self, enable_timing: bool = True) -> "FakeEvent":
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.at_s: float | None = None
        self.stream = None
        self.done = False

    def record(self) -> None:
        self.at_s, self.stream = self.device.queued_s, self.device.stream
        self.device.events.append(self)

    def synchronize(self) -> None:
        seen = self.device.events[:self.device.events.index(self) + 1]
        for ev in seen:
            if ev.stream == self.stream:
                ev.done = True

    def elapsed_time(self, end: "FakeEvent") -> float:
        if not (self.done and end.done):
            raise RuntimeError("CUDA error: device not ready (an event was not waited for)")
        return (end.at_s - self.at_s) * 1e3


def test_op_times_wait_for_every_event_pair(monkeypatch):
    """Ops a block runs on a stream of its own: waiting for the last end event does not
    finish them. Before: only that one was synchronized, and reading the others raised."""
    device = FakeDevice()
    monkeypatch.setattr(torch.cuda, "Event", device.event)
    timer = OpTimer("cuda")
    side, main = OpRecord(("side", 0), 0.0), OpRecord(("main", 0), 0.0)
    device.stream = "side"
    start = timer.start()
    device.launch(0.25)
    timer.stop(side, start)
    device.stream = "compute"
    start = timer.start()
    device.launch(0.5)
    timer.stop(main, start)
    timer.resolve()
    assert side.time_s == pytest.approx(0.25) and main.time_s == pytest.approx(0.5)


class _Launch(torch.autograd.Function):
    """Identity that queues device work: `forward_s` in forward, `backward_s` in backward."""

    @staticmethod
    def forward(ctx, x, device, forward_s, backward_s):
        device.launch(forward_s)
        ctx.device, ctx.backward_s = device, backward_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.device.launch(ctx.backward_s)
        return grad, None, None, None


class Net(nn.Module):
    def __init__(self, device: FakeDevice) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.device = device
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(),
                                                  nn.Linear(64, 32)) for _ in range(2))

    def forward(self, x):
        x = _Launch.apply(x, self.device, 2.0, 3.0)  # first in forward: its backward runs last
        for block in self.blocks:
            x = x + block(x)
        return x.pow(2).mean()


@pytest.mark.trials
def test_step_windows_and_trials_are_device_time(nvme_dir, tmp_path, monkeypatch):
    """The profile's forward and backward windows, and a trial step, read the device's
    clock (2 s of forward work, 3 s of backward work launched in microseconds). Before:
    host times, launch time only: a few milliseconds."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(search_mod, "TRIAL_MARGIN", float("inf"))
    device = FakeDevice()

    def device_clock(device_type):
        from offload.util.clock import DeviceClock

        return DeviceClock(device.event)

    monkeypatch.setattr(auto_session, "clock_for", device_clock)
    model = Net(device)
    x = torch.randn(8, 32, requires_grad=True)
    settings = dict(policy="auto", tiers="nvme", nvme_dir=nvme_dir, min_bytes=0, probe=SLOW)
    for _ in range(3):   # warm-up, profile, the plan's first trial step
        with offload.activations(model=model, **settings) as ctx:
            model(x).backward()
    profile = ctx.plan.profile_summary
    assert profile["forward_s"] == pytest.approx(2.0, abs=0.05)
    assert profile["backward_s"] == pytest.approx(3.0, abs=0.05)
    assert ctx.plan.measured["plan"] == [pytest.approx(5.0, abs=0.05)]
