"""The transport profile (``hybrid.transport``, DESIGN's "a transport profile built once with
the groups"): one profile per backend, what the runtime reads from it (the pipeline's RECV
look-ahead and send release, whether a tag-matched schedule may run, where a flag tensor
lives, the clock), and no branch on a backend's name left outside it."""

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hybrid.comm import Group
from hybrid.pipeline.runtime import prepare_rank, recv_lookahead
from hybrid.planning.schedules.actions import V_SHAPE
from hybrid.planning.schedules.rank_check import ScheduleError
from hybrid.transport import GLOO, NCCL, transport_for, transport_of

ROOT = Path(__file__).resolve().parent.parent


def _group(backend: str) -> Group:
    """A Group over a stand-in torch group: only its backend matters here."""
    pg = SimpleNamespace(size=lambda: 2, rank=lambda: 0)
    return Group(pg, [0, 1], "pp", backend)


def _groups(backend: str) -> SimpleNamespace:
    return SimpleNamespace(pipeline=_group(backend), pp_rank=0, device=torch.device("cpu"))


def test_each_backend_has_its_profile_and_another_is_a_bug():
    assert transport_for("gloo") is GLOO and transport_for("nccl") is NCCL
    assert transport_of(torch.device("cpu")) is GLOO
    assert transport_of(torch.device("cuda", 0)) is NCCL
    assert (GLOO.matches_tags, GLOO.recv_lookahead, GLOO.threaded_sends) == (True, 2, True)
    assert (NCCL.matches_tags, NCCL.recv_lookahead, NCCL.threaded_sends) == (False, 0, False)
    assert GLOO.tensor_device() == torch.device("cpu")
    GLOO.settle(torch.device("cpu"))  # nothing queued off CUDA: returns at once
    with pytest.raises(ValueError, match="'mpi' has no transport profile; hybrid runs on "
                                         "gloo or nccl"):
        transport_for("mpi")


def test_a_group_reads_its_profile_and_the_pipeline_its_look_ahead():
    assert _group("gloo").transport is GLOO and _group("nccl").transport is NCCL
    assert recv_lookahead(_groups("gloo")) == 2 and recv_lookahead(_groups("nccl")) == 0


def test_a_tag_matched_schedule_is_refused_on_a_transport_that_runs_messages_in_order():
    with pytest.raises(ScheduleError) as refused:
        prepare_rank([], {}, groups=_groups("nccl"), pp=2, vpp=2, m=4, placement=V_SHAPE)
    assert str(refused.value) == (
        f"the {V_SHAPE} placement's messages are matched by tag, which nccl does not do (it "
        f"runs them in the order issued); use a loop-placed schedule (zb-h1) on nccl")
    with pytest.raises(ScheduleError) as other:  # on gloo it goes on to the plan's own checks
        prepare_rank([], {}, groups=_groups("gloo"), pp=2, vpp=2, m=4, placement=V_SHAPE)
    assert "matched by tag" not in str(other.value)


def _backend_name_branches(path: Path) -> list[str]:
    """Comparisons with a backend's name ("gloo", "nccl") or a ``.backend`` attribute."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        names = {s.value for s in sides if isinstance(s, ast.Constant)} & {"gloo", "nccl"}
        attrs = [s for s in sides if isinstance(s, ast.Attribute) and s.attr == "backend"]
        if names or attrs:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_no_code_branches_on_a_backend_name_outside_the_profile():
    files = [p for package in ("hybrid", "launch") for p in sorted((ROOT / package).rglob("*.py"))
             if p.name != "transport.py"]
    assert [hit for path in files for hit in _backend_name_branches(path)] == []
