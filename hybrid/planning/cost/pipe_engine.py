"""DeepSpeed's pipeline engine as 2021-22 runs drove it (Megatron-DeepSpeed: MT-NLG, BLOOM,
GPT-NeoX), priced term by term from its code (pure: no torch).

What it does beside Megatron-LM's own runs (``published.megatron_lm``), each with its source
in ``deepspeed/runtime/pipe/`` and its size on MT-NLG 530B at 2,240 GPUs (Smith et al. 2022:
t 8 x p 35 x d 8, 240 micro-batches of 1 x 2048 tokens a pipeline and step; ``docs/sweeps.md``
has the table):

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

ZeRO with a pipeline: the engine asserts stage < 2 (``PipelineEngine.__init__``).
"""

from __future__ import annotations

from hybrid.planning.cost.collectives import ring_all_reduce
from hybrid.planning.cost.devices import Device
from hybrid.planning.cost.stage_time import link_for

TIED_GRAD_BYTES = 2
"""The fp16 optimizer reduces ``weight.grad`` (16 bits); the BF16 optimizer (2022) its
32-bit ``_hp_grad``."""


ENGINE_TERMS = dict(p2p_scatter_gather=True, dp_one_collective=False, p2p_meta_messages=1,
                    p2p_restore_gather=True, tied_after_backward=True)
"""The ``Device`` fields above, as the engine sets them on Megatron-DeepSpeed's layers
(Megatron-LM's attention and mixed-precision step: ``software.deepspeed_pipe``)."""


def tied_grads_s(plan, device: Device) -> float:
    """The exposed all-reduce of the tied embedding's gradient between the first and last
    stage (0 unless ``device.tied_after_backward``, the embedding tied and pipelined)."""
    m, layout = plan.cfg.model, plan.layout
    if not device.tied_after_backward or not m.tie_embeddings or layout.pp == 1:
        return 0.0
    nbytes = m.padded_vocab // layout.tp * m.hidden * TIED_GRAD_BYTES
    return ring_all_reduce(nbytes, 2, link_for(plan, device, "pp"))
