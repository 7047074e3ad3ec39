"""Journals beyond the few held open are parked (their descriptor closed) and opened
again when used, checked to be the same file: real files, no daemon."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from subagentd.daemon.store import _journal
from subagentd.daemon.store._journal import Journal, JournalCorrupt, JournalNotAdopted


@pytest.fixture
def two_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """At most two journals hold a descriptor at once, for this test."""
    monkeypatch.setattr(_journal._OPEN, "most", 2)


#: Journals a test keeps (a journal dropped closes, and holds no place among the open).
_KEPT: list[Journal] = []


@pytest.fixture(autouse=True)
def _let_go() -> None:
    _KEPT.clear()


def _parked(tmp_path: Path, name: str = "a") -> Journal:
    """A journal with one entry, parked by two others opened after it."""
    journal = Journal.create(tmp_path / name)
    journal.append("stdout", b"first\n", 1.0)
    _KEPT.extend(Journal.create(tmp_path / f"{name}-{o}") for o in "xy")  # held: not dropped
    assert not journal.holds_descriptor
    return journal


def _replace(path: Path, make: Callable[[Path], None]) -> None:
    path.unlink()
    make(path)


def _append(path: Path, data: bytes) -> None:
    with path.open("ab") as f:
        f.write(data)


@pytest.mark.usefixtures("two_open")
def test_many_journals_hold_few_descriptors_and_lose_no_byte(tmp_path: Path) -> None:
    before = len(os.listdir("/proc/self/fd"))
    journals = [Journal.create(tmp_path / f"j{n}") for n in range(20)]
    for round_ in range(3):
        for n, journal in enumerate(journals):
            journal.append("stdout", f"{n}:{round_}\n".encode(), float(round_))
            assert len(os.listdir("/proc/self/fd")) - before <= 2
    assert sum(j.holds_descriptor for j in journals) <= 2
    for n, journal in enumerate(journals):
        expected = b"".join(f"{n}:{r}\n".encode() for r in range(3))
        assert b"".join(e.data for e in journal.read(0, 100)) == expected  # reopened to read
        again = Journal.open(tmp_path / f"j{n}", writable=False)  # verified from scratch
        assert b"".join(e.data for e in again.read(0, 100)) == expected
        again.release()


@pytest.mark.usefixtures("two_open")
def test_a_parked_journal_renamed_over_is_refused_and_the_other_file_untouched(
    tmp_path: Path,
) -> None:
    journal = _parked(tmp_path)
    os.rename(tmp_path / "a", tmp_path / "a.moved")
    (tmp_path / "a").write_bytes(b"not the daemon's")
    with pytest.raises(JournalCorrupt, match="another file was put at its name"):
        journal.append("stdout", b"second\n", 2.0)
    assert (tmp_path / "a").read_bytes() == b"not the daemon's"


@pytest.mark.usefixtures("two_open")
@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (lambda p: _append(p, b"tail of a worker's own"), "bytes long, not the"),
        (lambda p: os.link(p, p.with_name("hard")), "links"),
        (lambda p: _replace(p, lambda q: q.symlink_to("/etc/passwd")), "gone from its name"),
        (lambda p: p.unlink(), "gone from its name"),
        (lambda p: _replace(p, os.mkfifo), "gone from its name"),
    ],
    ids=["written-into", "hard-linked", "symlink", "removed", "fifo"],
)
def test_a_parked_journal_changed_while_closed_is_refused(
    tmp_path: Path, damage: object, said: str
) -> None:
    journal = _parked(tmp_path)
    damage(tmp_path / "a")  # type: ignore[operator]
    with pytest.raises(JournalCorrupt, match=said):
        journal.append("stdout", b"second\n", 2.0)


@pytest.mark.usefixtures("two_open")
def test_a_parked_journal_with_its_last_entry_rewritten_is_refused(tmp_path: Path) -> None:
    """Same file, same length, its last entry's bytes changed: not what the daemon wrote."""
    journal = _parked(tmp_path)
    path = tmp_path / "a"
    raw = bytearray(path.read_bytes())
    raw[-2] ^= 0xFF
    with path.open("r+b") as f:
        f.write(raw)
    with pytest.raises(JournalCorrupt, match="no whole entry 1"):
        journal.append("stdout", b"second\n", 2.0)


@pytest.mark.usefixtures("two_open")
def test_a_released_journal_is_not_reopened(tmp_path: Path) -> None:
    journal = _parked(tmp_path)
    journal.release()
    with pytest.raises(ValueError, match="released"):
        journal.append("stdout", b"second\n", 2.0)


def test_a_dropped_journal_closes_its_descriptor_and_holds_no_place(tmp_path: Path) -> None:
    """The journals held open are held weakly: one dropped is closed at once, its memory
    (its in-memory tail) let go, and it takes no place among those held open."""
    before, held = len(os.listdir("/proc/self/fd")), len(_journal._OPEN)
    journal = Journal.create(tmp_path / "dropped")
    journal.append("stdout", b"x" * 100_000, 1.0)
    assert len(_journal._OPEN) == held + 1
    del journal
    assert len(_journal._OPEN) == held
    assert len(os.listdir("/proc/self/fd")) == before


@pytest.mark.usefixtures("two_open")
def test_a_parked_journal_handed_on_by_what_it_is_reopens_only_that_file(tmp_path: Path) -> None:
    """What a reload carries of a parked journal (`parked`) makes the next image's journal
    (`parked_from`): it goes on writing into the same file, and a file put at its name
    since is refused at its next use, as in the image that parked it."""
    journal = _parked(tmp_path)
    carried = journal.parked()
    assert carried is not None
    taken = Journal.parked_from(str(tmp_path / "a"), carried)
    assert not taken.holds_descriptor
    taken.append("stdout", b"second\n", 2.0)
    assert [e.data for e in taken.read(0, 10)] == [b"first\n", b"second\n"]
    _KEPT.extend(Journal.create(tmp_path / f"b-{o}") for o in "xy")  # parked again
    again = taken.parked()
    assert again is not None
    planted = tmp_path / "planted"
    planted.write_bytes((tmp_path / "a").read_bytes())  # whole, the same entries: not ours
    planted.rename(tmp_path / "a")
    with pytest.raises(JournalCorrupt, match="another file was put at its name"):
        Journal.parked_from(str(tmp_path / "a"), again).append("stdout", b"third\n", 3.0)


@pytest.mark.parametrize(
    "index",
    [
        {"size": -1},
        {"size": 0},
        {"offsets": []},
        {"offsets": [5]},
        {"last_offset": 10**9},
        {"last_seq": -3},
    ],
    ids=[
        "negative-size",
        "no-room-for-its-entry",
        "no-offsets",
        "first-offset-not-0",
        "last-past-end",
        "seq",
    ],
)
@pytest.mark.usefixtures("two_open")
def test_a_parked_index_that_cannot_be_a_journals_is_not_taken(
    tmp_path: Path, index: dict[str, object]
) -> None:
    """A parked journal's index that does not fit (a bug of the image before): not taken
    (JournalNotAdopted: the journal is then opened from its path and verified whole)."""
    carried = _parked(tmp_path).parked()
    assert carried is not None
    hostile = msgspec.structs.replace(
        carried, index=msgspec.structs.replace(carried.index, **index)
    )
    with pytest.raises(JournalNotAdopted):
        Journal.parked_from(str(tmp_path / "a"), hostile)


def test_a_journal_holding_its_descriptor_is_not_carried_as_parked(tmp_path: Path) -> None:
    journal = Journal.create(tmp_path / "a")
    assert journal.parked() is None  # `carry` hands its descriptor over instead
