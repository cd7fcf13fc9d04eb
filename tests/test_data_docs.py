"""docs/data.md's worked example, run exactly as written: real English text (CPython's own
documentation) and CPython's library sources, a trained BPE, two indexed data sets blended and
split, and the main job's layout training on them with a falling loss."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.metrics import read_metrics

DOC = Path(__file__).resolve().parent.parent / "docs" / "data.md"

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]


def worked_example() -> str:
    text = DOC.read_text()
    block = re.search(r"<!-- worked-example -->\n```bash\n(.*?)```", text, re.S)
    assert block, "docs/data.md lost its worked example"
    return block[1]


def test_the_worked_example_trains_and_the_loss_falls(tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", worked_example()], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=380)
    assert done.returncode == 0, done.stderr[-3000:]
    for prefix in ("topics", "code"):
        assert (tmp_path / f"{prefix}.bin").is_file() and (tmp_path / f"{prefix}.idx").is_file()
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[0] == pytest.approx(math.log(512), abs=0.15)  # a fresh model's guess
    # Well below a unigram model of this text (5.3 nats: the blend's token frequencies), on
    # the training and on the held-out documents.
    assert len(losses) == 60 and losses[-1] < 4.8
    assert [r["eval_loss"] for r in records if "eval_loss" in r][-1] < 4.8
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}", done.stdout[-600:])
