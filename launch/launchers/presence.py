"""Who is still there: the line each node's ``hybrid-train`` keeps open to node 0's during an
elastic job (``launcher.min_nodes``; the protocol is in ``launch/launchers/elastic.py``).

Node 0 runs a ``Coordinator``: a listening socket on a free port of its own, whose number it
publishes in the job's store (the rendezvous store at ``launcher.rdzv_endpoint``, which node 0
keeps for the whole job). Every other node runs a ``Member``: it connects, says ``hello``,
then beats every ``BEAT_S`` from a thread, and says ``ready`` when its attempt failed and
``bye`` when it ends. So node 0 can tell why a node left: it said ``bye`` (exit), its
connection closed without a word (the process died: a signal such as SIGKILL), or it has
not been heard for ``launcher.silence_timeout_s`` (stopped, hung or cut off: silence).
Messages are JSON lines.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

BEAT_S = 0.5
"""How often a member says it is alive (much shorter than any sensible silence timeout)."""


@dataclass
class NodeState:
    """What node 0 knows of one node."""

    conn: socket.socket
    last_heard: float = field(default_factory=time.monotonic)
    closed: bool = False
    bye: Optional[str] = None
    ready: int = -1
    """The last attempt whose end this node reported (it waits for node 0's word)."""
    failure: str = ""


def _send(conn: socket.socket, message: dict) -> bool:
    try:
        conn.sendall((json.dumps(message) + "\n").encode())
        return True
    except OSError:
        return False


def _hang_up(conn: socket.socket) -> None:
    """Close ``conn`` for both ends now (a reader thread's file object would keep a plain
    ``close`` from reaching the peer)."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.close()


def _lines(conn: socket.socket):
    """The JSON messages arriving on ``conn`` until it closes."""
    with conn.makefile("r", encoding="utf-8", errors="replace") as stream:
        try:
            for line in stream:
                try:
                    yield json.loads(line)
                except ValueError:
                    continue
        except OSError:
            return


class Coordinator:
    """Node 0's side: who said what, and when each node was last heard."""

    def __init__(self, silence_s: float, nnodes: int, on_join: Callable[[int], None]):
        self.silence_s, self.on_join = silence_s, on_join
        self.attempt, self.members = 0, set(range(nnodes))
        self.joining: list[int] = []
        """Nodes that came (back) during an attempt they are not in: taken in at the next
        checkpoint (``on_join`` asks the running workers to stop there)."""
        self.server = socket.create_server(("", 0))
        self.port = self.server.getsockname()[1]
        self.nodes: dict[int, NodeState] = {}
        self.changed = threading.Condition()
        threading.Thread(target=self._accept, daemon=True, name="hybrid-presence").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        node = None
        for message in _lines(conn):
            with self.changed:
                if "hello" in message:
                    node = int(message["hello"])
                    again = node in self.nodes  # started again: it waits to be taken in
                    self.nodes[node] = NodeState(conn=conn)
                    self._welcome(node, again)
                elif node is not None:
                    state = self.nodes[node]
                    state.last_heard = time.monotonic()
                    if "ready" in message:
                        state.ready, state.failure = int(message["ready"]), message.get("failure", "")
                    if "bye" in message:
                        state.bye = str(message["bye"])
                self.changed.notify_all()
        with self.changed:
            if node is not None and self.nodes[node].conn is conn:  # not a newer connection's
                self.nodes[node].closed = True
            self.changed.notify_all()

    def _welcome(self, node: int, again: bool) -> None:
        """Attempt 0's nodes start at once; a node that comes later waits to be taken in."""
        if self.attempt == 0 and node in self.members and not again:
            _send(self.nodes[node].conn, {"attempt": 0, "nodes": len(self.members),
                                          "node_rank": node, "resume_from": None})
        elif node not in self.joining:
            self.joining.append(node)
            self.on_join(node)

    def begin(self, attempt: int, members: list[int]) -> None:
        """``attempt`` starts with ``members``; nodes still waiting are asked for again."""
        with self.changed:
            self.attempt, self.members = attempt, set(members)
            self.joining = [n for n in self.joining if n not in self.members]
            for node in self.joining:
                self.on_join(node)

    def take_joining(self, room: int) -> list[int]:
        """Up to ``room`` of the nodes waiting to come in, the lowest first, still there."""
        with self.changed:
            there = sorted(n for n in self.joining if self.why_gone(n) is None)
            return there[:max(0, room)]

    def why_gone(self, node: int) -> Optional[str]:
        """Why ``node`` is gone (exit, signal, silence), or None while it is there. Call with
        ``changed`` held."""
        state = self.nodes.get(node)
        if state is None:
            return "it never connected to node 0"
        if state.bye is not None:
            return f"it exited ({state.bye})"
        if state.closed:
            return ("its hybrid-train died without a word (killed by a signal, e.g. SIGKILL, "
                    "or its machine went down)")
        silent = time.monotonic() - state.last_heard
        if silent >= self.silence_s:
            return (f"silence: not heard for {silent:.0f}s (launcher.silence_timeout_s="
                    f"{self.silence_s:g}; stopped, hung or cut off)")
        return None

    def regroup(self, attempt: int, others: list[int], wait_s: float
                ) -> tuple[list[int], dict[int, str]]:
        """Wait (at most ``wait_s``) until each of ``others`` reported the end of ``attempt``
        or is gone; returns (the nodes ready to go on, {gone node: why})."""
        deadline = time.monotonic() + wait_s
        with self.changed:
            while True:
                ready = [n for n in others if n in self.nodes and self.nodes[n].ready >= attempt
                         and self.why_gone(n) is None]
                gone = {n: why for n in others if n not in ready
                        for why in [self.why_gone(n)] if why is not None}
                left = deadline - time.monotonic()
                if len(ready) + len(gone) == len(others) or left <= 0:
                    for n in others:
                        if n not in ready and n not in gone:
                            gone[n] = f"it did not report the end of attempt {attempt} within " \
                                      f"{wait_s:.0f}s"
                    return ready, gone
                # Woken by every message; the timeout re-checks silences as they grow.
                self.changed.wait(min(left, BEAT_S))

    def tell(self, node: int, message: dict) -> None:
        with self.changed:
            state = self.nodes.get(node)
        if state is not None:
            _send(state.conn, message)

    def send_away(self, node: int, why: str) -> None:
        """Tell ``node``, counted gone, that the job went on without it, and hang up: a node
        that was only stopped (SIGSTOP) and continues later ends on reading this, in one
        line, instead of rejoining with a stale view of the job."""
        with self.changed:
            state = self.nodes.get(node)
        if state is not None and not state.closed:
            _send(state.conn, {"end": why, "away": True})
            _hang_up(state.conn)

    def close(self) -> None:
        self.server.close()
        with self.changed:
            for state in self.nodes.values():
                _hang_up(state.conn)


class Member:
    """A node's side (node > 0): beats until closed; reports the end of an attempt and waits
    for node 0's word."""

    def __init__(self, host: str, port: int, node: int, timeout_s: float):
        self.conn = socket.create_connection((host, port), timeout=timeout_s)
        self.conn.settimeout(None)
        self.node = node
        self.replies: list[dict] = []
        self.changed = threading.Condition()
        self.closed = threading.Event()
        self.lock = threading.Lock()
        self._say({"hello": node})
        threading.Thread(target=self._beat, daemon=True, name="hybrid-beat").start()
        threading.Thread(target=self._listen, daemon=True, name="hybrid-listen").start()

    def _say(self, message: dict) -> bool:
        with self.lock:
            return _send(self.conn, message)

    def _beat(self) -> None:
        while not self.closed.wait(BEAT_S):
            if not self._say({"beat": 1}):
                return

    def _listen(self) -> None:
        for message in _lines(self.conn):
            with self.changed:
                self.replies.append(message)
                self.changed.notify_all()
        with self.changed:
            self.replies.append({"end": "node 0 closed the job's connection"})
            self.changed.notify_all()

    def report_end(self, attempt: int, failure: str, wait_s: float) -> dict:
        """Tell node 0 that ``attempt`` ended here (``failure``: its line); node 0's word."""
        self._say({"ready": attempt, "failure": failure})
        return self.word(wait_s)

    def word(self, wait_s: Optional[float]) -> dict:
        """Node 0's next word: ``{"attempt": n, "nodes": k, "node_rank": r, "resume_from":
        path}`` or ``{"end": why}``; ``wait_s`` None: until node 0 speaks or closes."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        with self.changed:
            while not self.replies:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return {"end": f"node 0 said nothing within {wait_s:.0f}s"}
                self.changed.wait(left)
            return self.replies.pop(0)

    def close(self, why: str) -> None:
        self._say({"bye": why})
        self.closed.set()
        _hang_up(self.conn)
