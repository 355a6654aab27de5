"""Files written where the user says (`offload-bench --json`, OFFLOAD_TRACE): a regular
file is replaced whole, a symbolic link keeps pointing at the file it names, and a FIFO or a
device is written in place, never replaced by a file (a helper's report: `--json /dev/full`
run as root replaced the device node with a JSON file and said "wrote /dev/full"; a FIFO's
reader got 0 bytes; the trace file came out mode 0600)."""
from __future__ import annotations

import os
import stat
import threading

import pytest

from offload.bench import report
from offload.util.output_files import output_file_problem, write_output_file
from offload.util.trace import TraceRecorder


def _rows():
    from offload.bench.rows import Row
    return [Row(strategy="none")]


def test_a_link_keeps_pointing_at_the_file_it_names(tmp_path):
    target = tmp_path / "results" / "rows.json"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "latest.json"
    link.symlink_to(target)
    report.write_json(_rows(), str(link))
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert '"strategy": "none"' in target.read_text().replace('":"', '": "')
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.json", "results"]
    assert sorted(p.name for p in target.parent.iterdir()) == ["rows.json"]


@pytest.mark.parametrize("how", ["json", "trace"])
def test_a_fifo_is_written_in_place(tmp_path, how):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    if how == "json":
        assert output_file_problem(str(fifo)) is None
        report.write_json(_rows(), str(fifo))
    else:
        TraceRecorder().write(fifo)
    reader.join(10)
    assert got and got[0].startswith("{") and stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_file_keeps_its_mode_and_a_new_one_gets_the_umask_s(tmp_path):
    old = tmp_path / "old.json"
    old.write_text("x")
    old.chmod(0o640)
    write_output_file(old, lambda f: f.write("y"))
    assert old.read_text() == "y" and stat.S_IMODE(old.stat().st_mode) == 0o640
    mask = os.umask(0o022)
    try:
        new = tmp_path / "new.json"
        write_output_file(new, lambda f: f.write("z"))
        assert stat.S_IMODE(new.stat().st_mode) == 0o644   # as open() makes it, not 0600
    finally:
        os.umask(mask)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    old = tmp_path / "rows.json"
    old.write_text("old")

    def fails(f):
        f.write("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_output_file(old, fails)
    assert old.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["rows.json"]


def test_an_empty_path_is_a_problem_said_before_the_work():
    assert "empty path" in output_file_problem("")


def test_a_link_into_a_missing_directory_is_a_problem_said_before_the_work(tmp_path):
    link = tmp_path / "latest.json"
    link.symlink_to(tmp_path / "no" / "such" / "rows.json")
    assert "does not exist" in output_file_problem(str(link))
