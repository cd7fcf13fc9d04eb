"""``hybrid-generate`` through the real command: settings out of range are one line before the
model loads; a damaged checkpoint and a prompt that encodes to nothing are one line; the text
streams as it comes, any finite temperature samples, and Ctrl-C stops it in one line with the
text so far kept on stdout."""

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
GENERATE = str(BIN / "hybrid-generate")
PROMPT = "The assert statement"

pytestmark = pytest.mark.timeout(180)


def generate(source, *settings) -> subprocess.CompletedProcess:
    return subprocess.run([GENERATE, str(source), *settings], capture_output=True, text=True,
                          timeout=150)


def assert_one_line(done: subprocess.CompletedProcess, needle: str) -> None:
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(done.stderr.strip().splitlines()) == 1 and needle in done.stderr, done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize("setting, needle", [
    ("max_new_tokens=1000000000", "max_new_tokens=1000000000 must be in 1..10,000"),
    ("max_new_tokens=0", "max_new_tokens=0 must be in 1..10,000"),
    ("temperature=-1", "temperature=-1.0 must be a finite number >= 0"),
    ("temperature=inf", "temperature=inf must be a finite number >= 0"),
    ("seed=-1", "seed=-1 must be an integer in 0..18,446,744,073,709,551,615"),
    ("seed=18446744073709551616", "seed=18446744073709551616 must be an integer in 0.."),
])
def test_a_setting_out_of_range_is_one_line_before_the_model_loads(setting, needle, tmp_path):
    done = generate(tmp_path / "no-model-here", f"prompt={PROMPT}", setting)
    assert_one_line(done, needle)


def test_the_max_new_tokens_refusal_says_what_a_token_costs(tmp_path):
    """Each new token computes only itself with the key/value cache; only past seq_len does
    it recompute a window, so the line says that (it said each recomputes the whole context)."""
    done = generate(tmp_path / "no-model-here", f"prompt={PROMPT}", "max_new_tokens=20000")
    assert_one_line(done, "(past the model's seq_len each new token recomputes a seq_len window)")
    assert "whole context" not in done.stderr


@pytest.mark.parametrize("settings, needle", [
    ((f"prompt={PROMPT}", "prompt_ids=1,2"), "both prompt and prompt_ids are given; pass one"),
    (("prompt_ids=",), "prompt_ids is empty; give the token ids to continue"),
    (("prompt_ids=1,x,3",), "prompt_ids='1,x,3': 'x' is not a token id (an integer >= 0)"),
    (("prompt_ids=1,-2",), "prompt_ids='1,-2': '-2' is not a token id"),
    (("prompt_ids=1,,2",), "prompt_ids='1,,2': '' is not a token id"),
    (("max_new_tokens=4",), 'the prompt is empty; pass prompt="some text" to continue, or '
                            'prompt_ids=1,2,3'),
])
def test_a_bad_prompt_ids_is_one_line_before_the_model_loads(settings, needle, tmp_path):
    done = generate(tmp_path / "no-model-here", *settings)
    assert_one_line(done, needle)


