"""The progress display (gspo_megatron/progress.py): the ETA arithmetic, the plain lines written
where the output is not a terminal, and the live line on one."""

import io

import pytest

from gspo_megatron.progress import Progress, eta_seconds, format_duration


class Clock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class NotATerminal(io.StringIO):
    def isatty(self):
        return False


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_eta_is_the_mean_rate_times_the_units_left():
    assert eta_seconds(10.0, 2, 10) == 40.0  # 5 s a unit, 8 left
    assert eta_seconds(3.0, 3, 3) == 0.0
    assert eta_seconds(5.0, 0, 10) is None  # no rate before the first unit
    assert eta_seconds(5.0, 12, 10) == 0.0  # past the total: nothing left, never negative


@pytest.mark.parametrize("seconds,shown", [(None, "?"), (0, "0:00"), (59.4, "0:59"),
                                           (61, "1:01"), (3599.6, "1:00:00"), (3 * 3600 + 125, "3:02:05")])
def test_durations(seconds, shown):
    assert format_duration(seconds) == shown


def test_plain_lines_at_the_counts_asked_with_elapsed_and_eta():
    clock, out = Clock(), NotATerminal()
    p = Progress("RL", 4, every=1, stream=out, clock=clock)
    assert not p.tty  # detected from the stream
    for step in range(4):
        clock.now += 30.0  # 30 s a step
        p.update(step + 1, f"step {step} | reward 0.5")
    p.close()
    assert out.getvalue().splitlines() == [
        "step 0 | reward 0.5 | 1/4, elapsed 0:30, ETA 1:30",
        "step 1 | reward 0.5 | 2/4, elapsed 1:00, ETA 1:00",
        "step 2 | reward 0.5 | 3/4, elapsed 1:30, ETA 0:30",
        "step 3 | reward 0.5 | 4/4, elapsed 2:00",  # no ETA at the end
    ]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_a_resumed_run_counts_its_rate_from_where_it_resumed():
    """A run resumed at step 6 of 10: 4 steps left, timed from this process's start, so the
    steps done before the resume do not make the rate look 2.5x faster."""
    clock, out = Clock(), NotATerminal()
    p = Progress("RL", 10, start=6, every=1, stream=out, clock=clock)
    clock.now += 20.0
    p.update(7, "step 6")
    assert out.getvalue() == "step 6 | 7/10, elapsed 0:20, ETA 1:00\n"


def test_plain_lines_every_n_and_at_the_end():
    clock, out = Clock(), NotATerminal()
    p = Progress("sft", 120, every=50, stream=out, clock=clock)
    for i in range(120):
        clock.now += 0.5
        p.update(i + 1, f"sft step {i}: nll 1.0")
    assert [line.split(" | ")[0] for line in out.getvalue().splitlines()] == [
        "sft step 49: nll 1.0", "sft step 99: nll 1.0", "sft step 119: nll 1.0"]


def test_long_work_without_counts_prints_a_line_every_interval():
    """Evaluation and conversion ask for no lines by count: short work prints nothing, long work
    a line every ``interval_s`` seconds (the label stands for the text) and a last one."""
    clock, out = Clock(), NotATerminal()
    short = Progress("eval", 100, interval_s=30, stream=out, clock=clock)
    for n in range(1, 101):
        clock.now += 0.1
        short.update(n)
    assert out.getvalue() == ""

    long = Progress("eval", 100, interval_s=30, stream=out, clock=clock)
    for n in range(1, 101):
        clock.now += 1.0
        long.update(n)
    assert out.getvalue().splitlines() == [
        "eval | 30/100, elapsed 0:30, ETA 1:10",
        "eval | 60/100, elapsed 1:00, ETA 0:40",
        "eval | 90/100, elapsed 1:30, ETA 0:10",
        "eval | 100/100, elapsed 1:40",
    ]


def test_update_without_a_count_adds_one():
    clock, out = Clock(), NotATerminal()
    p = Progress("convert", 3, every=1, stream=out, clock=clock)
    p.update()
    p.update()
    assert [line.split(",")[0] for line in out.getvalue().splitlines()] == ["convert | 1/3", "convert | 2/3"]


def test_disabled_writes_nothing():
    out = NotATerminal()
    p = Progress("RL", 2, every=1, enabled=False, stream=out)
    p.update(1, "step 0")
    p.write("a message")
    p.close()
    assert out.getvalue() == "" and p.callback() is None


def test_terminal_keeps_the_lines_asked_for_above_one_live_line(monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")  # the live line is cut to the terminal's width
    clock, out = Clock(), Terminal()
    p = Progress("RL", 4, every=1, stream=out, clock=clock)
    assert p.tty
    clock.now += 10.0
    p.update(1, "step 0 | reward 0.5")
    # the kept line (no count: the live line has it), then the live line, redrawn in place
    assert out.getvalue() == ("\r\x1b[Kstep 0 | reward 0.5\n"
                              "\r\x1b[KRL [#####---------------]  25% 1/4, elapsed 0:10, ETA 0:30"
                              " | step 0 | reward 0.5")
    p.write("held-out accuracy: 0.5")  # a message goes above the live line, not after it
    assert out.getvalue().endswith("\r\x1b[Kheld-out accuracy: 0.5\n")
    p.close()
    assert out.getvalue().endswith("\n")  # nothing left drawn


def test_terminal_live_line_is_redrawn_at_most_every_tenth_of_a_second():
    clock, out = Clock(), Terminal()
    p = Progress("eval", 1000, stream=out, clock=clock)
    for n in range(1, 1001):
        clock.now += 0.001  # 1 s in all
        p.update(n)
    draws = out.getvalue().split("\r\x1b[K")[1:]
    assert 10 <= len(draws) <= 12, len(draws)
    assert draws[-1].startswith("eval [####################] 100% 1000/1000")
    assert "\n" not in out.getvalue()  # no text: nothing kept
    p.close()
    assert out.getvalue().endswith("\r\x1b[K")


def test_live_line_fits_the_terminal():
    p = Progress("RL", 10, stream=Terminal())
    p.update(3, "x" * 500)
    assert len(p.live_line(80)) == 79
