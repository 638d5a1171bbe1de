"""The idle back-off of the fetch wait and the lag read-out schedule, under a fake clock."""

from mmpipe.streams.fetch_wait import AdaptiveFetchWait, LagReadSchedule


def empty_fetches(policy: AdaptiveFetchWait, start: float, until: float) -> float:
    """Empty fetches back to back, each lasting its own wait; returns the clock at the end."""
    now = start
    while now < until:
        now += policy.wait_ms / 1000
        policy.after_fetch(False, now)
    return now


def test_wait_stays_short_while_records_flow_and_within_the_grace_period():
    policy = AdaptiveFetchWait(base_ms=20, idle_max_ms=500, idle_after_s=1.0)
    assert policy.after_fetch(True, 0.0) == 20
    empty_fetches(policy, 0.0, 0.9)
    assert policy.wait_ms == 20 and not policy.idle


def test_wait_doubles_after_the_grace_period_up_to_the_cap_and_snaps_back():
    policy = AdaptiveFetchWait(base_ms=20, idle_max_ms=500, idle_after_s=1.0)
    policy.after_fetch(True, 0.0)
    now = empty_fetches(policy, 0.0, 1.02)
    assert policy.wait_ms == 40
    waits = [policy.after_fetch(False, now + i) for i in range(1, 6)]
    assert waits == [80, 160, 320, 500, 500]
    assert policy.idle
    assert policy.after_fetch(True, now + 7) == 20
    assert not policy.idle


def test_no_backoff_when_disabled():
    policy = AdaptiveFetchWait(base_ms=20, idle_max_ms=20, idle_after_s=0.0)
    empty_fetches(policy, 0.0, 30.0)
    assert policy.wait_ms == 20


def test_lag_reads_pause_only_after_a_read_with_no_lag_and_resume_on_records():
    fetches = AdaptiveFetchWait(base_ms=20, idle_max_ms=500, idle_after_s=1.0)
    schedule = LagReadSchedule(idle_interval_s=10.0)
    assert schedule.due(fetches, 0.0)
    schedule.read(total_lag=3, now=0.0)
    assert schedule.due(fetches, 0.5)  # lag seen: keep reading
    schedule.read(total_lag=0, now=1.0)
    assert not schedule.due(fetches, 1.5)
    assert not schedule.due(fetches, 10.9)
    assert schedule.due(fetches, 11.0)  # the periodic read while idle
    schedule.read(total_lag=0, now=11.0)
    fetches.after_fetch(True, 11.2)
    assert schedule.due(fetches, 11.5)  # records arrived since the quiet read
