"""The data layer: tokenizers, ``nam data prepare`` (sources -> Megatron indexed datasets) and packed rows.

``tokenizer.py`` turns text into ids, ``prepare.py`` writes a prepared dataset folder atomically,
``dataset.py`` opens and checks one and cuts its token stream into training rows, ``integrity.py`` holds the
checksums and the stamps that keep that check fast.
"""

from nam_core.errors import DataError


def missing_package(package: str, needed_for: str) -> DataError:
    """The error for an optional package the data layer needs (pyarrow, tokenizers): neither is a core
    dependency of nam; both are in its ``data`` extra."""
    return DataError(f"{needed_for} needs the {package!r} package, which is not installed",
                     hint=f"pip install {package}  (or every optional data package, from a nam checkout: "
                          "pip install -e '.[data]')")
