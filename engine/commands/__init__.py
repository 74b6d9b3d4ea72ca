"""The engine's commands (``generate``, ``replay``, ``preflight``, ``serve``) and the ``kvledger``
entry point that assembles every layer's commands (``main.py``).

The command modules of every layer (``<layer>/commands/``) form the top floor of the house: they
build the typed configs and hand each lower floor what it needs (a recorder, a writer, a config).
"""
