"""Which pids can have been handed out since a sample of the pid counter (sans I/O)."""

from __future__ import annotations

from subagentd.daemon.processes._pidclock import PidArc, PidSample, arc_since

PID_MAX = 32768


def sample(last_pid: int, forks: int, tasks: int = 100) -> PidSample:
    return PidSample(last_pid, forks, tasks, tick=0)


def test_the_arc_holds_the_pids_handed_out_after_the_sample_and_no_older() -> None:
    arc = arc_since(sample(1000, 50), sample(1200, 250), PID_MAX)
    assert all(pid in arc for pid in (1001, 1200))
    assert not any(pid in arc for pid in (999, 1000, 1201))
    assert arc.span() == 200
    assert list(arc.pids()) == list(range(1001, 1201))


def test_an_arc_round_a_wrap_holds_both_ends_of_the_cycle() -> None:
    arc = arc_since(sample(32000, 50), sample(400, 1200), PID_MAX)
    assert all(pid in arc for pid in (32001, 32767, 300, 400))
    assert not any(pid in arc for pid in (401, 32000, 5000))
    assert arc.span() == 767 + 400
    assert set(arc.pids()) == {*range(32001, PID_MAX), *range(1, 401)}


def test_forks_enough_to_go_round_the_cycle_make_every_pid_new() -> None:
    """The counter back where it was is no sign that nothing was forked: as many forks as
    the cycle (less the numbers the tasks then held) may have gone once round."""
    assert arc_since(sample(1000, 0), sample(1000, 40_000), PID_MAX).whole
    assert arc_since(sample(1000, 0, tasks=20_000), sample(1000, 2000), PID_MAX).whole
    assert not arc_since(sample(1000, 0, tasks=100), sample(1000, 2000), PID_MAX).whole


def test_without_a_sample_or_with_another_boots_counter_every_pid_is_new() -> None:
    assert arc_since(None, sample(1000, 10), PID_MAX).whole
    assert arc_since(sample(1000, 10), sample(1200, 5), PID_MAX).whole
    whole = PidArc(0, 0, 0, whole=True)
    assert all(pid in whole for pid in (1, 10**9))
    assert whole.span() is None
