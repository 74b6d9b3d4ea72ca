"""Forensics' commands: ``forensics QUERY`` (``query.py``), ``report``, ``probe``. Registered in
``engine/commands/main.py``; the options they share (which SQL engine answers) in ``options.py``."""
