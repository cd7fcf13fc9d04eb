"""A signal the console script got before the workers start, which something on the way
swallowed (a bare ``except``, a finalizer's "Exception ignored"), still stops the run before
any worker starts: once a Ctrl-C at 0.5 s was followed by 90 s of training under load."""

import signal

import pytest

from launch.commands import console, train


@pytest.fixture
def received(monkeypatch):
    monkeypatch.setattr(console, "_received", [])
    monkeypatch.setattr(console, "_done", [])
    return console._received


def test_a_swallowed_signal_is_raised_before_the_workers_start(received, monkeypatch, tmp_path):
    def launch(*args, **kwargs):
        raise AssertionError("workers started after a Ctrl-C")

    monkeypatch.setattr(train, "launch", launch)
    received.append(signal.SIGINT)
    with pytest.raises(console.Stopped) as stopped:
        train.run(None, None, tmp_path)
    assert stopped.value.signal_number == signal.SIGINT
    assert str(stopped.value) == "got SIGINT while no worker was running"


def test_no_signal_or_a_finished_run_raises_nothing(received, monkeypatch):
    console.raise_if_interrupted()
    received.append(signal.SIGTERM)
    console.work_done()  # the run's work is done: a signal now stops nothing
    console.raise_if_interrupted()
