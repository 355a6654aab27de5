"""Config: parsing, env vs keyword precedence, every error message, the README table."""
from __future__ import annotations

import os
import re
import tempfile

import pytest
import torch
from mounts import mounted

import offload
from offload.config import Config, env_table_markdown
from offload.errors import ConfigError
from offload.util.sizes import SizeSpec, format_bytes, parse_size

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")


# ---------------------------------------------------------------- sizes
@pytest.mark.parametrize("text, nbytes", [
    ("0", 0), ("4096", 4096), ("8GiB", 8 << 30), ("8 gib", 8 << 30), ("512MiB", 512 << 20),
    ("1.5GiB", 3 << 29), ("2G", 2 << 30), ("1GB", 10**9), ("10kb", 10_000), ("7B", 7),
    (123, 123),
])
def test_parse_size_bytes(text, nbytes):
    assert parse_size(text) == SizeSpec(nbytes=nbytes)


def test_parse_size_percent():
    assert parse_size("30%", allow_percent=True) == SizeSpec(fraction=0.3)
    assert parse_size("30%", allow_percent=True).resolve(1000) == 300
    with pytest.raises(ValueError, match="percentage is not accepted"):
        parse_size("30%")


@pytest.mark.parametrize("text, message", [
    ("-1", "negative"), ("-4GiB", "negative"), (-5, "negative"), ("lots", "not a size"),
    ("4 parsecs", "unknown unit 'parsecs'"), ("1.5", "whole number"), ("", "not a size"),
    ("1e400GB", "'1e400' is too large a number"), ("1e30GB", "more bytes than a 64-bit count"),
])
def test_parse_size_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_size(text)


@pytest.mark.parametrize("name", ["host_bytes", "min_bytes", "nvme_bytes", "prefetch_bytes",
                                  "budget", "nvme_max_bw"])
@pytest.mark.parametrize("value", [2**64, 1e30, float("inf")])
def test_a_keyword_size_past_64_bits_is_refused_naming_it(name, value):
    """A number given as a keyword gets the check a string gets. Before, it passed the
    build: entry raised a bare OverflowError (host_bytes, min_bytes) or the core's
    TypeError (nvme_max_bw), and budget took it silently."""
    with pytest.raises(ConfigError, match=rf"^{name}=.*more bytes than a 64-bit count holds"):
        offload.activations(**{name: value})


def test_a_whole_number_of_bytes_hints_at_a_percentage_only_below_one():
    with pytest.raises(ValueError, match=r'whole number \(a share is a percentage: "50%"\)'):
        parse_size("0.5", allow_percent=True)
    with pytest.raises(ValueError, match=r"whole number$"):   # not "150%"
        parse_size("1.5B", allow_percent=True)


def test_format_bytes():
    assert format_bytes(0) == "0 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 << 30) == "3 GiB"
    assert format_bytes(1023 * 1024 + 1000) == "1024 KiB"


# ---------------------------------------------------------------- from_env
def test_defaults_without_env():
    cfg = Config.from_env(env={})
    assert cfg.tiers == ("host",) and cfg.policy == "offload" and cfg.strict is False
    assert cfg.nvme_dir == () and cfg.budget is None and cfg.log is None
    assert cfg.min_bytes > 0 and cfg.prefetch_bytes > 0 and cfg.staging_bytes > 0


def test_env_is_read_and_keywords_win(tmp_path):
    env = {"OFFLOAD_TIERS": "host,nvme", "OFFLOAD_NVME_DIR": str(tmp_path),
           "OFFLOAD_HOST_BYTES": "1GiB", "OFFLOAD_MIN_BYTES": "0", "OFFLOAD_POLICY": "keep",
           "OFFLOAD_BUDGET": "30%", "OFFLOAD_STRICT": "yes", "OFFLOAD_LOG": "info",
           "OFFLOAD_PREFETCH_BYTES": "64MiB", "OFFLOAD_IO_WORKERS": "2",
           "OFFLOAD_STAGING_BYTES": "32MiB", "OFFLOAD_NVME_BYTES": "2GiB"}
    cfg = Config.from_env(env=env)
    assert cfg.tiers == ("host", "nvme") and cfg.nvme_dir == (str(tmp_path),)
    assert cfg.host_bytes == SizeSpec(nbytes=1 << 30) and cfg.min_bytes == 0
    assert cfg.policy == "keep" and cfg.budget == SizeSpec(fraction=0.3) and cfg.strict
    assert cfg.log == "INFO" and cfg.prefetch_bytes == 64 << 20 and cfg.io_workers == 2
    assert cfg.staging_bytes == 32 << 20 and cfg.nvme_bytes == SizeSpec(nbytes=2 << 30)
    over = Config.from_env(env=env, tiers=["nvme"], min_bytes=4096, strict=False,
                           policy="offload")
    assert over.tiers == ("nvme",) and over.min_bytes == 4096 and over.strict is False
    assert over.policy == "offload" and over.io_workers == 2  # untouched knobs from env
    assert over.sources["tiers"] == "tiers=['nvme']"
    assert over.sources["io_workers"] == "OFFLOAD_IO_WORKERS='2'"


def test_empty_env_value_means_default():
    assert Config.from_env(env={"OFFLOAD_TIERS": " "}).tiers == ("host",)


def test_activations_reads_os_environ(monkeypatch):
    monkeypatch.setenv("OFFLOAD_POLICY", "keep")
    monkeypatch.setenv("OFFLOAD_MIN_BYTES", "1MiB")
    ctx = offload.activations()
    assert ctx.config.policy == "keep" and ctx.config.min_bytes == 1 << 20
    assert offload.activations(policy="offload").config.policy == "offload"


