"""The ``nam`` command line (import package ``nam_cli``)."""
