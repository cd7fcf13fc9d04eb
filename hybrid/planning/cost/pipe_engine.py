"""DeepSpeed's pipeline engine as 2021-22 runs drove it (Megatron-DeepSpeed: MT-NLG, BLOOM,
GPT-NeoX), priced term by term from its code (pure: no torch).

What it does beside Megatron-LM's own runs (``published.megatron_lm``), each with its source
in DeepSpeed 0.5.10 (January 2022, the engine MT-NLG's 2021 code grew into; the BF16
optimizer read in 0.7.0) and its size on MT-NLG 530B at 2,240 GPUs (Smith et al. 2022: t 8 x
p 35 x d 8, 240 micro-batches of 1 x 2048 tokens a pipeline and step; ``docs/sweeps.md`` has
the table):

- *The same lock-step 1F1B.* ``schedule.TrainSchedule`` alternates forward and backward
  steps, even and odd stages out of phase, each exchange a blocking ``p2p.send``/``recv``
  (``dist.send``, or a 2-rank ``broadcast`` before torch 1.8): its makespan is 1F1B's, with
  equal stages and with heavier first and last ones (``tests/test_pipe_engine.py`` simulates
  its command lists), so it is priced as 1F1B with blocking exchanges
  (``Device.blocking_p2p``) and the search offers it nothing else.
- *Activations partitioned over the TP group* (``pipe_partitioned``, ``grad_partitioned``:
  on by default whenever TP > 1): ``_exec_forward_pass`` and ``_exec_send_grads`` cut the
  tensor into ``1 / tp`` slices (``PartitionedTensor``), each TP rank sends its own over its
  NIC and the receiver gathers it (``part.full()``): Megatron-LM's scatter/gather
  (``p2p_scatter_gather``). Per message 0.88 ms, where sending it whole took 4.2 ms: the
  step 1.7 s shorter.
- *The sent output gathered back for the backward* (``_exec_backward_pass``:
  ``part_output.full()``, the output's storage having been freed after the send): one more
  gather of ``b·s·h`` over NVLink per backward exchange (``p2p_restore_gather``): 0.35 ms,
  the step 0.09 s longer.
- *Each tensor's meta sent on its own* (``outputs = (part.to_meta(), part.data(), ...)``,
  one blocking ``p2p.send`` each): one more message latency per exchange
  (``p2p_meta_messages``): 10 us, 6 ms a step. Until PR #4360 (2023) the receiver read it back
  to the host (``PartitionedTensor.from_meta``: ``meta.tolist()``), a device-to-host
  synchronisation per exchange; its cost is the launch gap after it (the next kernels are
  milliseconds long at this size), not priced.
- *Tied embedding gradients* (``_exec_reduce_tied_grads``, before ``ReduceGrads`` at the last
  step): the word embedding's gradient all-reduced between the first and last stage,
  ``V / t x h`` at 2 bytes, after the last backward (``tied_after_backward``): 13 ms a step.
- *Gradients reduced after the last backward, in buckets* (``_exec_reduce_grads``:
  ``allreduce_gradients(bucket_size=MEMORY_OPT_ALLREDUCE_SIZE)``; ZeRO-1's
  ``reduce_gradients`` likewise): Megatron-LM's ``local`` DDP's timing, not its one buffer
  (priced in ``parallel.bucket_mb``'s buckets; its 5e8 elements would save 20 ms of ring
  latency on MT-NLG).

- *A step's two exchanges with a neighbour in series* (``TrainSchedule``: ``SendGrad`` then
  ``RecvActivation``, ``RecvGrad`` then ``SendActivation``; each a blocking ``dist.send`` or
  ``recv`` on the pair's one communicator and stream), where Megatron-LM batches them
  (``batch_isend_irecv``): a message's wire time more on each forward and backward
  (``p2p_exchanges_in_series``): 0.53 ms, the step 0.30 s longer.
- *The gathers' memory passes* (``PartitionedTensor.full``: ``GATHER_PASSES``) on each
  tensor gathered, three a micro-batch (``p2p_gather_passes``): 0.23 ms each, +0.19 s.
- *16-bit gradients accumulated in place* (``ACCUMULATE_16BIT_BYTES``): 6 bytes a parameter a
  micro-batch where the model prices 12: -6.6 ms a micro-batch on the last stage, the step
  1.8 s shorter. (The BF16 optimizer of 2022, ``bf16_optimizer.update_hp_grads``, adds each
  micro-batch's gradient to a 32-bit copy, 18 bytes (``BF16_ACCUMULATE_BYTES``), and reduces
  that copy in 32 bits: priced for BLOOM's held-out row, ``held_out.BLOOM_2022``.)
- *The fp16 step and the DP all-reduce's copies* (``FP16_STEP_BYTES``,
  ``ALLREDUCE_FALLBACK_BYTES``): 82 bytes a parameter where Megatron-LM's step and ``local``
  DDP move 50: +0.04 s.

Read and not priced, each bounded on MT-NLG: the GPU's queue is empty at every step
boundary (``ThroughputTimer.start``, called by ``_exec_forward_pass``, runs
``torch.cuda.synchronize()`` before every forward; ``to_meta`` copies its host list to the
device with a blocking copy before every send; ``from_meta`` reads the received meta back),
so each boundary exposes the host's path to the next kernel, a few launches of ~3 us
(``devices.KERNEL_S``) and their Python: at 0.2 ms a boundary (assumed, not measured here),
0.1 s a step at two boundaries a slot; the per-parameter overflow check's host reads
(``has_overflow_serial``), a few dozen a step.

ZeRO with a pipeline: the engine asserts stage < 2 (``PipelineEngine.__init__``).
"""

