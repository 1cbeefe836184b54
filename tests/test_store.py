"""The sweep store: nothing lost, nothing invented (issue 15, R1-R4, R10)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from amla_sim.experiments.store import ResultStore, StoreCorrupt, StoreLocked
from amla_sim.experiments.sweep import run_table

FIELDS = ("dist", "sample", "alg", "value")
SMALL = dict(samples=2, context=256, heads=8, progress=False)


def _store(tmp_path):
    return ResultStore(tmp_path, FIELDS, 3)


def _rows(n):
    return [("normal:1", str(i), "base", repr(1.5e-6 * (i + 1))) for i in range(n)]


def test_rows_round_trip_with_checksums(tmp_path):
    with _store(tmp_path) as s:
        s.append(_rows(3))
    text = (tmp_path / "results.csv").read_text()
    assert text.splitlines()[0] == "dist,sample,alg,value,crc32"
    assert all(len(line.rsplit(",", 1)[1]) == 8 for line in text.splitlines()[1:])
    with _store(tmp_path) as s:
        assert sorted(s.rows.values()) == sorted(_rows(3))


@pytest.mark.parametrize("cut", [1, 2, 5, 9, 14, 20])
def test_a_cut_off_last_line_is_dropped_not_read_as_a_number(tmp_path, cut):
    # R2: "...,1.63" of "...,1.63e-06" parsed as 1.63
    with _store(tmp_path) as s:
        s.append(_rows(3))
    path = tmp_path / "results.csv"
    data = path.read_bytes()
    path.write_bytes(data[:-cut])
    with _store(tmp_path) as s:
        if cut == 1:  # only the newline lost: the row and its checksum are whole
            assert sorted(s.rows.values()) == sorted(_rows(3)) and s.torn == 0
        else:
            assert sorted(s.rows.values()) == sorted(_rows(2)) and s.torn == 1


def test_a_damaged_line_in_the_middle_is_named_and_repairable(tmp_path):
    with _store(tmp_path) as s:
        s.append(_rows(4))
    path = tmp_path / "results.csv"
    lines = path.read_bytes().split(b"\n")
    lines[2] = lines[2].replace(b"3e-06", b"4e-06")  # a flipped digit keeps the line parseable
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(StoreCorrupt, match=r"results.csv: line 3 .*--repair"):
        with _store(tmp_path):
            pass
    s = _store(tmp_path)
    kept, rejected = s.repair()
    assert (kept, rejected) == (3, 1)
    assert b"4e-06" in (tmp_path / "results.rejected").read_bytes()
    with _store(tmp_path) as s:
        assert len(s.rows) == 3


@pytest.mark.parametrize("junk", [b"\n", b"no commas at all\n", b",,,\n"])
def test_junk_lines_do_not_crash(tmp_path, junk):
    # R3: a blank line or a line without commas gave IndexError on every resume
    with _store(tmp_path) as s:
        s.append(_rows(2))
    path = tmp_path / "results.csv"
    lines = path.read_bytes().split(b"\n", 2)
    path.write_bytes(lines[0] + b"\n" + lines[1] + b"\n" + junk + lines[2])
    if junk.strip():
        with pytest.raises(StoreCorrupt, match="results.csv"):
            with _store(tmp_path):
                pass
    else:
        with _store(tmp_path) as s:
            assert len(s.rows) == 2


def test_conflicting_duplicates_are_corruption(tmp_path):
    with _store(tmp_path) as s:
        s.append(_rows(1))
        s.append(_rows(1))  # the same row again: not written twice
        assert (tmp_path / "results.csv").read_text().count("\n") == 2
        with pytest.raises(StoreCorrupt, match="second row"):
            s.append([("normal:1", "0", "base", "2.0")])


def test_short_writes_are_completed(tmp_path, monkeypatch):
    real = os.write

    def one_byte(fd, data):
        return real(fd, bytes(data[:1]))

    with _store(tmp_path) as s:
        monkeypatch.setattr(os, "write", one_byte)
        s.append(_rows(2))
        monkeypatch.setattr(os, "write", real)
    with _store(tmp_path) as s:
        assert len(s.rows) == 2


def test_a_second_writer_is_refused(tmp_path):
    # R4: two runs into one --out crashed on a shared run.json.tmp
    with _store(tmp_path):
        with pytest.raises(StoreLocked, match="in use by another amla-sim run"):
            with _store(tmp_path):
                pass
    with _store(tmp_path):  # released
        pass


def test_legacy_files_need_repair_and_keep_whole_lines(tmp_path):
    path = tmp_path / "results.csv"
    path.write_text("dist,sample,alg,value\nnormal:1,0,base,1.5e-06\nnormal:1,1,base,3e-06\nnormal:1,2,base,1.6")
    with pytest.raises(StoreCorrupt, match="--repair"):
        with _store(tmp_path):
            pass
    s = _store(tmp_path)
    assert s.repair() == (2, 1)  # the last line had no newline: torn, set aside
    with _store(tmp_path) as s:
        assert sorted(s.rows) == [("normal:1", "0", "base"), ("normal:1", "1", "base")]


# --- the table sweep on the store ---------------------------------------------------------------------------


def _files(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.suffix in (".csv", ".json", ".md")}


def test_a_smaller_rerun_keeps_every_row(tmp_path):
    # R1: --samples 20 then --samples 2 into one folder deleted 216 of 240 rows
    run_table("amla-table3", out_dir=tmp_path, **{**SMALL, "samples": 3})
    csv = tmp_path / "amla-table3" / "results.csv"
    before = csv.read_bytes()
    res = run_table("amla-table3", out_dir=tmp_path, **SMALL)
    assert res.computed == 0 and csv.read_bytes() == before
    assert all(r["samples"] == 2 for r in res.summary["rows"])
    assert _files(tmp_path / "amla-table3")["summary.json"] == _clean_summary(tmp_path)


def _clean_summary(tmp_path):
    run_table("amla-table3", out_dir=tmp_path / "clean", **SMALL)
    return (tmp_path / "clean" / "amla-table3" / "summary.json").read_bytes()


def test_a_run_json_that_is_not_an_object_is_a_clear_error(tmp_path):
    out = tmp_path / "amla-table3"
    out.mkdir()
    (out / "run.json").write_text("[1, 2]")
    with pytest.raises(StoreCorrupt, match="run.json"):
        run_table("amla-table3", out_dir=tmp_path, **SMALL)


def _sweep_cmd(out, jobs=1, extra=()):
    return [sys.executable, "-m", "amla_sim.cli", "reproduce", "amla-table4", "--samples", "3", "--context", "256",
            "--heads", "8", "--quiet", "--jobs", str(jobs), "--out", str(out), *extra]


def test_killed_at_random_points_resumes_to_identical_files(tmp_path):
    clean = tmp_path / "clean"
    subprocess.run(_sweep_cmd(clean), check=True, capture_output=True)
    cut = tmp_path / "cut"
    for delay in (0.9, 1.3, 1.7, 2.2):  # seconds after start: imports, then tasks in flight
        p = subprocess.Popen(_sweep_cmd(cut), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
    csv = cut / "amla-table4" / "results.csv"
    if csv.exists():  # a torn write, as a full disk or a kill mid-write leaves it
        with open(csv, "ab") as f:
            f.write(b"uniform:3,2,amla,0.0012")
    r = subprocess.run(_sweep_cmd(cut), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert _files(clean / "amla-table4") == _files(cut / "amla-table4")


def test_concurrent_runs_finish_identical_or_refuse(tmp_path):
    clean = tmp_path / "clean"
    subprocess.run(_sweep_cmd(clean), check=True, capture_output=True)
    out = tmp_path / "both"
    procs = [subprocess.Popen(_sweep_cmd(out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    results = [(p.wait(), p.stderr.read()) for p in procs]
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    for code, err in results:
        assert "Traceback" not in err
        assert code == 0 or (code == 1 and "in use by another amla-sim run" in err), err
    assert any(code == 0 for code, _ in results)
    assert _files(clean / "amla-table4") == _files(out / "amla-table4")


def _children(pid):
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    except FileNotFoundError:  # pragma: no cover
        pytest.skip("pgrep missing")
    return [int(x) for x in out.split()]


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()
    except OSError:
        return ""


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_die_with_their_parent(tmp_path):
    # R10: after SIGKILL of a --jobs 2 run the workers stayed alive, blocked on a pipe
    p = subprocess.Popen(_sweep_cmd(tmp_path, jobs=2, extra=("--samples", "40")), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    workers = []
    for _ in range(100):
        time.sleep(0.1)
        workers = [c for c in _children(p.pid) if "spawn_main" in _cmdline(c)]
        if len(workers) >= 2:
            break
    assert len(workers) >= 2, "no worker processes seen"
    p.send_signal(signal.SIGKILL)
    p.wait()
    deadline = time.time() + 20
    while time.time() < deadline and any(_alive(w) for w in workers):
        time.sleep(0.1)
    left = [w for w in workers if _alive(w)]
    for w in left:
        os.kill(w, signal.SIGKILL)
    assert not left


@pytest.mark.parametrize("cut", [1, 7])
def test_appending_after_a_cut_never_glues_rows(tmp_path, cut):
    # the store itself, not only run_table, compacts a file whose last line lost its end before appending
    with _store(tmp_path) as s:
        s.append(_rows(3))
    path = tmp_path / "results.csv"
    whole = path.read_bytes()
    path.write_bytes(whole[:-cut])
    with _store(tmp_path) as s:
        if cut == 1:
            s.append([("normal:1", "9", "base", "1e-06")])
        else:  # the torn line is set aside, not lost, and the user is told
            with pytest.warns(UserWarning, match="last line was torn.*results.rejected"):
                s.append([("normal:1", "9", "base", "1e-06")])
            torn = whole[:-cut].rsplit(b"\n", 1)[1]
            assert (tmp_path / "results.rejected").read_bytes() == torn + b"\n"
    with _store(tmp_path) as s:
        kept = 3 if cut == 1 else 2
        assert len(s.rows) == kept + 1 and s.torn == 0


def test_a_failed_capture_write_leaves_nothing_behind(tmp_path, monkeypatch):
    import numpy as np

    from amla_sim._files import atomic_savez

    path = tmp_path / "capture.npz"
    atomic_savez(path, a=np.arange(10))
    with np.load(path) as z:
        assert z["a"].tolist() == list(range(10))

    def full_disk(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OSError):
        atomic_savez(tmp_path / "other.npz", a=np.arange(10))
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["capture.npz"]  # no half file, no temporary
