"""Built-in corpora (``data.example``), written by ``hybrid-data``'s own pipeline at launch.

``python-docs``: CPython's documentation topics (``pydoc_data.topics``, the text ``help()``
shows), which every Python installation carries: about 2,600 paragraphs of English, one
document each, tokenized byte by byte (vocabulary 256) into Megatron's indexed format. It is
what the main job trains on, so that ``hybrid-train`` works on real text with nothing to
download or prepare.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hybrid.data.documents import ReadOptions
from hybrid.data.metadata import read_meta
from hybrid.data.prepare import Request, prepare_data

EXAMPLES_FOLDER = "examples"


def python_docs_text() -> str:
    import pydoc_data.topics

    return "\n\n".join(pydoc_data.topics.topics[name] for name in sorted(pydoc_data.topics.topics))


def write_example(name: str, folder: Path) -> str:
    """The prefix of example ``name`` in ``folder``, written unless it is there already."""
    prefix = Path(folder) / EXAMPLES_FOLDER / name
    if read_meta(str(prefix)) is None:
        prefix.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=prefix.parent) as tmp:
            text = Path(tmp) / f"{name}.txt"
            text.write_text(python_docs_text(), encoding="utf-8")
            prepare_data(Request(inputs=[str(text)], output=str(prefix), format="indexed",
                                 read=ReadOptions(documents="blank-lines"), progress=False,
                                 force=True))
    return str(prefix)
