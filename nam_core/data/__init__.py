"""The data layer: tokenizers, ``nam data prepare`` (sources -> Megatron indexed datasets) and packed rows.

``tokenizer.py`` turns text into ids, ``prepare.py`` writes a prepared dataset folder atomically,
``dataset.py`` opens and checks one and cuts its token stream into training rows.
"""
