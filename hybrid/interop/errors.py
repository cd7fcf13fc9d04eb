"""The one error of HF conversion, in a module of its own so that the readers and writers
(``hf_dir``, ``shards``) can each raise it without importing one another."""

from hybrid.errors import UserError


class ConversionError(UserError):
    """A model or a directory the conversion cannot represent: one line saying why."""
