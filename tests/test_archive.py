"""A worker's archive on disk: records rewritten in place, and where a result comes from."""

from __future__ import annotations

from pathlib import Path

from subagentd.daemon._archive import RECORD_IN_PLACE_BYTES, STDOUT_TAIL_BYTES, Archive
from subagentd.daemon._journal import Journal
from subagentd.daemon._registry import Registry, WorkerRecord


def _record(tmp_path: Path, argv: list[str]) -> tuple[Archive, WorkerRecord]:
    record = Registry().register(
        now=1.0, argv=argv, cwd="/", archive_for=lambda worker_id: str(tmp_path / worker_id)
    )
    archive = Archive(Path(record.archive))
    archive.create()
    return archive, record


def test_a_record_is_rewritten_in_place_and_reads_back_when_it_shrinks(tmp_path: Path) -> None:
    archive, record = _record(tmp_path, ["sleep", "1"])
    record.name = "a name that makes the first record the longest"
    archive.write_record(record)
    path = archive.file(Archive.RECORD)
    inode, size = path.stat().st_ino, path.stat().st_size
    record.name = ""
    record.state = "finished"
    archive.write_record(record)
    assert path.stat().st_ino == inode  # no new file
    assert path.stat().st_size == size  # padded, not truncated: one write, never torn
    assert archive.load_record() == record


def test_a_record_larger_than_a_page_is_replaced_whole(tmp_path: Path) -> None:
    archive, record = _record(tmp_path, ["sleep", "1"])
    archive.write_record(record)
    record.argv = ["echo", "x" * RECORD_IN_PLACE_BYTES]
    archive.write_record(record)
    assert archive.load_record() == record
    record.argv = ["true"]
    archive.write_record(record)  # the file is now over a page: replaced again
    assert archive.load_record() == record


def test_the_result_is_the_result_file_else_the_stdout_tail(tmp_path: Path) -> None:
    archive, _ = _record(tmp_path, ["true"])
    assert archive.result_text(lambda: b"tail") == "tail"
    archive.file(Archive.RESULT).write_bytes(b"the result")
    assert archive.result_text(lambda: b"unused") == "the result"


def test_the_stdout_tail_is_read_from_the_journal_when_its_file_was_never_written(
    tmp_path: Path,
) -> None:
    archive, _ = _record(tmp_path, ["true"])
    journal = Journal.create(archive.file(Archive.JOURNAL))
    journal.append("stdout", b"a" * STDOUT_TAIL_BYTES, 1.0)
    journal.append("stderr", b"not this", 2.0)
    journal.append("stdout", b"the end", 3.0)
    journal.close()
    assert archive.stdout_tail() == (b"a" * STDOUT_TAIL_BYTES + b"the end")[-STDOUT_TAIL_BYTES:]
    archive.write_stdout_tail(b"from the file")
    assert archive.stdout_tail() == b"from the file"