def test_every_change_of_the_environment_between_contexts_is_seen(monkeypatch):
    """The Config of an unchanged environment is reused (config._cache_key compares the
    whole environment with the last scan); any change is read again: a value changed, a
    variable added, a variable removed, a launcher variable."""
    monkeypatch.setenv("OFFLOAD_MIN_BYTES", "1MiB")
    assert offload.activations().config.min_bytes == 1 << 20
    assert offload.activations().config is offload.activations().config   # reused
    monkeypatch.setenv("OFFLOAD_MIN_BYTES", "2MiB")
    assert offload.activations().config.min_bytes == 2 << 20
    monkeypatch.setenv("OFFLOAD_POLICY", "keep")
    assert offload.activations().config.policy == "keep"
    monkeypatch.delenv("OFFLOAD_POLICY")
    assert offload.activations().config.policy == "offload"
    monkeypatch.setenv("OFFLOAD_NVME_DIR", "/x/{rank}")
    monkeypatch.setenv("RANK", "5")
    assert offload.activations().config.nvme_dir == ("/x/5",)
    monkeypatch.setenv("RANK", "6")
    assert offload.activations().config.nvme_dir == ("/x/6",)


@pytest.mark.parametrize("size", ["50%", "1MiB"])
def test_the_nvme_capacity_reads_the_free_space_once(size, tmp_path, monkeypatch):
    """The share and the check against the free space read one measurement."""
    from offload.util import disk_space

    cfg = Config.from_env(env={"OFFLOAD_TIERS": "nvme", "OFFLOAD_NVME_DIR": str(tmp_path),
                               "OFFLOAD_NVME_BYTES": size})
    calls = []
    real = disk_space._read_free
    monkeypatch.setattr(disk_space, "_read_free", lambda path: calls.append(path) or real(path))
    assert cfg.nvme_capacity_bytes() > 0
    assert calls == [str(tmp_path)]


def test_rank_placeholders(tmp_path):
    env = {"OFFLOAD_NVME_DIR": f"{tmp_path}/r{{rank}},{tmp_path}/l{{local_rank}}",
           "RANK": "3", "LOCAL_RANK": "1"}
    assert Config.from_env(env=env).nvme_dir == (f"{tmp_path}/r3", f"{tmp_path}/l1")
    assert Config.from_env(env={"OFFLOAD_NVME_DIR": "/x/{rank}"}).nvme_dir == ("/x/0",)
    # The escape the error message gives for a directory whose name holds a brace.
    assert Config.from_env(env={"OFFLOAD_NVME_DIR": "/x/{{a}}-{rank}"}).nvme_dir == ("/x/{a}-0",)
    # The trace too: every rank of a job writes its own file from one setting.
    env = {"OFFLOAD_TRACE": f"{tmp_path}/step-{{rank}}-{{local_rank}}.json",
           "RANK": "3", "LOCAL_RANK": "1"}
    assert Config.from_env(env=env).trace == f"{tmp_path}/step-3-1.json"
    with pytest.raises(ConfigError, match=r"OFFLOAD_TRACE=.*bad placeholder .*\{rank\}"):
        Config.from_env(env={"OFFLOAD_TRACE": f"{tmp_path}/{{step}}.json"})
    # The ranks as numbers, as the rest of offload reads them. Before, the raw strings: an
    # empty RANK made "/x/" (the parent directory, shared by every rank), " 1" "/x/ 1".
    for raw, want in (("", "/x/0"), (" 1", "/x/1"), ("007", "/x/7")):
        env = {"OFFLOAD_NVME_DIR": "/x/{rank}", "RANK": raw}
        assert Config.from_env(env=env).nvme_dir == (want,), raw
    with pytest.raises(ConfigError, match="RANK='two': not a whole number"):
        Config.from_env(env={"OFFLOAD_NVME_DIR": "/x/{rank}", "RANK": "two"})


def test_with_overrides():
    cfg = Config.from_env(env={"OFFLOAD_MIN_BYTES": "1KiB"}).with_overrides(tiers="nvme")
    assert cfg.tiers == ("nvme",) and cfg.min_bytes == 1024


