"""docs/models.md's three-command walkthrough, run exactly as written: a tiny Llama 3.2-shaped
model saved as the hub ships it (shards, rope_scaling llama3, a tokenizer.json), fine-tuned
with ``model.from_hf`` at 64 of its 256 positions on text tokenized with its own tokenizer,
then ``hybrid-generate`` at ``context=256`` decoding with it."""

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "models.md"

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]


def walkthrough() -> str:
    block = re.search(r"<!-- walkthrough -->\n```bash\n(.*?)```", DOC.read_text(), re.S)
    assert block, "docs/models.md lost its walkthrough"
    return block[1]


def test_the_walkthrough_fine_tunes_and_generates_with_the_models_tokenizer(tmp_path,
                                                                           user_cache):
    commands = walkthrough().strip().splitlines()
    assert len(commands) == 3
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", walkthrough()], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=380)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(list((tmp_path / "llama3.2").glob("model-*-of-*.safetensors"))) >= 2
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["config"]["model"]["seq_len"] == 64
    assert plan["config"]["model"]["family"] == "llama"
    tokenizer = plan["tokenizer"]  # the folder's, which the data was tokenized with
    assert (tokenizer["kind"], tokenizer["vocab_size"]) == ("hf", 512)
    assert Path(tokenizer["source"]) == (tmp_path / "llama3.2").resolve()
    assert plan["data_prefixes"][0].endswith(tokenizer["sha256"][:12])  # python-docs, with it
    carried = (tmp_path / "run" / "tokenizer.json").read_text()
    assert hashlib.sha256(carried.encode()).hexdigest() == tokenizer["sha256"]
    text = done.stdout.strip().splitlines()[-1]
    assert text.startswith("The list") and len(text) > len("The list")