from __future__ import annotations

from dataclasses import replace

from hybrid.planning.cost.collectives import ring_all_reduce
from hybrid.planning.cost.devices import Device
from hybrid.planning.cost.sizes import BYTES
from hybrid.planning.cost.stage_time import link_for

TIED_GRAD_BYTES = 2
"""The fp16 optimizer reduces ``weight.grad`` (16 bits); the BF16 optimizer (2022) its
32-bit ``_hp_grad``."""


GATHER_PASSES = 5
"""Memory passes over the whole activation in ``PartitionedTensor.full`` beside the NCCL
gather: the flat buffer zeroed (``torch.zeros``: write), ``dist.all_gather`` into a list
copying its flat result out to each slice (torch <= 1.10's ``ProcessGroupNCCL::allgather``:
read, write), and the result cloned (``.clone()``: read, write)."""

ACCUMULATE_16BIT_BYTES = 6
"""Each micro-batch's weight gradient added in place into the parameter's 16-bit ``.grad``
(read both, write one: 2 bytes each): DeepSpeed casts the module to 16 bits and keeps no
32-bit gradient buffer until the step (``FP16_Optimizer``; ZeRO-1's hooks reduce nothing
before ``_exec_reduce_grads``), where Megatron-LM adds it to a 32-bit ``main_grad`` (12)."""
BF16_ACCUMULATE_BYTES = 18
"""Bytes a parameter DeepSpeed's ``BF16_Optimizer`` (0.7.0, BLOOM's) moves each micro-batch:
``update_hp_grads`` adds the 16-bit ``.grad`` made 32-bit into a 32-bit copy (read 2, write
4, read 4, read 4, write 4)."""
FP16_STEP_BYTES = 70
"""Bytes a parameter ``FP16_Optimizer.step`` (``fp16/fused_optimizer.py``) moves: the
overflow check (``has_overflow_serial``: ``x.float().sum()``, read 2, write 4, read 4), the
gradients made 32-bit and flattened (read 2, write 4, read 4, write 4), their norm (read 4),
``unscale_and_clip_grads`` (read 4, write 4), Adam on the 32-bit master (28) and the master
copied back to the 16-bit model (read 4, write 2)."""
ALLREDUCE_FALLBACK_BYTES = 12
"""Bytes a parameter ``allreduce_bucket`` moves around the all-reduce: the bucket flattened
(read 2, write 2), divided by the group's size (read 2, write 2) and copied back (read 2,
write 2)."""

ENGINE_TERMS = dict(p2p_scatter_gather=True, dp_one_collective=False, p2p_meta_messages=1,
                    p2p_restore_gather=True, tied_after_backward=True,
                    p2p_exchanges_in_series=True, p2p_gather_passes=GATHER_PASSES,
                    grad_accumulate_bytes=ACCUMULATE_16BIT_BYTES)
"""The ``Device`` fields above, as the engine sets them on Megatron-DeepSpeed's layers
(Megatron-LM's attention: ``software.deepspeed_pipe``)."""


def engine_device(device: Device) -> Device:
    """``device`` (Megatron-LM's layers on it) as DeepSpeed's engine drives it: ``ENGINE_TERMS``
    and its optimizer step with the DP all-reduce's passes."""
    step = (FP16_STEP_BYTES + ALLREDUCE_FALLBACK_BYTES) / device.memory_bandwidth
    return replace(device, **ENGINE_TERMS, optimizer_s_per_param=step)


def tied_grads_s(plan, device: Device) -> float:
    """The exposed all-reduce of the tied embedding's gradient between the first and last
    stage (0 unless ``device.tied_after_backward``, the embedding tied and pipelined)."""
    m, layout = plan.cfg.model, plan.layout
    if not device.tied_after_backward or not m.tie_embeddings or layout.pp == 1:
        return 0.0
    nbytes = m.padded_vocab // layout.tp * m.hidden * TIED_GRAD_BYTES
    return ring_all_reduce(nbytes, 2, link_for(plan, device, "pp"))


def blocking_exchanges_s(plan, device: Device, message: float, gather: float
                         ) -> tuple[float, float]:
    """What a stage's forward and its backward each wait for at their exchanges when the
    software blocks on them (``Device.blocking_p2p``): the message (``gather`` of it the
    receiver's gather over the node), its wire time once more when the two exchanges with a
    neighbour run in series (``p2p_exchanges_in_series``), the gather's memory passes for each
    gathered tensor (``p2p_gather_passes``), and the backward's gather of what it sent
    (``p2p_restore_gather``)."""
    restore = gather if device.p2p_restore_gather else 0.0
    serial = message - gather if device.p2p_exchanges_in_series else 0.0
    copies = 0.0
    if gather and device.p2p_gather_passes and device.memory_bandwidth:
        cfg = plan.cfg
        whole = (cfg.train.micro_batch * cfg.model.seq_len // plan.layout.cp
                 * cfg.model.hidden * BYTES[cfg.train.precision])
        copies = device.p2p_gather_passes * whole / device.memory_bandwidth
    gathers_back = 2 if restore else 1  # the gradient received, and the output restored
    return (message + serial + copies,
            message + serial + restore + gathers_back * copies)
