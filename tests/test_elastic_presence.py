"""Node 0's coordinator tells why a node left (exit, signal, silence) and who came back,
in one process over local sockets (``launch/launchers/presence.py``)."""

import json
import socket

import pytest

from launch.launchers.presence import Coordinator, Member

pytestmark = pytest.mark.timeout(60)


def hello(port: int, node: int) -> socket.socket:
    """A node that says hello and nothing more (stopped: silent, its connection open)."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=10)
    conn.sendall((json.dumps({"hello": node}) + "\n").encode())
    return conn


def heard(coordinator, node: int) -> None:
    """Until the coordinator's reader has taken ``node``'s hello: sent is not yet read, and a
    node the coordinator never heard of counts as never connected."""
    with coordinator.changed:
        assert coordinator.changed.wait_for(lambda: node in coordinator.nodes, timeout=10), node


@pytest.fixture
def coordinator():
    joined = []
    coord = Coordinator(silence_s=3.0, nnodes=4, on_join=joined.append)  # beats: 0.5 s
    coord.joined = joined
    yield coord
    coord.close()


def test_exit_signal_and_silence_are_told_apart(coordinator):
    exits = Member("127.0.0.1", coordinator.port, 1, 10)
    killed = Member("127.0.0.1", coordinator.port, 2, 10)
    silent = hello(coordinator.port, 3)
    try:
        heard(coordinator, 3)
        assert exits.word(10) == {"attempt": 0, "nodes": 4, "node_rank": 1, "resume_from": None}
        exits.close("exit code 1")
        killed.closed.set()
        killed.conn.shutdown(socket.SHUT_RDWR)  # the process died: closed without a word
        ready, gone = coordinator.regroup(0, [1, 2, 3], wait_s=20)
    finally:
        silent.close()
    assert ready == []
    assert gone[1] == "it exited (exit code 1)"
    assert gone[2].startswith("its hybrid-train died without a word (killed by a signal")
    assert gone[3].startswith("silence: not heard for 3s (launcher.silence_timeout_s=3;")


def test_a_node_that_reports_is_told_its_place(coordinator):
    member = Member("127.0.0.1", coordinator.port, 1, 10)
    try:
        assert member.word(10)["attempt"] == 0
        member._say({"ready": 0, "failure": "rank 4 failed"})
        ready, gone = coordinator.regroup(0, [1], wait_s=20)
        assert ready == [1] and gone == {}
        assert coordinator.nodes[1].failure == "rank 4 failed"
        coordinator.tell(1, {"attempt": 1, "nodes": 2, "node_rank": 1, "resume_from": "/c"})
        assert member.word(10) == {"attempt": 1, "nodes": 2, "node_rank": 1,
                                   "resume_from": "/c"}
    finally:
        member.close("finished")


def test_a_node_started_again_waits_to_be_taken_in(coordinator):
    first = Member("127.0.0.1", coordinator.port, 1, 10)
    assert first.word(10)["attempt"] == 0
    first.closed.set()
    first.conn.shutdown(socket.SHUT_RDWR)
    coordinator.begin(1, [0])  # the job went on without node 1
    again = Member("127.0.0.1", coordinator.port, 1, 10)
    try:
        assert again.word(0.5) == {"end": "node 0 said nothing within 0s"}  # no word yet
        with coordinator.changed:
            coordinator.changed.wait_for(lambda: 1 in coordinator.joining, timeout=10)
        assert coordinator.joined == [1] and coordinator.take_joining(room=3) == [1]
    finally:
        again.close("finished")


def test_node_0_closing_ends_a_waiting_node(coordinator):
    member = Member("127.0.0.1", coordinator.port, 1, 10)
    assert member.word(10)["attempt"] == 0
    coordinator.close()
    assert member.word(10) == {"end": "node 0 closed the job's connection"}
    member.close("finished")


def test_a_node_counted_gone_is_told_so_and_hung_up_on(coordinator):
    """A node stopped (SIGSTOP) long enough to be counted gone reads, once continued, that
    the job went on without it: it ends rather than rejoin with a stale view."""
    member = Member("127.0.0.1", coordinator.port, 1, 10)
    try:
        assert member.word(10)["attempt"] == 0
        coordinator.send_away(1, "counted gone (silence)")
        assert member.word(10) == {"end": "counted gone (silence)", "away": True}
        assert member.word(10) == {"end": "node 0 closed the job's connection"}
        with coordinator.changed:
            assert coordinator.changed.wait_for(lambda: coordinator.nodes[1].closed, timeout=10)
    finally:
        member.close("finished")
