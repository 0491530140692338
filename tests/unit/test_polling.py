"""The one polling loop: answers at once, waits in steps, gives up at the deadline, lets a probe stop it."""

import pytest

from spark_pipelines.core.polling import poll_until


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def test_done_on_the_first_answer_does_not_sleep():
    c = Clock()
    p = poll_until(lambda: 0, lambda v: v == 0, timeout_s=10, clock=c, sleep=c.sleep)
    assert (p.done, p.value, p.waited_s, c.sleeps) == (True, 0, 0.0, [])


def test_polls_every_step_until_the_condition_holds():
    c = Clock()
    answers = iter([3, 2, 0])
    p = poll_until(lambda: next(answers), lambda v: v == 0, timeout_s=10, every_s=2, clock=c, sleep=c.sleep)
    assert (p.done, p.value, p.waited_s, c.sleeps) == (True, 0, 4.0, [2, 2])


def test_gives_up_at_the_deadline_with_the_last_answer_and_one_probe_there():
    c = Clock()
    calls = []
    p = poll_until(lambda: calls.append(c.now) or 5, lambda v: v == 0, timeout_s=2.5, every_s=1,
                   clock=c, sleep=c.sleep)
    assert (p.done, p.value, p.waited_s) == (False, 5, 2.5)
    assert calls == [100.0, 101.0, 102.0, 102.5]  # the last sleep is cut to the deadline


def test_a_probe_error_stops_the_wait_at_once():
    c = Clock()

    def probe():
        raise RuntimeError("engine gone")

    with pytest.raises(RuntimeError, match="engine gone"):
        poll_until(probe, bool, timeout_s=60, clock=c, sleep=c.sleep)
    assert c.sleeps == []
    with pytest.raises(ValueError, match="every_s"):
        poll_until(lambda: 1, bool, timeout_s=1, every_s=0)
