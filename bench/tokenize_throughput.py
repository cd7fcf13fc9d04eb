"""hybrid-data's tokens/s against HF tokenizers' own ``encode_batch``, and the data loader's
share of a training step on indexed data.

    .venv/bin/python bench/tokenize_throughput.py [--mb 8] [--workers 2] [--rounds 3]
    .venv/bin/python bench/tokenize_throughput.py --smoke   # the smallest run (the test suite's)

The corpus is real text every Python carries: CPython's documentation topics and its library
sources, as JSON Lines (one document per topic or file) up to ``--mb`` MB. Both sides use
GPT-2's BPE as HF ``tokenizers`` builds it from the same files, one core each
(``TOKENIZERS_PARALLELISM=false``):

- the library: ``Tokenizer.encode_batch`` (and ``encode_batch_fast``, which skips offsets) on
  the documents already in memory, in this process: CPU seconds of the call alone;
- hybrid-data: the whole command (start-up, reading and parsing the JSONL, tokenizing, writing
  ``.bin``/``.idx`` and the record atomically), with 1 and ``--workers`` processes: CPU
  seconds of the command and all its workers.

"s/Mtok/core" is CPU seconds per million tokens, the cost on one core; the best of
``--rounds``. Then ``hybrid-train`` trains the main job (DP 2 x TP 2 x PP 2, model small) on
the tokenized corpus for ``--steps`` steps and reports ``data_s`` (building a rank's
micro-batches from megatron-core's GPTDataset/BlendedDataset) over the step's wall time
(target <= 2%). The last line is ``ratio=<hybrid-data's s/Mtok/core with 1 worker /
encode_batch's>`` (target <= 1.1).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core: the library's threads would not be
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hybrid.data.tokenizer import gpt2_tokenizer  # noqa: E402
from hybrid.metrics import read_metrics  # noqa: E402

BIN = Path(sys.executable).parent


def corpus(folder: Path, megabytes: float) -> tuple[Path, list[str]]:
    import pydoc_data.topics

    texts = list(pydoc_data.topics.topics.values())
    for path in sorted(Path(os.__file__).parent.rglob("*.py")):
        texts.append(path.read_text(encoding="utf-8", errors="replace"))
        if sum(map(len, texts)) > megabytes * 1e6:
            break
    path = folder / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path, texts


def library_seconds(texts: list[str], method: str, rounds: int) -> tuple[float, int]:
    """(best CPU seconds of one call, tokens): GPT-2's end-of-document id is added per
    document, as hybrid-data does."""
    tokenizer = gpt2_tokenizer()
    tokenizer.encode_special_tokens = True  # text is literal, as in hybrid-data
    best, tokens = float("inf"), 0
    for _ in range(rounds):
        start = time.process_time()
        encoded = getattr(tokenizer, method)(texts, add_special_tokens=False)
        best = min(best, time.process_time() - start)
        tokens = sum(len(e.ids) + 1 for e in encoded)
    return best, tokens


def hybrid_data_seconds(source: Path, folder: Path, workers: int,
                        rounds: int) -> tuple[float, float, int]:
    """(best CPU seconds, its wall seconds, tokens) of the whole hybrid-data command."""
    best = (float("inf"), 0.0)
    for attempt in range(rounds):
        out = folder / f"out-{workers}-{attempt}"
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run([str(BIN / "hybrid-data"), str(source), str(out), "--tokenizer",
                               "gpt2", "--format", "indexed", "--workers", str(workers),
                               "--quiet"], capture_output=True, text=True)
        wall = time.perf_counter() - start
        assert done.returncode == 0, done.stderr
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        best = min(best, (cpu, wall))
    tokens = json.loads(Path(f"{out}.meta.json").read_text())["tokens"]
    return best[0], best[1], tokens


def loader_share(prefix: Path, folder: Path, steps: int, job: list[str]) -> tuple[float, float]:
    """(median data_s, median step_time_s) of the job (``job``: overrides of the main job)
    trained on ``prefix``."""
    run_dir = folder / "run"
    done = subprocess.run([str(BIN / "hybrid-train"), *job, "data=indexed", f"data.path={prefix}",
                           "data.split=[99,1,0]", "model.vocab=50257", f"train.steps={steps}",
                           "train.timeline_step=0", f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    records = read_metrics(run_dir / "metrics.jsonl")[2:]  # after warm-up
    return (statistics.median(r["data_s"] for r in records),
            statistics.median(r["step_time_s"] for r in records))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=8.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="the smallest run (the test "
                        "suite's): 0.05 MB, 1 worker, 1 round, the loader on 1 process of a "
                        "tiny model for 3 steps; its figures mean nothing")
    args = parser.parse_args()
    job, job_name = [], "main job, 2x2x2"
    if args.smoke:  # what the command line gave explicitly stays
        args = parser.parse_args(namespace=argparse.Namespace(mb=0.05, workers=1, rounds=1,
                                                              steps=3))
        job, job_name = (["parallel=single", "model=tiny", "train.global_batch=2",
                          "train.micro_batch=1"], "1 process, model tiny, batch 2")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        source, texts = corpus(folder, args.mb)
        print(f"corpus: {len(texts)} documents, {source.stat().st_size / 1e6:.1f} MB of JSONL")
        print(f"{'method':<34} {'tokens':>10} {'wall s':>8} {'CPU s':>8} {'s/Mtok/core':>12}")
        rows = {}
        for method in ("encode_batch", "encode_batch_fast"):
            cpu, tokens = library_seconds(texts, method, args.rounds)
            rows[method] = cpu / tokens * 1e6
            print(f"{'tokenizers ' + method:<34} {tokens:>10} {'':>8} {cpu:>8.2f} "
                  f"{rows[method]:>12.3f}")
        for workers in sorted({1, args.workers}):
            cpu, wall, tokens = hybrid_data_seconds(source, folder, workers, args.rounds)
            rows[workers] = cpu / tokens * 1e6
            name = f"hybrid-data, {workers} worker{'s' * (workers > 1)} (whole command)"
            print(f"{name:<34} {tokens:>10} {wall:>8.2f} {cpu:>8.2f} {rows[workers]:>12.3f}")
        data_s, step_s = loader_share(folder / "out-1-0", folder, args.steps, job)
        print(f"\ndata loader on indexed data ({job_name}, GPT-2 vocabulary): "
              f"{data_s * 1e3:.2f} ms of a {step_s * 1e3:.0f} ms step = "
              f"{data_s / (data_s + step_s):.2%} (target <= 2%)")
        print(f"hybrid-data / encode_batch_fast: {rows[1] / rows['encode_batch_fast']:.3f}")
        print(f"ratio={rows[1] / rows['encode_batch']:.3f} (hybrid-data s/Mtok/core, 1 worker / "
              f"tokenizers encode_batch; target <= 1.1)")


if __name__ == "__main__":
    main()