# ---------------------------------------------------------------- errors (each message)
@pytest.mark.parametrize("env, message", [
    ({"OFFLOAD_TIERS": "host,ssd"},
     r"OFFLOAD_TIERS='host,ssd': unknown tier 'ssd' \(valid tiers, fastest first: host, nvme\)"),
    ({"OFFLOAD_TIERS": "hots"}, r"unknown tier 'hots' \(did you mean 'host'\?"),
    ({"OFFLOAD_TIERS": "host,host"}, r"OFFLOAD_TIERS='host,host': names a tier twice"),
    ({"OFFLOAD_TIERS": ","}, r"OFFLOAD_TIERS=',': names no tier \(.*OFFLOAD_ENABLED=0 turns "
     r"offloading off\)$"),
    ({"OFFLOAD_NVME_MAX_BW": "fast"}, r"OFFLOAD_NVME_MAX_BW='fast': not a size \(give bytes "
     r"per second such as \"200MB\" or \"1GiB\"; 0 means no cap\)$"),
    ({"OFFLOAD_HOST_BYTES": "lots"}, r"OFFLOAD_HOST_BYTES='lots': not a size \(examples: "
                                     r"\"8GiB\", \"512MiB\", \"4096\", \"30%\"\)$"),
    ({"OFFLOAD_HOST_BYTES": "-1GiB"}, r"OFFLOAD_HOST_BYTES='-1GiB': size must not be negative"),
    ({"OFFLOAD_NVME_BYTES": "12 bananas"}, r"OFFLOAD_NVME_BYTES='12 bananas': unknown unit"),
    ({"OFFLOAD_MIN_BYTES": "-5"}, r"OFFLOAD_MIN_BYTES='-5': size must not be negative"),
    ({"OFFLOAD_MIN_BYTES": "5%"}, r"OFFLOAD_MIN_BYTES='5%': a percentage is not accepted"),
    ({"OFFLOAD_BUDGET": "150%"},
     r"OFFLOAD_BUDGET='150%': 150% is over 100% \(give at most 100% of the activation "
     r"bytes the profiled step saves"),
    ({"OFFLOAD_BUDGET": "-3GiB"}, r"OFFLOAD_BUDGET='-3GiB': size must not be negative"),
    ({"OFFLOAD_POLICY": "ofload"},
     r"OFFLOAD_POLICY='ofload': unknown policy 'ofload' \(did you mean 'offload'\? valid "
     r"policies: keep, offload, recompute, auto\)"),
    ({"OFFLOAD_POLICY": "kep"}, r"did you mean 'keep'\?"),
    ({"OFFLOAD_STRICT": "maybe"}, r"OFFLOAD_STRICT='maybe': not a boolean \(use 1/0"),
    ({"OFFLOAD_CPU_HEAP": "relase"},
     r"OFFLOAD_CPU_HEAP='relase': unknown mode 'relase' \(did you mean 'release'\? valid "
     r"modes: reuse, release\)"),
    ({"OFFLOAD_LOG": "LOUD"}, r"OFFLOAD_LOG='LOUD': unknown log level 'LOUD'"),
    ({"OFFLOAD_IO_WORKERS": "0"}, r"OFFLOAD_IO_WORKERS='0': must be at least 1"),
    ({"OFFLOAD_IO_WORKERS": "four"}, r"OFFLOAD_IO_WORKERS='four': not a whole number"),
    ({"OFFLOAD_PREFETCH_BYTES": "x"}, r"OFFLOAD_PREFETCH_BYTES='x': not a size"),
    ({"OFFLOAD_STAGING_BYTES": "-1"}, r"OFFLOAD_STAGING_BYTES='-1': size must not be negative"),
    ({"OFFLOAD_NVME_DIR": "/tmp/{node}"}, r"OFFLOAD_NVME_DIR='/tmp/\{node\}': bad placeholder .*"
     r"write a literal brace twice"),
    ({"OFFLOAD_NVME_BYTES": "0"}, r"OFFLOAD_NVME_BYTES='0': leaves the tier no room \(give a "
     r"size such as \"64GiB\" or \"50%\", or drop 'nvme' from OFFLOAD_TIERS\)"),
    ({"OFFLOAD_NVME_BYTES": "0%"}, r"OFFLOAD_NVME_BYTES='0%': leaves the tier no room"),
    ({"OFFLOAD_HOST_BYTES": "0"}, r"OFFLOAD_HOST_BYTES='0': leaves the tier no room .*drop "
     r"'host' from OFFLOAD_TIERS"),
    ({"OFFLOAD_HOST_BYTES": "150%"}, r"OFFLOAD_HOST_BYTES='150%': 150% is over 100% \(give at "
     r"most 100% of the available RAM"),
    ({"OFFLOAD_NVME_BYTES": "101%"}, r"OFFLOAD_NVME_BYTES='101%': 101% is over 100% \(give at "
     r"most 100% of the free disk space"),
    ({"OFFLOAD_IO_WORKERS": "100000"}, r"OFFLOAD_IO_WORKERS='100000': is more than the "
     r"engine's 1024 threads \(4 to 16 threads"),
    # Unicode digits int() refuses (was: a bare ValueError from int())
    ({"OFFLOAD_LOG_RANKS": "\u00b2"}, r"OFFLOAD_LOG_RANKS='\u00b2': '\u00b2' is not a rank"),
    ({"OFFLOAD_LOG_RANKS": "0,\u2460"}, r"'\u2460' is not a rank \(give a rank such as 0"),
    # The wrong separator (was: "did you mean 'nvme'?")
    ({"OFFLOAD_TIERS": "host;nvme"}, r"unknown tier 'host;nvme' \(separate tiers with commas"),
    ({"OFFLOAD_TIERS": "host nvme"}, r"unknown tier 'host nvme' \(separate tiers with commas"),
])
def test_env_errors_name_variable_value_and_fix(env, message):
    with pytest.raises(ConfigError, match=message):
        Config.from_env(env=env)


def test_keyword_errors_name_the_argument():
    with pytest.raises(ConfigError, match=r"tiers='gpu': unknown tier 'gpu'"):
        Config.from_env(env={}, tiers="gpu")
    with pytest.raises(ConfigError, match=r"unknown argument 'tier' \(did you mean 'tiers'\?\)"
                       r".*, model, blocks \(a variable's name in lower case without "
                       r"OFFLOAD_\)"):
        offload.activations(tier="host")
    # A variable's name given as a keyword (was: no hint).
    with pytest.raises(ConfigError, match=r"unknown argument 'OFFLOAD_TIERS' \(did you mean "
                       r"'tiers'\?\)"):
        offload.activations(OFFLOAD_TIERS="nvme")
    with pytest.raises(ConfigError, match=r"min_bytes=-1: size must not be negative"):
        Config.from_env(env={}, min_bytes=-1)
    with pytest.raises(ConfigError, match=r"strict='sure': not a boolean"):
        Config.from_env(env={}, strict="sure")
    # An empty keyword is no answer (was: enabled="" turned offload off, while an empty
    # OFFLOAD_ENABLED counts as unset and leaves it on).
    with pytest.raises(ConfigError, match=r"enabled='': not a boolean"):
        Config.from_env(env={}, enabled="")
    assert Config.from_env(env={"OFFLOAD_ENABLED": " "}).enabled is True


@pytest.mark.parametrize("kw, message", [
    # a keyword of a type the parser does not take (were: bare TypeErrors)
    ({"log_ranks": True}, r"log_ranks=True: True is not a list \(give a rank such as 0"),
    ({"log_ranks": 1.5}, r"log_ranks=1.5: 1.5 is not a list"),
    ({"tiers": 5}, r"tiers=5: 5 is not a list \(give 'host', 'nvme' or 'host,nvme'"),
    # a fraction as a keyword gets the percentage hint its string gets
    ({"budget": 0.3}, r'budget=0.3: .*whole number \(a share is a percentage: "30%"\)'),
    ({"host_bytes": 0.5}, r'host_bytes=0.5: .*\(a share is a percentage: "50%"\)'),
])
def test_keyword_values_of_another_type_name_the_argument(kw, message):
    with pytest.raises(ConfigError, match=message):
        Config.from_env(env={}, **kw)


