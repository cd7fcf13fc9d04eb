"""A config.json that no registered family can read ends ``hybrid-ckpt import`` in one line,
exit status 2, before any weight is read (they were tracebacks: a list for an object, a
missing size, a size that is not a number). The config is refused before the weights file,
which is left empty here."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

CKPT = str(Path(sys.executable).parent / "hybrid-ckpt")
GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_head": 4, "n_layer": 2, "n_positions": 32,
        "vocab_size": 300}

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("config, needle", [
    ([1, 2], "config.json holds a list, not an object of settings"),
    ({"model_type": "llama"}, "config.json has no 'hidden_size', which a llama config needs"),
    ({"hidden_size": 32}, "config.json has no model_type, so no family can read it; the "
                          "registered model_types are gpt2, llama, mistral, mixtral, qwen2, "
                          "qwen2_moe, qwen3, qwen3_moe"),
    ({"model_type": "mixtral", "hidden_size": 32},
     "config.json has no 'num_attention_heads', which a mixtral config needs"),
    ({"model_type": "gpt2"}, "config.json has no 'n_embd', which a gpt2 config needs"),
    ({**GPT2, "n_embd": "x"}, "n_embd='x' must be a whole number >= 1"),
    ({**GPT2, "n_layer": 0}, "n_layer=0 must be a whole number >= 1"),
    ({**GPT2, "n_head": True}, "n_head=True must be a whole number >= 1"),
])
def test_a_config_no_family_can_read_is_one_line(config, needle, tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(config))
    (source / "model.safetensors").write_bytes(b"")
    done = subprocess.run([CKPT, "import", str(source), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(done.stderr.strip().splitlines()) == 1 and needle in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()
