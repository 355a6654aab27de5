"""Processes sharing a host (offload/util/ranks.py, offload/util/logs.py) and `enabled=False`.

- a `%` capacity is divided among LOCAL_WORLD_SIZE processes; a size is per process;
- `ctx.stats` reports the capacities each tier got;
- log lines name their rank, and INFO lines come from OFFLOAD_LOG_RANKS only;
- `offload.activations(enabled=False)` / OFFLOAD_ENABLED=0 install and open nothing.
"""
from __future__ import annotations

import logging

import pytest
import torch

import offload
from offload import config_parse
from offload.util import disk_space, logs
from offload._ext import core_available
from offload.config import Config
from offload.errors import ConfigError
from offload.util.ranks import Ranks
from offload.tiers import nvme_space

GiB = 1 << 30
MiB = 1 << 20


@pytest.fixture
def machine(monkeypatch):
    """Fixed RAM and free disk, so the expected capacities are exact."""
    from offload.util import memory_limits

    # (available, total) RAM, as memory_limits reads it from /proc/meminfo.
    monkeypatch.setattr(memory_limits, "_ram", lambda proc: (40 * GiB, 64 * GiB))
    monkeypatch.setattr(disk_space, "_read_free", lambda path: (1, 1000 * GiB))


def _cfg(tmp_path, **env):
    return Config.from_env(env={"OFFLOAD_NVME_DIR": str(tmp_path), **env})


# ---------------------------------------------------------------- capacities
def test_percentages_are_divided_among_the_local_ranks(machine, tmp_path):
    cfg = _cfg(tmp_path, LOCAL_WORLD_SIZE="8", WORLD_SIZE="16", RANK="9", LOCAL_RANK="1",
               OFFLOAD_HOST_BYTES="40%", OFFLOAD_NVME_BYTES="50%")
    assert cfg.host_capacity_bytes() == int(0.4 * 40 * GiB) // 8
    assert cfg.nvme_capacity_bytes() == 500 * GiB // 8
    # The defaults are percentages too (50 %).
    assert _cfg(tmp_path, LOCAL_WORLD_SIZE="8").host_capacity_bytes() == 20 * GiB // 8


def test_local_ranks_divide_the_total_the_first_one_measured(tmp_path, monkeypatch):
    """With a process group up, the job's store carries the first measurement to every local
    rank, so ranks that resolve later (after others reserved) get the same share."""
    import torch.distributed as dist

    from offload.util import memory_limits

    available = [40 * GiB]
    monkeypatch.setattr(memory_limits, "_ram", lambda proc: (available[0], 64 * GiB))
    cfg = _cfg(tmp_path, LOCAL_WORLD_SIZE="2", OFFLOAD_HOST_BYTES="50%")
    assert cfg.host_capacity_bytes() == 10 * GiB
    available[0] = 30 * GiB
    assert cfg.host_capacity_bytes() == int(7.5 * GiB)  # no process group: what it sees
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0,
                            world_size=1)
    try:
        available[0] = 40 * GiB
        assert cfg.host_capacity_bytes() == 10 * GiB    # publishes 40 GiB
        available[0] = 30 * GiB                          # another rank took 10 GiB since
        assert cfg.host_capacity_bytes() == 10 * GiB    # still half of 50 % of 40 GiB
        available[0] = 12 * GiB                          # the machine filled up meanwhile:
        assert cfg.host_capacity_bytes() == 6 * GiB     # never over 50 % of what is there
    finally:
        dist.destroy_process_group()


def test_a_single_process_takes_the_whole_percentage(machine, tmp_path):
    cfg = _cfg(tmp_path, OFFLOAD_HOST_BYTES="40%", OFFLOAD_NVME_BYTES="50%")
    assert cfg.host_capacity_bytes() == int(0.4 * 40 * GiB)
    assert cfg.nvme_capacity_bytes() == 500 * GiB


def test_sizes_are_per_process(machine, tmp_path):
    cfg = _cfg(tmp_path, LOCAL_WORLD_SIZE="8", OFFLOAD_HOST_BYTES="3GiB",
               OFFLOAD_NVME_BYTES="64GiB")
    assert cfg.host_capacity_bytes() == 3 * GiB
    assert cfg.nvme_capacity_bytes() == 64 * GiB


def test_a_size_over_the_free_space_names_the_processes(machine, tmp_path):
    cfg = _cfg(tmp_path, LOCAL_WORLD_SIZE="8", OFFLOAD_NVME_BYTES="2000GiB")
    with pytest.raises(ConfigError, match=r"OFFLOAD_NVME_BYTES='2000GiB': only 1000 GiB free in "
                       r".*each of the 8 processes of this host takes this size: lower it, or "
                       r"give a percentage, which is divided among them"):
        cfg.nvme_capacity_bytes()