def test_help_names_every_setting_with_its_default():
    import dataclasses

    from launch.commands.generate import SETTINGS_HELP, GenerateConfig

    done = subprocess.run([GENERATE, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.startswith("usage: hybrid-generate SOURCE prompt=")
    settings = [f.name for f in dataclasses.fields(GenerateConfig) if f.name != "source"]
    assert list(SETTINGS_HELP) == settings
    assert "  max_new_tokens  how many tokens to add, 1..10,000 (default 32)" in done.stdout
    assert "(default true)" in done.stdout and "True" not in done.stdout


@pytest.mark.slow
def test_a_checkpoint_with_a_flipped_byte_is_refused_as_resume_refuses_it(hf_imported,
                                                                         tmp_path):
    damaged = shutil.copytree(hf_imported, tmp_path / "damaged")
    data = next((damaged / "step_00000000").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    done = generate(damaged, f"prompt={PROMPT}", "max_new_tokens=4")
    assert_one_line(done, f"checkpoint file {data} does not match the checksum written with it")


@pytest.mark.slow
def test_a_prompt_that_encodes_to_no_tokens_is_one_line(hf_imported, tmp_path):
    """A checkpoint carrying a tokenizer with an empty vocabulary (import refuses one now;
    a checkpoint imported before still has it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    checkpoint = shutil.copytree(hf_imported, tmp_path / "empty") / "step_00000000"
    empty = Tokenizer(models.BPE(vocab={}, merges=[]))
    empty.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    empty.decoder = decoders.ByteLevel()
    empty.add_special_tokens(["<|endoftext|>"])
    empty.save(str(checkpoint / "tokenizer.json"))
    done = generate(checkpoint, f"prompt={PROMPT}")
    assert_one_line(done, f"the prompt {PROMPT!r} encodes to no tokens with the tokenizer of "
                          f"{checkpoint}")


class _FixedLogits:
    """A stand-in model whose next-token logits are always ``logits``."""

    def __init__(self, logits):
        self.logits_row, self.cfg = logits, type("cfg", (), {"seq_len": 4})

    def logits(self, context):
        return self.logits_row.expand(1, context.shape[1], -1)


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-30, 0.8, 1e30, 1e300, 1.7e308])
def test_any_finite_temperature_gives_a_token(temperature):
    """softmax(logits / T) overflowed to NaN for a tiny T (torch.multinomial failed); taken
    over the logits less their maximum it never does: a tiny T picks the maximum."""
    import torch

    from hybrid.generate import new_tokens

    logits = torch.randn(300, generator=torch.Generator().manual_seed(0)) * 30
    ids = list(new_tokens(_FixedLogits(logits), [1, 2], max_new_tokens=64,
                          temperature=temperature, top_k=0, seed=3, eod=None))
    assert len(ids) == 64 and all(0 <= i < 300 for i in ids)
    if temperature <= 1e-30:
        assert set(ids) == {int(logits.argmax())}
    if temperature >= 1e30:  # all but uniform: many different tokens
        assert len(set(ids)) > 32


def test_pieces_hold_back_a_character_until_its_last_byte():
    """Byte by byte (the ``bytes`` tokenizer; a byte-level BPE token is the same): an
    incomplete character waits, a byte that makes none comes out with the next character, and
    the pieces put together are the decoding of all the ids."""
    from hybrid.data.tokenizer import ByteTokenizer
    from hybrid.generate import TextPieces

    data = "a€b".encode() + b"\xff" + b"c" + "é".encode()[:1]
    pieces = TextPieces(ByteTokenizer().decode)
    out = [pieces.add(byte) for byte in data] + [pieces.rest()]
    assert out == ["a", "", "", "€", "b", "", "\ufffdc", "", "\ufffd"]
    assert "".join(out) == ByteTokenizer().decode(data)


@pytest.mark.slow
def test_the_streamed_text_is_the_decoding_and_a_tiny_temperature_is_greedy(hf_gpt2,
                                                                          hf_imported):
    from tokenizers import Tokenizer

    ids = {}
    for temperature in ("0", "1e-300"):
        done = generate(hf_imported, f"prompt={PROMPT}", "max_new_tokens=12",
                        f"temperature={temperature}", "stop_at_eod=false", "show_ids=true")
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
        ids[temperature] = json.loads(re.search(r"new ids: (\[.*\])", done.stdout)[1])
        text = Tokenizer.from_file(str(hf_gpt2 / "tokenizer.json")).decode(
            ids[temperature], skip_special_tokens=False)
        assert done.stdout.startswith(f"{PROMPT}{text}\nprompt ids: ")
    assert ids["1e-300"] == ids["0"] and len(ids["0"]) == 12


def _read_until(stream, enough, deadline: float) -> bytes:
    """What ``stream`` gives until ``enough(data)`` holds (a deadline, no sleeps)."""
    data = b""
    while not enough(data):
        left = deadline - time.monotonic()
        assert left > 0, f"timed out; read {data!r}"
        if select.select([stream], [], [], left)[0]:
            chunk = os.read(stream.fileno(), 4096)
            assert chunk, f"the output ended early: {data!r}"
            data += chunk
    return data


@pytest.mark.slow
def test_text_streams_as_it_comes_and_ctrl_c_stops_it_in_one_line(hf_imported):
    """(A huge temperature: all but uniform sampling, end to end.)"""
    process = subprocess.Popen([GENERATE, str(hf_imported), f"prompt={PROMPT}",
                                "max_new_tokens=10000", "temperature=1e300",
                                "stop_at_eod=false"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        prompt = PROMPT.encode()
        first = _read_until(process.stdout, lambda data: len(data) > len(prompt),
                            time.monotonic() + 120)  # the prompt, then a first new piece
        process.send_signal(signal.SIGINT)
        rest, err = process.communicate(timeout=60)
    finally:
        process.kill()
        process.wait()
    out, err = (first + rest).decode(), err.decode()
    assert process.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines() == [err.strip()] and \
        re.fullmatch(r"interrupted: generation stopped after \d+ new tokens \(Ctrl-C\)",
                     err.strip()), err
    assert out.startswith(PROMPT) and out.endswith("\n") and out.count("\n") == 1


def _ids(done: subprocess.CompletedProcess, which: str = "new") -> list[int]:
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    return json.loads(re.search(rf"^{which} ids: (\[.*\])$", done.stdout, re.M)[1])


@pytest.mark.slow
def test_prompt_ids_generate_from_a_model_without_a_tokenizer(hf_gpt2, tmp_path):
    """An HF directory without tokenizer.json: a text prompt is refused, pointing to
    prompt_ids; the ids of the same prompt give the same greedy ids as the text prompt on the
    directory with its tokenizer, and as HF's greedy generate (both stop at config.json's
    eos_token_id); only ids are printed. With the tokenizer, ids in give the text too."""
    import torch
    from tokenizers import Tokenizer
    from transformers import GPT2LMHeadModel

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(hf_gpt2 / name, bare / name)
    assert_one_line(generate(bare, f"prompt={PROMPT}"),
                    "give token ids instead (prompt_ids=1,2,3)")
    prompt = Tokenizer.from_file(str(hf_gpt2 / "tokenizer.json")).encode(PROMPT).ids
    settings = ("max_new_tokens=12", "temperature=0")
    by_text = _ids(generate(hf_gpt2, f"prompt={PROMPT}", *settings, "show_ids=true"))
    by_ids = generate(bare, f"prompt_ids={','.join(map(str, prompt))}", *settings)
    assert _ids(by_ids) == by_text and _ids(by_ids, "prompt") == prompt
    assert by_ids.stdout == f"prompt ids: {prompt}\nnew ids: {by_text}\n"  # no text to show
    model = GPT2LMHeadModel.from_pretrained(bare).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                             do_sample=False, pad_token_id=model.config.eos_token_id)
    assert by_text == out[0, len(prompt):].tolist() and len(by_text) > 1
    with_text = generate(hf_gpt2, f"prompt_ids={prompt}".replace(" ", ""), *settings)
    assert _ids(with_text) == by_text and with_text.stdout.startswith(PROMPT)


@pytest.mark.slow
@pytest.mark.parametrize("ids, needle", [
    ("5,300,7,999", "prompt_ids has 300 (position 1, 2 outside in all), past the vocabulary of "),
    (",".join(["1"] * 33), "prompt_ids has 33 ids, more than the model's seq_len=32"),
])
def test_prompt_ids_outside_the_model_are_one_line(hf_gpt2, ids, needle):
    assert_one_line(generate(hf_gpt2, f"prompt_ids={ids}"), needle)


@pytest.mark.slow
def test_ctrl_c_with_prompt_ids_and_no_tokenizer_keeps_the_ids_so_far(hf_gpt2, tmp_path):
    """Without a tokenizer the prompt's ids come once the model is ready; Ctrl-C then prints
    the new ids so far and one line."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(hf_gpt2 / name, bare / name)
    process = subprocess.Popen([GENERATE, str(bare), "prompt_ids=5,6,7", "max_new_tokens=10000",
                                "temperature=1e300", "stop_at_eod=false"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        first = _read_until(process.stdout, lambda data: data.endswith(b"\n"),
                            time.monotonic() + 120)
        process.send_signal(signal.SIGINT)
        rest, err = process.communicate(timeout=60)
    finally:
        process.kill()
        process.wait()
    out, err = (first + rest).decode(), err.decode()
    assert process.returncode == 130 and "Traceback" not in err, err[-3000:]
    found = re.fullmatch(r"interrupted: generation stopped after (\d+) new tokens \(Ctrl-C\)",
                         err.strip())
    assert found, err
    lines = out.splitlines()
    assert lines[0] == "prompt ids: [5, 6, 7]" and len(lines) == 2, out
    new = json.loads(lines[1].removeprefix("new ids: "))
    assert len(new) == int(found[1]) and all(0 <= i < 300 for i in new)