def test_list_settings_take_any_iterable_and_a_numpy_integer():
    """A review's find: the check that made `tiers=5` a ConfigError refused every iterable
    but a list, tuple or set, where before a range, a numpy array or dict keys worked."""
    import numpy as np

    assert Config.from_env(env={}, log_ranks=range(3)).log_ranks == (0, 1, 2)
    assert Config.from_env(env={}, log_ranks=np.arange(2)).log_ranks == (0, 1)
    assert Config.from_env(env={}, log_ranks=np.int64(4)).log_ranks == (4,)
    assert Config.from_env(env={}, tiers=np.array(["host"])).tiers == ("host",)
    assert Config.from_env(env={}, tiers={"host": 1}.keys()).tiers == ("host",)
    with pytest.raises(ConfigError, match=r"tiers=b'host': b'host' is not a list"):
        Config.from_env(env={}, tiers=b"host")


def test_a_value_no_parser_foresaw_is_still_a_config_error(monkeypatch):
    """Config.from_env turns any TypeError / ValueError of a parser into a ConfigError
    naming the setting and what it takes (a parser's own check is better; this is the
    net under them)."""
    from offload import config as config_mod

    def broken(raw, where, env):
        return int(raw)

    monkeypatch.setitem(config_mod.PARSERS, "io_workers", broken)
    with pytest.raises(ConfigError, match=r"OFFLOAD_IO_WORKERS='x': not a valid value "
                       r"\(invalid literal .*; give a .*, e.g. '\d+'\)"):
        Config.from_env(env={"OFFLOAD_IO_WORKERS": "x"})


def test_a_model_passed_positionally_is_told_to_go_by_name():
    """A helper's find: `offload.activations(model)`, the natural first try, raised
    "activations() takes 0 positional arguments but 1 was given"."""
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"keyword arguments only; it was given a model as "
                       r"a positional argument \(pass model=model"):
        offload.activations(model)
    with pytest.raises(ConfigError, match=r"it was given a str as a positional argument"):
        offload.activations("host")


def test_budget_over_100_percent_keyword():
    with pytest.raises(ConfigError, match=r"budget='200%': 200% is over 100%"):
        offload.activations(budget="200%")


def test_recompute_without_blocks_says_what_to_pass():
    with pytest.raises(ConfigError, match=r"policy='recompute': found no blocks to checkpoint: "
                       r"pass model= .*, or blocks="):
        offload.activations(policy="recompute")
    with pytest.raises(ConfigError, match=r"found no blocks to checkpoint in the model .*\); "
                       r"pass blocks=\[") as said:   # not "pass model=": it was passed
        offload.activations(policy="recompute", model=torch.nn.Linear(2, 2))
    assert "model=" not in str(said.value).split(";")[-1]
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match=r"blocks=<predicate> matched no module of model= "
                       r"\(it is called with every submodule"):
        offload.activations(policy="recompute", model=model, blocks=lambda m: False)
    with pytest.raises(ConfigError, match=r"blocks= is empty"):
        offload.activations(policy="recompute", model=model, blocks=[])


class _OneLayerStack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(4, 4)
        self.layers = torch.nn.ModuleList([torch.nn.TransformerEncoderLayer(4, 1)])
        self.head = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 2)))


def test_recompute_on_a_one_layer_stack_names_it_and_the_blocks_to_pass():
    """A one-layer debug config of a transformer: its ModuleList of one layer is not a
    stack (two or more). The message said blocks are "the members of an nn.ModuleList of
    one layer class", which the model has; it now names the stack and the predicate."""
    with pytest.raises(ConfigError) as said:
        offload.activations(policy="recompute", model=_OneLayerStack())
    assert str(said.value).endswith(
        "(blocks are the members of an nn.ModuleList / nn.Sequential of two or more layers "
        "of one class); model.layers holds one TransformerEncoderLayer only (a stack counts "
        "from two layers): pass blocks=lambda m: isinstance(m, TransformerEncoderLayer)"), \
        said.value
    model = _OneLayerStack()
    ctx = offload.activations(policy="recompute", model=model,
                              blocks=lambda m: isinstance(m, torch.nn.TransformerEncoderLayer))
    ctx.close()


def test_nvme_dir_missing(tmp_path, monkeypatch):
    monkeypatch.delenv("OFFLOAD_NVME_DIR", raising=False)
    # The fix names knobs the way the user set them: keywords, or environment variables.
    with pytest.raises(ConfigError, match=r"nvme_dir= is not given \(nor OFFLOAD_NVME_DIR "
                       r"set\) but tiers='nvme' includes 'nvme' \(pass nvme_dir= a writable "
                       r"directory on a local SSD, or drop 'nvme' from tiers=\)"):
        offload.activations(tiers="nvme")
    monkeypatch.setenv("OFFLOAD_TIERS", "nvme")
    with pytest.raises(ConfigError, match=r"OFFLOAD_NVME_DIR is not set but OFFLOAD_TIERS="
                       r"'nvme' includes 'nvme' \(set OFFLOAD_NVME_DIR to a writable directory "
                       r"on a local SSD, or drop 'nvme' from OFFLOAD_TIERS\)"):
        offload.activations()
    monkeypatch.delenv("OFFLOAD_TIERS")
    gone = tmp_path / "gone"
    with pytest.raises(ConfigError, match=rf"nvme_dir='{gone}': '{gone}' does not exist "
                       r"\(point it at a writable directory on a local SSD, or drop 'nvme' "
                       r"from tiers=\)"):
        offload.activations(tiers="nvme", nvme_dir=str(gone))
    assert not gone.exists()  # validation created nothing
    with pytest.raises(ConfigError, match=r"host_bytes=0: leaves the tier no room \(.*, or "
                       r"drop 'host' from tiers=\)"):
        offload.activations(host_bytes=0)
    monkeypatch.setenv("OFFLOAD_HOST_BYTES", "0")
    with pytest.raises(ConfigError, match=r"OFFLOAD_HOST_BYTES='0': leaves the tier no room "
                       r"\(.*, or drop 'host' from OFFLOAD_TIERS\)"):
        offload.activations()


