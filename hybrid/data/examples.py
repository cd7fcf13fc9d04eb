"""Built-in corpora (``data.example``), written by ``hybrid-data``'s own pipeline at launch.

``python-docs``: CPython's documentation topics (``pydoc_data.topics``, the text ``help()``
shows), which every Python installation carries: about 2,600 paragraphs of English, one
document each, tokenized byte by byte (vocabulary 256) into Megatron's indexed format. It is
what the main job trains on, so that ``hybrid-train`` works on real text with nothing to
download or prepare.

A corpus is built once per machine, not once per run, into the user's cache
(``$XDG_CACHE_HOME/hybrid``, else ``~/.cache/hybrid``; ``data.cache_dir`` instead when set),
as HF datasets and Megatron's index cache do. Its name carries a hash of its text and of this
module's build version, so another Python's documentation (or a changed build) gets files of
its own instead of a stale copy. Runs that start together may build it at once: each writes
whole files under names of its own and renames them into place, the record last
(``hybrid.files.AtomicFiles``), so a reader finds either the complete corpus or none.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

from hybrid.data.documents import ReadOptions
from hybrid.data.metadata import read_meta
from hybrid.data.prepare import Request, prepare_data
from hybrid.files import user_cache_dir  # noqa: F401 (shared with the device file: run_data)

EXAMPLES_FOLDER = "examples"
BUILD_VERSION = "1"
"""Bump when the tokenization of the built-in corpora changes: older builds are not reused."""


def python_docs_text() -> str:
    import pydoc_data.topics

    return "\n\n".join(pydoc_data.topics.topics[name] for name in sorted(pydoc_data.topics.topics))


def example_prefix(name: str, folder: Path, text: str,
                   tokenizer: str = "bytes") -> Path:
    """Where example ``name`` with ``text`` lies in ``folder`` (named by its content and, for
    another tokenizer than bytes, the SHA-256 of its JSON)."""
    digest = hashlib.sha256(f"{BUILD_VERSION}\0{text}".encode("utf-8")).hexdigest()[:12]
    return Path(folder) / EXAMPLES_FOLDER / (f"{name}-{digest}" if tokenizer == "bytes" else
                                             f"{name}-{digest}-{tokenizer[:12]}")


def write_example(name: str, folder: Path, tokenizer=None) -> tuple[str, bool]:
    """The prefix of example ``name`` in ``folder``, and whether this call wrote it (it is
    written unless it is there already). ``tokenizer``: (the ``--tokenizer`` spec, its
    ``--eod`` or None, the SHA-256 of its JSON) to tokenize with instead of bytes
    (``model.from_hf``'s)."""
    text = python_docs_text()
    spec, eod, key = tokenizer or ("bytes", None, "bytes")
    prefix = example_prefix(name, folder, text, key)
    if read_meta(str(prefix)) is None:
        prefix.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=prefix.parent, prefix=".build-") as tmp:
            source = Path(tmp) / f"{name}.txt"
            source.write_text(text, encoding="utf-8")
            prepare_data(Request(inputs=[str(source)], output=str(prefix), format="indexed",
                                 tokenizer=spec, eod=eod,
                                 read=ReadOptions(documents="blank-lines"), progress=False,
                                 force=True))
        return str(prefix), True
    return str(prefix), False