def test_ranks_divide_what_fits_when_striped_over_unequal_file_systems(tmp_path, monkeypatch):
    """NOTE [Striped room] with NOTE [Host share]: 8 ranks striping over a 1000 GiB and a
    100 GiB file system share 50 % of 200 GiB (each slab is half a rank's capacity)."""
    big, small = tmp_path / "big", tmp_path / "small"
    big.mkdir(), small.mkdir()
    free = {str(big): (1, 1000 * GiB), str(small): (2, 100 * GiB)}
    monkeypatch.setattr(disk_space, "_read_free", lambda path: free[path])
    cfg = Config.from_env(env={"OFFLOAD_NVME_DIR": f"{big},{small}", "LOCAL_WORLD_SIZE": "8",
                               "OFFLOAD_NVME_BYTES": "50%"})
    assert cfg.nvme_capacity_bytes() == 100 * GiB // 8
    # The 8 ranks' slabs in the small file system take half of it.
    assert 8 * cfg.nvme_capacity_bytes() // 2 <= 50 * GiB


def test_local_rank_without_local_world_size_warns_once(machine, tmp_path, caplog,
                                                        monkeypatch):
    monkeypatch.setattr(config_parse, "_warned_once", set())
    cfg = _cfg(tmp_path, LOCAL_RANK="3")
    with caplog.at_level(logging.WARNING, logger="offload"):
        assert cfg.host_capacity_bytes() == 20 * GiB  # not divided: unknown how many
        cfg.nvme_capacity_bytes()
    assert caplog.text.count("LOCAL_RANK is set but LOCAL_WORLD_SIZE is not") == 1


@pytest.mark.parametrize("env, message", [
    ({"LOCAL_WORLD_SIZE": "eight"}, r"LOCAL_WORLD_SIZE='eight': not a whole number \(the "
                                    r"launcher sets it"),
    ({"LOCAL_WORLD_SIZE": "0"}, r"LOCAL_WORLD_SIZE='0': must be at least 1"),
    ({"RANK": "-1"}, r"RANK='-1': must be at least 0"),
    ({"LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "4"},
     r"LOCAL_WORLD_SIZE=8 is more than WORLD_SIZE=4"),
])
def test_bad_launcher_variables(env, message):
    with pytest.raises(ConfigError, match=message):
        Config.from_env(env=env)


def test_ranks_from_env():
    assert Ranks.from_env({}) == Ranks(0, 0, 1, 1, False)
    r = Ranks.from_env({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8",
                        "LOCAL_WORLD_SIZE": "4"})
    assert (r.rank, r.local_rank, r.world_size, r.local_world_size) == (5, 1, 8, 4)
    assert r.distributed and r.local_share(100) == 25


def test_with_overrides_keeps_the_ranks(tmp_path):
    cfg = _cfg(tmp_path, LOCAL_WORLD_SIZE="4").with_overrides(host_bytes="10%")
    assert cfg.ranks.local_world_size == 4


@pytest.mark.skipif(not core_available(), reason="offload._C unavailable")
def test_stats_report_each_tiers_capacity(nvme_dir, monkeypatch):
    from offload.util import memory_limits

    # (available, total) RAM, as memory_limits reads it from /proc/meminfo.
    monkeypatch.setattr(memory_limits, "_ram", lambda proc: (40 * GiB, 64 * GiB))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    x = torch.randn(256, 256, requires_grad=True)
    with offload.activations(tiers="host,nvme", nvme_dir=nvme_dir, host_bytes="10%",
                             nvme_bytes="8MiB", min_bytes=0) as ctx:
        (x * 2).sin().sum().backward()
    assert ctx.stats.host_capacity_bytes == int(0.1 * 40 * GiB) // 4
    assert ctx.stats.nvme_capacity_bytes == 8 * MiB
    assert ctx.stats.as_dict()["nvme_capacity_bytes"] == 8 * MiB
    with offload.activations(tiers="host") as ctx:
        (x * 2).sin().sum().backward()
    assert ctx.stats.nvme_capacity_bytes == 0 and ctx.stats.host_capacity_bytes > 0


# ---------------------------------------------------------------- logging
@pytest.fixture
def rank_logs(monkeypatch):
    """A 4-rank job as seen from rank 2; the logger's settings restored afterwards."""
    logger = logging.getLogger("offload")
    level = logger.level
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    yield
    logs.configure(None, (0,))
    logger.setLevel(level)


def _step_lines(caplog, **settings):
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="offload"):
        with offload.activations(tiers="host", log="INFO", **settings):
            (torch.randn(64, 64, requires_grad=True) * 2).sum().backward()
    return [r.getMessage() for r in caplog.records if "saved" in r.getMessage()]


