"""Software profiles: what the training stack a prediction is for does (pure: no torch).

The same layout runs at different speeds on different software: how it reduces gradients,
whether its pipeline ranks wait for every exchange, what its optimizer step moves, and which
schedules, ZeRO stages and splits it can run at all. ``cost.software`` names one of
``SOFTWARE``; ``hybrid-plan`` prices the plan on the device as that software drives it
(``Software.device``), names it in every prediction, and its search offers only what that
software can run (``Software.allows``). Each profile is a frozen set of facts with its
sources; none is fitted to a training run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from hybrid.errors import UserError
from hybrid.planning.cost.devices import Device
from hybrid.planning.cost.pipe_engine import engine_device
from hybrid.planning.cost.published import megatron_lm


class SoftwareError(UserError):
    """``cost.software`` names no known profile."""


@dataclass(frozen=True)
class Software:
    name: str
    summary: str
    """One line of what the profile prices, printed with every prediction."""
    pricing: Callable[[Device, int], Device]
    """The device as this software drives it, for a layout of ``pp`` pipeline stages."""
    schedules: Optional[tuple[str, ...]] = None
    """The pipeline schedules it runs (None: every registered one)."""
    zero_stages: Optional[tuple[int, ...]] = None
    """The ZeRO stages it runs with data parallelism (None: every searched one)."""
    zero_stages_pipelined: Optional[tuple[int, ...]] = None
    """Of those, the ones it runs with a pipeline too (None: all of them)."""
    recompute: Optional[tuple[str, ...]] = None
    """The ``model.recompute`` modes it offers (None: all)."""
    sequence_parallel: bool = True
    context_parallel: bool = True

    def device(self, device: Device, pp: int) -> Device:
        """``device`` as this software drives it on a layout of ``pp`` stages."""
        return self.pricing(device, pp)

    def allows(self, key: str, value) -> bool:
        """Whether this software can run a layout whose setting ``key`` (a search settings
        key: ``schedule``, ``zero``, ``recompute``, ``sequence_parallel``, ``cp``) is
        ``value``."""
        if key == "schedule":
            return self.schedules is None or value in self.schedules
        if key == "zero":
            return self.zero_stages is None or value in self.zero_stages
        if key == "recompute":
            return self.recompute is None or value in self.recompute
        if key == "sequence_parallel":
            return self.sequence_parallel or not value
        if key == "cp":
            return self.context_parallel or value == 1
        return True


    def allows_zero(self, stage: int, pp: int) -> bool:
        """Whether it runs ZeRO ``stage`` on a layout of ``pp`` pipeline stages."""
        return self.allows("zero", stage) and (
            pp == 1 or self.zero_stages_pipelined is None
            or stage in self.zero_stages_pipelined)


def _as_is(device: Device, pp: int) -> Device:
    return device


def _megatron_lm_2021(device: Device, pp: int) -> Device:
    # run_table_1.sh pairs PyTorch's DDP with runs without a pipeline and its ``local`` DDP
    # with the pipelined ones: its 2021 pipeline schedules had no ``no_sync`` for PyTorch's
    return megatron_lm(device, torch_ddp=pp == 1, fp16=True)


HYBRID = Software(
    name="hybrid", pricing=_as_is,
    summary="hybrid's own runtime: fused attention, non-blocking pipeline exchanges, DP "
            "buckets reduced during the backward, Adam's 28 bytes a parameter")
"""hybrid's runtime as this repository builds it: every schedule, ZeRO stage, sequence and
context parallelism and recompute mode the search knows."""

MEGATRON_LM_2021 = Software(
    name="megatron-lm-2021", pricing=_megatron_lm_2021,
    schedules=("1f1b", "interleaved-1f1b"), zero_stages=(0,), recompute=("none", "full"),
    sequence_parallel=False, context_parallel=False,
    summary="Megatron-LM as Narayanan et al. 2021 ran it: unfused attention scores, blocking "
            "pipeline exchanges scattered over the NICs, local DDP after the last backward "
            "(PyTorch's DDP without a pipeline), the fp16 mixed-precision step")
"""Megatron-LM as ``examples/sc21/run_table_1.sh`` ran it (``published.megatron_lm``,
``held_out.software_2021``): 1F1B or its interleaved schedule
(``get_forward_backward_func``); no distributed optimizer (ZeRO came to Megatron-LM in 2022);
``--checkpoint-activations`` or nothing (selective recompute and sequence parallelism are
Korthikanti et al. 2022); no context parallelism (2023)."""

def deepspeed_pipe(device: Device) -> Device:
    """``device`` as DeepSpeed's pipeline engine drives it (``pipe_engine.ENGINE_TERMS``) on
    Megatron-DeepSpeed's layers (Megatron-LM's attention and mixed-precision step)."""
    return engine_device(megatron_lm(device))


def _deepspeed_pipe(device: Device, pp: int) -> Device:
    return deepspeed_pipe(device)


DEEPSPEED_PIPE = Software(
    name="deepspeed-pipe", pricing=_deepspeed_pipe,
    schedules=("1f1b",), zero_stages_pipelined=(0, 1), recompute=("none", "full"),
    sequence_parallel=False, context_parallel=False,
    summary="DeepSpeed's pipeline engine under Megatron-DeepSpeed (2021-22): lock-step 1F1B, "
            "blocking exchanges in series, partitioned over the TP group with their meta sent "
            "apart, each gather's copies, the sent output gathered back for the backward, "
            "16-bit gradients accumulated in place, tied embeddings and DP reduced after the "
            "last backward, the fp16 step, Megatron-LM's unfused attention")
"""DeepSpeed's ``PipelineEngine`` as MT-NLG, BLOOM and GPT-NeoX ran it
(``deepspeed_pipe``; ``pipe_engine`` prices each term from its code): its ``TrainSchedule`` only
(no interleaving, no zero-bubble split); ZeRO ≤ 1 with a pipeline (its engine asserts it);
Megatron-DeepSpeed's ``--checkpoint-activations`` or nothing; no sequence or context
parallelism (they came to Megatron-DeepSpeed in 2023)."""

SOFTWARE = {s.name: s for s in (HYBRID, MEGATRON_LM_2021, DEEPSPEED_PIPE)}


def software_named(name: str) -> Software:
    """The profile ``cost.software`` names; an unknown name is refused in one line."""
    if name not in SOFTWARE:
        raise SoftwareError(f"cost.software={name!r} is unknown; choose one of "
                            f"{', '.join(SOFTWARE)}")
    return SOFTWARE[name]
