"""Whole Parquet files are read in the calling thread (:func:`specray.runtime.store.read_parquet`), never through
pyarrow's dataset scanner: with pyarrow 26.0.1 a process that read files through ``pq.read_table`` on Python file
objects and then exited aborted with status 134 in 33 of 200 runs on the development machine (an I/O thread
dropping the file's last reference while the interpreter finalizes)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specray.prompts import read_prompt_set
from specray.runtime.store import RunStore, read_parquet

ROOT = Path(__file__).resolve().parents[1]


def refuse_dataset_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``pq.read_table`` fail, so that a test shows the code under it reads files another way."""
    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("pq.read_table goes through the dataset scanner; use specray.runtime.store.read_parquet")
    monkeypatch.setattr(pq, "read_table", refused)


def _shard(path: Path, rows: int = 300) -> pa.Table:
    table = pa.table({"sample_id": list(range(rows)), "image": [bytes([i % 256]) * 512 for i in range(rows)],
                      "prompt": [f"a digit {i}" for i in range(rows)], "id": [str(i) for i in range(rows)]})
    pq.write_table(table, path)
    return table


def test_readers_of_whole_files_do_not_use_the_dataset_scanner(tmp_path, monkeypatch):
    table = _shard(tmp_path / "s.parquet")
    refuse_dataset_reads(monkeypatch)
    with open(tmp_path / "s.parquet", "rb") as handle:
        assert read_parquet(handle, columns=["sample_id", "image"]) == table.select(["sample_id", "image"])
    store = RunStore(str(tmp_path))
    assert store.read_table("s.parquet") == table
    prompts = read_prompt_set(str(tmp_path / "s.parquet"))
    assert prompts.texts[:2] == ("a digit 0", "a digit 1") and prompts.ids[:2] == ("0", "1")


def test_whole_file_reads_decode_in_the_calling_thread(tmp_path, monkeypatch):
    """read_parquet, and so a run store's and a prompt set's reads, asks pyarrow for no threads: its pool reading a
    Python file object can abort the process at exit (read_parquet's docstring has the counts)."""
    _shard(tmp_path / "s.parquet")
    asked: list[object] = []
    read = pq.ParquetFile.read

    def recording(self, *args, **kwargs):
        asked.append(kwargs.get("use_threads", "default"))
        return read(self, *args, **kwargs)
    monkeypatch.setattr(pq.ParquetFile, "read", recording)
    with open(tmp_path / "s.parquet", "rb") as handle:
        assert read_parquet(handle).num_rows == 300
    assert RunStore(str(tmp_path)).read_table("s.parquet").num_rows == 300
    assert len(read_prompt_set(str(tmp_path / "s.parquet")).texts) == 300
    assert asked == [False] * 3


def test_processes_that_read_parquet_files_and_exit_exit_cleanly(tmp_path):
    for i in range(4):
        _shard(tmp_path / f"s{i}.parquet", rows=2000)
    script = textwrap.dedent(f"""
        import glob
        from specray.runtime.store import read_parquet
        for name in sorted(glob.glob({str(tmp_path / '*.parquet')!r})):
            with open(name, "rb") as handle:
                read_parquet(handle, columns=["sample_id", "image"]).to_pylist()
    """)
    statuses = [subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
                for _ in range(8)]
    assert [s.returncode for s in statuses] == [0] * 8, [s.stderr[-300:] for s in statuses if s.returncode]