def test_step_line_only_from_rank_0_by_default(rank_logs, caplog):
    assert _step_lines(caplog) == []


def test_step_line_from_the_ranks_asked_for(rank_logs, caplog):
    lines = _step_lines(caplog, log_ranks="all")
    assert len(lines) == 1 and lines[0].startswith("offload [rank 2]: saved ")
    assert len(_step_lines(caplog, log_ranks="1,2")) == 1
    assert _step_lines(caplog, log_ranks="0,3") == []


def test_warnings_come_from_every_rank_with_the_rank(rank_logs, caplog):
    logs.configure(None, (0,))
    with caplog.at_level(logging.INFO, logger="offload"):
        logging.getLogger("offload").warning("offload: disk %s is full", "/x")
        logging.getLogger("offload").info("offload: not from rank 2")
    assert [r.getMessage() for r in caplog.records] == ["offload [rank 2]: disk /x is full"]
    assert caplog.records[0].rank == 2


def test_single_process_lines_are_unchanged(caplog, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("RANK", "3")  # a RANK alone (no job of several) names no rank
    lines = _step_lines(caplog)
    assert len(lines) == 1 and lines[0].startswith("offload: saved ")


@pytest.mark.parametrize("value, message", [
    ("", None), ("first", r"OFFLOAD_LOG_RANKS='first': 'first' is not a rank \(give a rank "
                          r"such as 0, a list such as 0,4, or all\)"),
    ("-1", r"'-1' is not a rank"), (",", r"OFFLOAD_LOG_RANKS=',': names no rank"),
])
def test_log_ranks_errors(value, message):
    if message is None:
        assert Config.from_env(env={"OFFLOAD_LOG_RANKS": value}).log_ranks == (0,)
        return
    with pytest.raises(ConfigError, match=message):
        Config.from_env(env={"OFFLOAD_LOG_RANKS": value})


def test_log_ranks_values():
    assert Config.from_env(env={"OFFLOAD_LOG_RANKS": "ALL"}).log_ranks is None
    assert Config.from_env(env={"OFFLOAD_LOG_RANKS": "4, 0,4"}).log_ranks == (0, 4)
    assert Config.from_env(env={}, log_ranks=3).log_ranks == (3,)


# ---------------------------------------------------------------- enabled=False
def _saved_tensor_hooks():
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


@pytest.mark.parametrize("how", ["argument", "env"])
def test_disabled_installs_nothing(how, monkeypatch):
    # Settings that would fail validation (no NVMe directory) are not checked either.
    monkeypatch.delenv("OFFLOAD_NVME_DIR", raising=False)
    if how == "env":
        monkeypatch.setenv("OFFLOAD_ENABLED", "0")
        ctx = offload.activations(tiers="nvme")
    else:
        ctx = offload.activations(enabled=False, tiers="nvme")
    stores = dict(nvme_space.open_stores())
    x = torch.randn(512, 512, requires_grad=True)
    with ctx as entered:
        assert entered is ctx and ctx.active
        assert _saved_tensor_hooks() is None
        y = (x * 2).sin()
    y.sum().backward()
    assert not ctx.active and ctx.tiers == {}
    assert ctx.stats.as_dict() == offload.Stats().as_dict()
    assert nvme_space.open_stores() == stores
    with ctx:  # reusable, like an enabled context
        pass


@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_disabled_scheduler_policies_wrap_nothing(policy):
    """Without model= `recompute` raises ConfigError (no blocks); disabled, nothing is looked
    for, and a model's blocks run as they are."""
    from offload.bench.models import GPT, GPTConfig

    offload.activations(enabled=False, policy=policy)  # no ConfigError
    model = GPT(GPTConfig(vocab_size=64, hidden=32, layers=2, heads=2, seq_len=16))
    forwards = [type(b).forward for b in model.blocks]
    with offload.activations(enabled=False, policy=policy, model=model) as ctx:
        assert _saved_tensor_hooks() is None
        assert [type(b).forward for b in model.blocks] == forwards
        assert all("forward" not in vars(b) for b in model.blocks)
        model(torch.randint(64, (2, 16))).sum().backward()
    assert ctx.plan is None


def test_enabled_context_does_install_hooks():
    # The check above would pass vacuously if hooks were never visible this way.
    with offload.activations(tiers="host"):
        assert _saved_tensor_hooks() is not None
    assert _saved_tensor_hooks() is None
