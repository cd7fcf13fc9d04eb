"""Per-step metrics: ``metrics.jsonl``, TensorBoard events, and a progress display on rank 0.

Only rank 0 writes; the values it writes were already reduced over the job by the loop.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

from hybrid.files import JsonLines

REQUIRED_KEYS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s",
                 "comm_bytes", "peak_mem_bytes")


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory on CUDA; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


class MetricsWriter:
    """Writes one JSON object per step and mirrors scalars to TensorBoard.

    A resumed run (``first_step > 1``) appends to ``metrics.jsonl``: after an elastic restart
    the file holds the steps of the failed attempt too, and the last record of a step is the
    one that counts.
    """

    def __init__(self, run_dir: Path, total_steps: int, *, enabled: bool,
                 log_every: int = 1, stream: Any = None, first_step: int = 1) -> None:
        self.enabled = enabled
        self.total_steps = total_steps
        self.first_step = first_step
        self.log_every = max(1, log_every)
        self.stream = stream or sys.stdout
        self._jsonl = None
        self._tb = None
        self._bar = None
        self._last_eval: Optional[str] = None
        self._started = time.monotonic()
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._jsonl = JsonLines(self.path, append=first_step > 1)
        self._tb = _tensorboard_writer(run_dir / "tensorboard")
        if self.stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=first_step - 1, file=self.stream,
                             unit="step", dynamic_ncols=True)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        missing = [k for k in REQUIRED_KEYS if k not in record]
        assert not missing, f"metrics record lacks {missing}"
        self._jsonl.append(record)
        if self._tb is not None:
            for key, value in _flatten(record).items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])
        self._show(record)

    def _show(self, r: dict) -> None:
        if self._bar is not None:
            shown = {"loss": f"{r['loss']:.4f}", "tok_s": f"{r['tokens_per_s']:.0f}"}
            if "eval_loss" in r:
                self._last_eval = f"{r['eval_loss']:.4f}"
            if self._last_eval is not None:
                shown["eval_loss"] = self._last_eval
            self._bar.set_postfix(shown)
            self._bar.update(1)
            return
        if r["step"] % self.log_every == 0 or r["step"] == self.total_steps:
            elapsed = time.monotonic() - self._started
            done = r["step"] - self.first_step + 1
            eta = elapsed / done * (self.total_steps - r["step"])
            mfu = f"  mfu {r['mfu']:.2%}" if "mfu" in r else ""
            print(f"step {r['step']:>5}/{self.total_steps}  loss {r['loss']:.4f}  "
                  f"lr {r['lr']:.2e}  grad_norm {r['grad_norm']:.3f}  "
                  f"tokens/s {r['tokens_per_s']:,.0f}  step {r['step_time_s'] * 1000:.0f} ms  "
                  f"TFLOP/s/device {r.get('model_tflops_per_device', 0):.3g}{mfu}  "
                  f"eta {eta:.0f}s", file=self.stream, flush=True)
        if "eval_loss" in r:  # next to the training loss of the same step
            print(f"step {r['step']:>5}/{self.total_steps}  eval_loss {r['eval_loss']:.4f}  "
                  f"eval_ppl {r['eval_ppl']:.2f}  ({r['eval_tokens']:,} tokens, "
                  f"{r['eval_s']:.1f} s)  train loss {r['loss']:.4f}", file=self.stream,
                  flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()


def _tensorboard_writer(path: Path) -> Optional[Any]:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is a dependency, but metrics must not die without it
        return None
    return SummaryWriter(log_dir=str(path))


def _flatten(record: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "/"))
        else:
            flat[name] = value
    return flat


def read_metrics(path: Path) -> list[dict]:
    """All records of a ``metrics.jsonl`` file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