def test_nvme_dir_as_a_path_object_and_listed_twice(tmp_path):
    """A pathlib.Path is one directory (was: TypeError, not iterable); one directory listed
    twice, however spelled, is refused when the context is built (was: a ValueError of the
    store at entry, not naming the setting)."""
    ctx = offload.activations(tiers="nvme", nvme_dir=tmp_path, nvme_bytes="64MiB")
    assert ctx.config.nvme_dir == (str(tmp_path),)
    for twice in (f"{tmp_path},{tmp_path}/", f"{tmp_path},{tmp_path}/../{tmp_path.name}"):
        with pytest.raises(ConfigError, match=r"nvme_dir=.*is the directory .* again "
                           r"\(list each directory once\)"):
            offload.activations(tiers="nvme", nvme_dir=twice)
    with pytest.raises(ConfigError, match=r"OFFLOAD_NVME_DIR=.*is the directory .* again"):
        Config.from_env(env={"OFFLOAD_TIERS": "nvme",
                             "OFFLOAD_NVME_DIR": f"{tmp_path},{tmp_path}"})
    with pytest.raises(ConfigError, match=r"nvme_dir=3: 3 is not a path \(give a path"):
        offload.activations(tiers="nvme", nvme_dir=3)


def test_trace_must_be_a_path(tmp_path):
    """Was: a TypeError from os.fspath, naming no setting."""
    for wrong in (123, b"/tmp/step.json"):
        with pytest.raises(ConfigError, match=r"trace=.*is not a path \(give a file path"):
            offload.activations(trace=wrong)
    assert offload.activations(trace=tmp_path / "t.json").config.trace == str(tmp_path / "t.json")


@pytest.mark.parametrize("path", ["/proc/step.json", "/sys/kernel/step.json"])
def test_a_trace_on_a_virtual_file_system_is_refused_at_construction(path):
    """Was: accepted when built as root (os.access passes there), then a warning at every
    step's end that the trace could not be written."""
    with pytest.raises(ConfigError, match=r"trace=.*is on (proc|sysfs), a virtual file system "
                                          r"where no file can be made \(point it at a file"):
        offload.activations(trace=path)


def test_blocks_must_be_modules_of_the_model():
    """Was: accepted, then nothing recomputed, said only by a log line at INFO."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match=r"blocks\[1\] \(Linear\) is not a module of "
                       r"model= \(pass the model's own block modules\)"):
        offload.activations(model=model, policy="recompute",
                            blocks=[model[0], torch.nn.Linear(2, 2)])
    offload.activations(model=model, policy="recompute", blocks=[model[0], model[1]])


def test_a_share_written_as_a_fraction_is_told_to_be_a_percentage():
    """Was "a size in bytes must be a whole number (give a size such as ...)": the fix
    once, and the one meant."""
    with pytest.raises(ConfigError) as exc:
        offload.activations(policy="auto", budget="0.3")
    assert str(exc.value) == ("budget='0.3': a size in bytes must be a whole number (a share "
                              'is a percentage: "30%")')


@pytest.mark.parametrize("tiers, said", [("nvme", True), ("host", False)])
def test_prefetch_over_staging_is_said_once_on_the_nvme_tier(tiers, said, tmp_path, caplog,
                                                             monkeypatch):
    """Was accepted without a word, though read-ahead beyond the arena lands in buffers
    allocated per read (README: keep it below OFFLOAD_STAGING_BYTES)."""
    import logging
    from offload import config as config_mod
    monkeypatch.setenv("OFFLOAD_PREFETCH_BYTES", "512MiB")
    monkeypatch.setenv("OFFLOAD_STAGING_BYTES", "1MiB")
    config_mod.forget_warnings()
    with caplog.at_level(logging.WARNING, logger="offload"):
        for _ in range(2):
            offload.activations(tiers=tiers, nvme_dir=str(tmp_path)).close()
    got = [r.getMessage() for r in caplog.records if "staging arena" in r.getMessage()]
    assert got == ([
        "offload: OFFLOAD_PREFETCH_BYTES='512MiB' is more than OFFLOAD_STAGING_BYTES='1MiB': "
        "read-ahead beyond the staging arena lands in buffers allocated per read (more "
        "allocations and RSS); lower the first or raise the second"] if said else [])


def test_a_budget_outside_auto_is_said_once(caplog):
    import logging
    from offload import config as config_mod
    config_mod.forget_warnings()
    with caplog.at_level(logging.WARNING, logger="offload"):
        offload.activations(policy="offload", budget="30%")
        offload.activations(policy="offload", budget="30%")
        offload.activations(policy="auto", budget="30%")
    said = [r.getMessage() for r in caplog.records if "budget" in r.getMessage()]
    assert said == ["offload: budget='30%' applies to policy='auto' only; under "
                    "policy='offload' it is not used"]


def test_log_error_quiets_the_warnings_of_the_checks_at_build(caplog):
    """OFFLOAD_LOG applies when the context is built, before its checks warn: it was set at
    the first entry, so `log="ERROR"` let the build's warnings through."""
    import logging
    from offload import config as config_mod
    logger = logging.getLogger("offload")
    old = logger.level
    try:
        for level, said in (("ERROR", False), ("WARNING", True)):
            config_mod.forget_warnings()
            caplog.clear()
            with caplog.at_level(logging.NOTSET, logger="offload"):
                logger.setLevel(logging.NOTSET)   # as an application that set none leaves it
                offload.activations(policy="offload", budget="30%", log=level)
                assert logger.level == getattr(logging, level)
            assert any("applies to policy='auto' only" in r.getMessage()
                       for r in caplog.records) is said, level
        logger.setLevel(logging.NOTSET)
        offload.activations(enabled=False, log="DEBUG")   # does nothing at all, as entered
        assert logger.level == logging.NOTSET
    finally:
        logger.setLevel(old)


def test_an_nvme_dir_in_ram_is_said_once_and_a_disk_one_is_not(nvme_dir, caplog):
    """A tmpfs directory (/dev/shm) passes every check, and the store then reserved half of
    its free space in RAM without a word: 12 GB of RAM on the dev VM for a 1 MiB step."""
    import logging
    from offload import config as config_mod
    config_mod.forget_warnings()
    with mounted("tmpfs") as ram, caplog.at_level(logging.WARNING, logger="offload"):
        for _ in range(2):
            offload.activations(tiers="nvme", nvme_dir=ram, nvme_bytes="4MiB")
        offload.activations(tiers="nvme", nvme_dir=nvme_dir)
    said = [r.getMessage() for r in caplog.records if "whose files are RAM" in r.getMessage()]
    assert said == [f"offload: nvme_dir={ram!r}: {ram!r} is on tmpfs, whose files are RAM: "
                    "the nvme tier reserves its capacity (4 MiB) there in host memory, and "
                    "nothing it writes leaves RAM (fine for a test; for training point it at "
                    "a directory on a local SSD)"]


