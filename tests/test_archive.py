"""A worker's archive on disk: where a result comes from."""

from __future__ import annotations

from pathlib import Path

from subagentd.daemon.core._registry import Registry, WorkerRecord
from subagentd.daemon.store._archive import STDOUT_TAIL_BYTES, Archive
from subagentd.daemon.store._journal import Journal


def _record(tmp_path: Path, argv: list[str]) -> tuple[Archive, WorkerRecord]:
    record = Registry().register(
        now=1.0, argv=argv, cwd="/", archive_for=lambda worker_id: str(tmp_path / worker_id)
    )
    archive = Archive(Path(record.archive))
    archive.create()
    return archive, record


def test_the_result_is_the_result_file_else_the_stdout_tail(tmp_path: Path) -> None:
    archive, _ = _record(tmp_path, ["true"])
    assert archive.result_text(lambda: b"tail") == "tail"
    archive.file(Archive.RESULT).write_bytes(b"the result")
    assert archive.result_text(lambda: b"unused") == "the result"


def test_the_stdout_tail_is_read_from_the_journal(tmp_path: Path) -> None:
    archive, _ = _record(tmp_path, ["true"])
    journal = Journal.create(archive.file(Archive.JOURNAL))
    journal.append("stdout", b"a" * STDOUT_TAIL_BYTES, 1.0)
    journal.append("stderr", b"not this", 2.0)
    journal.append("stdout", b"the end", 3.0)
    journal.close()
    assert archive.stdout_tail() == (b"a" * STDOUT_TAIL_BYTES + b"the end")[-STDOUT_TAIL_BYTES:]
