"""Text generation from a hybrid checkpoint (any layout's) or an HF GPT-2, Llama or Mixtral
directory.

The model runs in this process (one rank: a 1-process gloo group on an in-memory store, no
socket), in fp32. Each new token is chosen from the logits of the real vocabulary at the last
position: greedy (``temperature=0``, the first maximum, as ``torch.argmax`` and HF's greedy
``generate``), or sampled from ``softmax(logits / temperature)`` restricted to the ``top_k``
most likely (0: all), with a generator seeded by ``seed``; the softmax is taken in float64 of
the logits less their maximum, so any finite temperature > 0 gives probabilities (a tiny one
tends to greedy, a huge one to uniform). Each layer keeps the keys and values of the tokens
so far (``hybrid.model.kv_cache``), so a new token's forward computes only that token, while
the ids fit ``model.seq_len``; beyond it the context slides, keeping the last ``seq_len``
tokens, and each token recomputes that window (as does a family whose blocks take no cache).
Generation stops after ``max_new_tokens`` or at the end-of-document token (``stop_at_eod``);
``new_tokens`` yields each id as it is chosen, and ``TextPieces`` turns them into text as it
becomes final. The prompt is encoded and the output decoded with
the tokenizer the checkpoint carries (the run's data recorded it) or the HF directory's; a
model without one takes the prompt as ids and gives ids (``hybrid-generate prompt_ids=``). A
checkpoint is checked as a resume checks it (every file's size and CRC-32) before it is read.

torch is imported where the model runs, so ``hybrid-generate`` starts (and answers a bad
setting or a Ctrl-C) before torch is loaded.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional

from hybrid.data.tokenizer import ByteTokenizer, TokenizerInfo, tokenizer_from_json
from hybrid.errors import UserError
from hybrid.planning.config import ModelConfig

if TYPE_CHECKING:
    import torch


class GenerateError(UserError):
    """A source, prompt or setting generation cannot use: one line with the fix."""


@dataclass
class Source:
    """A model to generate from: its config, global weights (real vocabulary or padded), and
    its tokenizer (record and JSON; both None when the data recorded none). ``eod``: the
    end-of-document id without a tokenizer (an HF config.json's ``eos_token_id``), if any."""

    model: ModelConfig
    weights: dict
    tokenizer: Optional[dict]
    tokenizer_json: Optional[str]
    where: str
    eod: Optional[int] = None


def load_source(source: str, context: Optional[int] = None) -> Source:
    """An HF GPT-2 directory (it holds ``config.json``) or a hybrid checkpoint / run dir, at
    ``context`` positions (``with_context``)."""
    path = Path(source).expanduser()
    if _is_hf_dir(path):
        from hybrid.interop.convert import hf_model

        model, weights, record, tokenizer_json = hf_model(str(path))
        return with_context(Source(model, weights, record, tokenizer_json, str(path),
                                   _hf_eos(path)), model.seq_len, context)
    from hybrid.checkpoint.dcp_io import verify_files_here
    from hybrid.checkpoint.store import check_files, read_manifest, resolve_resume
    from hybrid.checkpoint.weights import checkpoint_tokenizer, read_model_weights
    from hybrid.interop.convert import model_config_of

    if not path.exists():  # resolve_resume's wording knows only checkpoints and runs
        from hybrid.checkpoint.store import CheckpointError

        raise CheckpointError(f"source {source} does not exist; give a step_* checkpoint "
                              f"directory, a run directory or an HF model directory (one "
                              f"holding config.json)")
    checkpoint = resolve_resume(source, path, field="source")
    manifest = read_manifest(checkpoint)
    check_files(checkpoint, manifest)
    verify_files_here(checkpoint, manifest)  # as resume and export: no text from damaged weights
    record, tokenizer_json = checkpoint_tokenizer(checkpoint, manifest)
    model = model_config_of(manifest)
    return with_context(Source(model, read_model_weights(checkpoint), record, tokenizer_json,
                               str(checkpoint)), _positions_of(manifest, model), context)


def _positions_of(manifest: dict, model: ModelConfig) -> int:
    """The context a checkpoint's model was made for: a rotary model's source's (the HF
    folder or checkpoint its run started from, as export writes it back), else its own."""
    from hybrid.interop.convert import source_positions
    from hybrid.planning.models import model_spec

    if model_spec(model).learned_positions:
        return model.seq_len
    return source_positions(manifest, model.seq_len)


def with_context(source: Source, positions: int, context: Optional[int]) -> Source:
    """``source`` generating over ``context`` positions (None: ``positions``, what the model
    was made for). A rotary model takes any; a learned-positions table (GPT-2) has
    ``positions`` rows and is refused beyond them."""
    from dataclasses import replace

    from hybrid.checkpoint.weights import fit_positions
    from hybrid.planning.models import model_spec

    context = positions if context is None else context
    if model_spec(source.model).learned_positions and context > positions:
        raise GenerateError(f"context={context}: {source.where} has learned positions for "
                            f"{positions} tokens; choose context <= {positions}")
    return replace(source, model=replace(source.model, seq_len=context),
                   weights=fit_positions(source.weights, context))


def _hf_eos(path: Path) -> Optional[int]:
    """config.json's ``eos_token_id`` when it is one id (a list of several is not used)."""
    from hybrid.interop.hf_dir import hf_config

    eos = hf_config(str(path)).get("eos_token_id")
    return eos if isinstance(eos, int) and not isinstance(eos, bool) else None


def _is_hf_dir(path: Path) -> bool:
    """An HF model directory, not a hybrid run directory (whose config.json is hybrid's)."""
    import json

    try:
        return "model_type" in json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False


def text_tokenizer(source: Source):
    """The tokenizer that encodes prompts and decodes outputs of ``source``."""
    if source.tokenizer is None:
        raise GenerateError(f"{source.where} carries no tokenizer (an HF directory without "
                            f"tokenizer.json, or a run on data with none recorded, e.g. "
                            f"data=synthetic), so a text prompt cannot be encoded; give token "
                            f"ids instead (prompt_ids=1,2,3)")
    info = TokenizerInfo.from_dict(source.tokenizer)
    if info.kind == "bytes":
        return ByteTokenizer()
    if source.tokenizer_json is None:
        raise GenerateError(f"{source.where} records a {info.kind} tokenizer but holds no "
                            f"tokenizer.json; export the checkpoint again")
    return tokenizer_from_json(source.tokenizer_json, info)


@contextlib.contextmanager
def one_process_model(source: Source) -> Iterator[torch.nn.Module]:
    """The 1-process model of ``source`` with its weights, on a 1-rank group."""
    import torch.distributed as dist

    from hybrid.groups import ParallelGroups
    from hybrid.interop.gpt2 import pad_vocabulary
    from hybrid.model import GPT, load_global_weights
    from hybrid.model.expert_bias import load_expert_biases
    from hybrid.planning.layout import Layout

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        groups = ParallelGroups.create(Layout())
        model = GPT(source.model, groups, seed=0)
        weights = load_expert_biases([model], source.weights)  # MoE routing's, if any
        load_global_weights(model.parameters(),
                            pad_vocabulary(weights, source.model.padded_vocab), groups)
        yield model.eval()
    finally:
        if started:
            dist.destroy_process_group()


def new_tokens(model, prompt: list[int], *, max_new_tokens: int, temperature: float,
               top_k: int, seed: int, eod: Optional[int], stop_at_eod: bool = True,
               cache: bool = True) -> Iterator[int]:
    """Each id that follows ``prompt``, as soon as it is chosen (see the module doc).
    ``cache``: keep each layer's keys and values while the ids fit ``seq_len``, where the
    family's blocks take one; past it, and without, each token recomputes the window."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids, window = list(prompt), model.cfg.seq_len
    kv = _cache_for(model) if cache else None
    for _ in range(max_new_tokens):
        with torch.no_grad():
            if kv is not None and len(ids) <= window:
                logits = model.decode(torch.tensor([ids[kv.length:]], dtype=torch.int64),
                                      kv)[0].float()
            else:
                context = torch.tensor([ids[-window:]], dtype=torch.int64)
                logits = model.logits(context)[0, -1].float()
        token = int(logits.argmax()) if temperature == 0 else \
            _sample(logits, temperature, top_k, generator)
        ids.append(token)
        yield token
        if stop_at_eod and token == eod:
            return


def _cache_for(model):
    """A key/value cache for ``model``'s layers, or None where its family's blocks take none."""
    from hybrid.model.families import family_blocks
    from hybrid.model.kv_cache import KVCache

    if not hasattr(model, "decode") or not family_blocks(model.cfg).cache:
        return None
    return KVCache(model.cfg.layers)


def generate(model, prompt: list[int], **settings) -> list[int]:
    """The ids that follow ``prompt`` (``new_tokens``' settings), all at once."""
    return list(new_tokens(model, prompt, **settings))


def _sample(logits: torch.Tensor, temperature: float, top_k: int,
            generator: torch.Generator) -> int:
    import torch

    # the largest scaled logit is 0, so no temperature overflows exp(): no inf, no NaN
    scaled = (logits.double() - logits.max()) / temperature
    if 0 < top_k < scaled.numel():
        cutoff = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < cutoff, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


class TextPieces:
    """The text of the ids chosen so far, handed out in pieces as it becomes final.

    Trailing U+FFFD are held back: a byte-level token can carry part of a character that the
    next tokens complete (a byte that stays invalid comes out with the next whole character).
    For the tokenizers hybrid-data makes (bytes, byte-level BPE) the text before them never
    changes, so the pieces put together are the decoding of all the ids."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode, self._ids, self._shown = decode, [], ""

    def add(self, token: int) -> str:
        """The text that ``token`` makes final (often "", or more than its own)."""
        self._ids.append(token)
        return self._take(self._decode(self._ids).rstrip("\ufffd"))

    def rest(self) -> str:
        """Whatever is still held back (at the end: bytes that make no character)."""
        return self._take(self._decode(self._ids))

    def _take(self, text: str) -> str:
        if len(text) <= len(self._shown):
            return ""
        piece, self._shown = text[len(self._shown):], text
        return piece