def test_an_nvme_dir_under_dev_is_said_to_be_in_ram(caplog):
    """/dev is devtmpfs, RAM as tmpfs is: the store's reservation landed in shared memory
    with no warning, and offload-bench counted it as on disk (its memory figures unmarked)."""
    import logging
    from offload import config as config_mod
    from offload.util.disk_space import fs_type
    if fs_type("/dev") != "devtmpfs" or not os.access("/dev", os.W_OK):
        pytest.skip("/dev is not a writable devtmpfs here")
    config_mod.forget_warnings()
    where = tempfile.mkdtemp(prefix="offload-test-", dir="/dev")
    try:
        with caplog.at_level(logging.WARNING, logger="offload"):
            offload.activations(tiers="nvme", nvme_dir=where, nvme_bytes="4MiB")
    finally:
        os.rmdir(where)
    assert f"{where!r} is on devtmpfs, whose files are RAM" in caplog.text, caplog.text


@pytest.mark.parametrize("name", ["données", "two words", "back\\slash",
                                  os.fsdecode(b"not-utf-8-\xff")])
def test_a_ram_nvme_dir_is_seen_whatever_its_mount_point_is_called(name, nvme_dir):
    # /proc/self/mountinfo writes blanks and backslashes as octal escapes and the rest as
    # the path's bytes: "données" was read as Latin-1, so its tmpfs went unseen (no
    # warning); a name that is not UTF-8 anywhere on the machine made every nvme context
    # raise UnicodeDecodeError (review).
    from offload.util.disk_space import fs_type
    with mounted("tmpfs", name=name) as ram:
        assert fs_type(ram) == "tmpfs"
        assert fs_type(os.path.join(ram, "sub")) == "tmpfs"
        x = torch.randn(256, 256, requires_grad=True)
        with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0) as ctx:
            (x * 2).tanh().sum().backward()
        assert ctx.stats.nvme_bytes > 0
    assert fs_type(ram) != "tmpfs"


def test_model_must_be_a_module():
    with pytest.raises(ConfigError, match=r"model='gpt2': not a torch.nn.Module \(pass the "
                       r"model object"):
        offload.activations(model="gpt2")
    # A state dict (a common slip) is named by its type, not printed tensor by tensor.
    state = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]).state_dict()
    with pytest.raises(ConfigError) as err:
        offload.activations(model=state)
    assert str(err.value).startswith("model=<OrderedDict of 8>: not a torch.nn.Module")
    assert len(str(err.value)) < 300, str(err.value)


def test_bad_argument_values_are_shown_short():
    layers = [torch.nn.Linear(256, 256) for _ in range(3)]
    with pytest.raises(ConfigError, match=r"^host_bytes=<list of 3>: "):
        offload.activations(host_bytes=layers)
    with pytest.raises(ConfigError, match=r"blocks=<dict of 2>\): expected a list"):
        with offload.activations(policy="recompute", blocks={"a": 1, "b": torch.zeros(40, 40)}):
            pass
    long_dir = "/no/such/" + "d" * 300   # a string is shown whole, however long
    with pytest.raises(ConfigError, match=f"nvme_dir='{long_dir}'"):
        with offload.activations(tiers="nvme", nvme_dir=long_dir):
            pass


def test_nvme_dir_not_a_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match=rf"OFFLOAD_NVME_DIR='{f}': '{f}' is not a directory"):
        Config.from_env(env={"OFFLOAD_TIERS": "nvme", "OFFLOAD_NVME_DIR": str(f)}).validate()


def test_nvme_dir_on_read_only_filesystem():
    # A read-only mount refuses writes even to root (chmod would not: CI runs as root).
    with mounted("tmpfs", "ro", size_bytes=1 << 20) as ro:
        with pytest.raises(ConfigError, match=rf"'{ro}' is on a read-only file system"):
            offload.activations(tiers="nvme", nvme_dir=ro)


def test_nvme_dir_not_writable():
    """Root may write anywhere, so as root the check runs in a child that drops to "nobody"
    (CI runs as root)."""
    import subprocess
    import sys
    import tempfile
    import textwrap

    with tempfile.TemporaryDirectory(dir="/var/tmp") as work:
        os.chmod(work, 0o755)
        locked = os.path.join(work, "locked")
        os.mkdir(locked, 0o500)
        script = textwrap.dedent(f"""
            import os
            import offload
            if os.geteuid() == 0:
                os.setgid(65534); os.setuid(65534)
            try:
                offload.activations(tiers="host,nvme", nvme_dir={locked!r})
            except offload.ConfigError as e:
                print("ConfigError:", e)
        """)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=60, env={**os.environ, "OFFLOAD_LOG": "ERROR"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(f"ConfigError: nvme_dir='{locked}': '{locked}' is not "
                                 "writable by this process (point it at a writable directory")


@pytest.mark.parametrize("name", ["OFFLOAD_STAGING_BYTES", "OFFLOAD_PREFETCH_BYTES"])
def test_host_memory_sizes_beyond_ram_fail_at_construction(name, monkeypatch):
    monkeypatch.setenv(name, "1e15")
    with pytest.raises(ConfigError, match=name + r"='1e15': more than this machine's RAM "
                       r"\(.*\); (the staging arena|what is read ahead) lives in host "
                       r"memory \(give a size such as"):
        offload.activations()


NO_SIZE = ("is on a file system that reports no size (ramfs, which keeps files in RAM, or a "
           "virtual one such as /proc or /sys); the nvme tier needs a disk-backed directory "
           "(point it at a writable directory on a local SSD")


@pytest.mark.parametrize("path", ["/proc", "/sys"])
def test_nvme_dir_without_disk_space_fails_at_construction(path):
    with pytest.raises(ConfigError, match=re.escape(f"nvme_dir='{path}': '{path}' {NO_SIZE}")):
        offload.activations(tiers="nvme", nvme_dir=path)


def test_nvme_dir_on_ramfs_fails_at_construction():
    with mounted("ramfs") as ram:
        with pytest.raises(ConfigError, match=re.escape(f"nvme_dir='{ram}': '{ram}' {NO_SIZE}")):
            offload.activations(tiers="nvme", nvme_dir=ram, nvme_bytes="16MiB")


def test_unknown_offload_variable_warns_once_naming_the_closest(monkeypatch, caplog):
    import logging

    from offload import config as config_module

    config_module._warned_unknown.discard("OFFLOAD_TIRES")
    monkeypatch.setenv("OFFLOAD_TIRES", "nvme")
    monkeypatch.setenv("OFFLOAD_BUILD_CUDA", "0")       # read by the build: no warning
    with caplog.at_level(logging.WARNING, logger="offload"):
        offload.activations()
        offload.activations()
    warned = [r.getMessage() for r in caplog.records if "OFFLOAD_" in r.getMessage()]
    assert warned == ["offload: OFFLOAD_TIRES='nvme' is not a variable offload knows, so it "
                      "has no effect (did you mean OFFLOAD_TIERS?)"]


def test_nvme_dirs_are_not_checked_when_unused(tmp_path):
    # A dir that does not exist is fine while no tier needs it.
    offload.activations(tiers="host", nvme_dir=str(tmp_path / "nope"))
    offload.activations(tiers="nvme", policy="keep", nvme_dir=str(tmp_path / "nope"))


def test_nvme_bytes_over_free_space(tmp_path):
    cfg = Config.from_env(env={}, tiers="nvme", nvme_dir=str(tmp_path), nvme_bytes="1000TiB")
    with pytest.raises(ConfigError, match=r"nvme_bytes='1000TiB': only .* free in .*"
                       r"\(lower it, or give a percentage"):
        cfg.nvme_capacity_bytes()
    assert Config.from_env(env={}, nvme_dir=str(tmp_path), nvme_bytes="1%").nvme_capacity_bytes() > 0


# ---------------------------------------------------------------- striped directories
MiB, GiB = 1 << 20, 1 << 30


@pytest.fixture
def two_disks(tmp_path, monkeypatch):
    """Two directories on (seemingly) different file systems: 1000 MiB and 64 MiB free."""
    from offload.util import disk_space

    big, small = str(tmp_path / "big"), str(tmp_path / "small")
    os.mkdir(big), os.mkdir(small)
    free = {big: (1, 1000 * MiB), small: (2, 64 * MiB)}
    monkeypatch.setattr(disk_space, "_read_free", lambda path: free[path])
    return big, small


@pytest.mark.parametrize("order", [0, 1])
def test_a_percentage_striped_over_unequal_file_systems_fits_the_smallest(two_disks, order):
    """NOTE [Striped room]: each directory gets half; 50 % of what fits is 64 MiB (32 MiB in
    the small one), not 50 % of the summed 1064 MiB (266 MiB in a 64 MiB file system)."""
    dirs = ",".join(two_disks if order == 0 else reversed(two_disks))
    assert Config.from_env(env={}, nvme_dir=dirs).nvme_capacity_bytes() == 64 * MiB
    assert Config.from_env(env={}, nvme_dir=dirs, nvme_bytes="100%").nvme_capacity_bytes() \
        == 128 * MiB


def test_directories_sharing_a_file_system_count_together(tmp_path, monkeypatch):
    """Three directories, two on one file system: that one holds 2/3 of the capacity."""
    from offload.util import disk_space

    dirs = [str(tmp_path / name) for name in ("a1", "a2", "b")]
    for path in dirs:
        os.mkdir(path)
    monkeypatch.setattr(disk_space, "_read_free",
                        lambda path: (1, 100 * GiB) if "/a" in path else (2, 100 * GiB))
    cfg = Config.from_env(env={}, nvme_dir=",".join(dirs))
    assert cfg.nvme_capacity_bytes() == 75 * GiB   # 50 % of 100 GiB * 3 / 2
    with pytest.raises(ConfigError, match=r"only 100 GiB free in '.*/a1' and '.*/a2', whose "
                       r"share would be 100 GiB: .* so at most 150 GiB fits"):
        cfg.with_overrides(nvme_bytes="150.1GiB").nvme_capacity_bytes()


def test_a_size_too_large_for_one_striped_directory_fails_at_build(two_disks):
    big, small = two_disks
    dirs = f"{big},{small}"
    with pytest.raises(ConfigError, match=re.escape(
            f"nvme_bytes='200MiB': only 64 MiB free in '{small}', whose share would be 100 MiB: "
            f"the store puts an equal share in each of the 2 directories of nvme_dir='{dirs}', "
            "so at most 128 MiB fits (lower it, or give a percentage such as '50%'; or free "
            "space there, or leave that directory out)")):
        offload.activations(tiers="nvme", nvme_dir=dirs, nvme_bytes="200MiB")
    offload.activations(tiers="nvme", nvme_dir=dirs, nvme_bytes="128MiB")


@pytest.fixture
def small_tmpfs():
    """A 64 MiB tmpfs (skipped where mounting is refused), with no store of it left open."""
    offload.empty_cache()
    with mounted("tmpfs", size_bytes=64 * MiB) as point:
        try:
            yield point
        finally:
            offload.empty_cache()   # a slab left open would keep the mount busy


def test_striping_over_a_real_small_file_system(small_tmpfs, nvme_dir):
    """The default 50 % opens and runs over a large disk and a 64 MiB tmpfs (was: ENOSPC at
    entry); a size the tmpfs cannot hold its share of is refused at build, naming it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
    x = torch.randn(64, 32)
    model(x).pow(2).mean().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    dirs = f"{nvme_dir},{small_tmpfs}"
    with offload.activations(tiers="nvme", nvme_dir=dirs, min_bytes=0) as ctx:
        model(x).pow(2).mean().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected))
    assert ctx.stats.nvme_bytes > 0
    assert 0 < ctx.stats.nvme_capacity_bytes <= 64 * MiB   # half of it in the tmpfs
    with pytest.raises(ConfigError, match=rf"nvme_bytes='200MiB': only .* free in "
                       rf"'{small_tmpfs}', whose share would be 100 MiB"):
        offload.activations(tiers="nvme", nvme_dir=dirs, nvme_bytes="200MiB")


def test_a_size_is_checked_with_the_processes_own_idle_slabs_counted_free(small_tmpfs):
    """The store kept open after a step holds 48 MiB of the 64 MiB: building the next
    step's context must not count that against the same size."""
    x = torch.randn(64, 64, requires_grad=True)
    for _ in range(2):
        ctx = offload.activations(tiers="nvme", nvme_dir=small_tmpfs, nvme_bytes="48MiB",
                                  min_bytes=0)
        with ctx:
            (x @ x).sum().backward()
        assert ctx.stats.nvme_capacity_bytes == 48 * MiB


def test_log_level_applies(monkeypatch):
    import logging

    logger = logging.getLogger("offload")
    old = logger.level
    try:
        Config.from_env(env={}, log="debug").apply_log_level()
        assert logger.level == logging.DEBUG
    finally:
        logger.setLevel(old)


# ---------------------------------------------------------------- README table
def test_env_table_lists_every_knob():
    table = env_table_markdown()
    from dataclasses import fields

    # Every field is a setting with an env var, except where values came from and the
    # launcher's rank variables (not ours: offload/util/ranks.py).
    knobs = [f for f in fields(Config) if f.name not in ("sources", "ranks")]
    for f in knobs:
        assert f"`{f.metadata['env']}`" in table
        assert f.metadata["doc"] and f.metadata["example"]
    assert table.count("\n") == len(knobs) + 2


def test_readme_names_the_other_variables():
    from offload.config import OTHER_VARIABLES

    text = open(README, encoding="utf-8").read()
    for name in OTHER_VARIABLES:
        assert f"`{name}" in text, f"README.md does not say what {name} does"


def test_readme_env_table_matches_config():
    text = open(README, encoding="utf-8").read()
    m = re.search(r"<!-- env-table:start -->\n(.*?)<!-- env-table:end -->", text, re.S)
    assert m is not None, "README.md lost its <!-- env-table:start/end --> markers"
    assert m.group(1).strip() == env_table_markdown().strip(), (
        "README env table is stale; paste offload.env_table_markdown() between the markers")


@pytest.mark.parametrize("size", ["1", "512KiB", "1048575"])
def test_an_nvme_size_under_the_smallest_store_is_refused_when_built(size, tmp_path):
    """Below 1 MiB per directory the store cannot open: said when the context is built,
    as "0" is, not as a warning at the first save and every tensor kept."""
    with pytest.raises(ConfigError, match=rf"nvme_bytes='{size}': is under the nvme tier's "
                       r"smallest store, 1 MiB \(1 MiB per directory"):
        offload.activations(tiers="nvme", nvme_dir=str(tmp_path), nvme_bytes=size)
    second = tmp_path / "b"
    second.mkdir()
    with pytest.raises(ConfigError, match=r"smallest store, 2 MiB"):
        offload.activations(tiers="nvme", nvme_dir=f"{tmp_path},{second}", nvme_bytes="1MiB")
    offload.activations(tiers="nvme", nvme_dir=str(tmp_path), nvme_bytes="1MiB")


def test_the_docstring_of_activations_names_every_setting():
    """`help(offload.activations)` lists the keyword settings; one added to Config must be
    named there too (nvme_max_bw and probe were not)."""
    from offload.config import _knobs
    doc = " ".join(offload.activations.__doc__.split())
    listed = doc.split("without the prefix:", 1)[1].split(".", 1)[0]
    assert [name.strip() for name in listed.split(",")] == [f.name for f in _knobs()]


def test_the_nvme_capacity_says_what_it_was_taken_of(small_disk):
    """`nvme_capacity_source` was always "" (only the host tier set its source)."""
    x = torch.randn(64, 64, requires_grad=True)
    for spec, source in (("4MiB", "OFFLOAD_NVME_BYTES"),
                         ("50%", f"50% of the free space in {small_disk}")):
        with offload.activations(tiers="nvme", nvme_dir=small_disk, nvme_bytes=spec,
                                 min_bytes=0) as ctx:
            (x * 2).tanh().sum().backward()
        assert ctx.stats.as_dict()["nvme_capacity_source"] == source
        offload.empty_cache()   # the next settings open their own store


def test_a_bare_number_for_a_share_is_said_to_be_bytes_once(caplog):
    """OFFLOAD_BUDGET=30 is 30 bytes (a size with no unit): `auto` then moved everything,
    without a word. A bare number up to 100 where a percentage is accepted is said, once."""
    import logging

    from offload import process

    process.reset()
    with caplog.at_level(logging.WARNING, logger="offload"):
        for _ in range(2):
            Config.from_env(env={"OFFLOAD_BUDGET": "30", "OFFLOAD_POLICY": "auto"})
        Config.from_env(env={"OFFLOAD_BUDGET": "4096", "OFFLOAD_POLICY": "auto"})
        Config.from_env(env={"OFFLOAD_BUDGET": "30%", "OFFLOAD_POLICY": "auto"})
        # Each says what its share is of (all said "of memory": the disk's is not).
        Config.from_env(env={"OFFLOAD_NVME_BYTES": "1"})
        Config.from_env(env={"OFFLOAD_HOST_BYTES": "50"})
    said = [r.getMessage() for r in caplog.records if "bytes; a share" in r.getMessage()]
    assert said == ["offload: OFFLOAD_BUDGET='30' is 30 bytes; a share of the activation "
                    "bytes the profiled step saves is a percentage: '30%'",
                    "offload: OFFLOAD_NVME_BYTES='1' is 1 bytes; a share of the free disk "
                    "space is a percentage: '1%'",
                    "offload: OFFLOAD_HOST_BYTES='50' is 50 bytes; a share of the available "
                    "RAM is a percentage: '50%'"]
