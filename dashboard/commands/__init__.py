"""The dashboard's command (``kvledger dashboard``). Registered in ``engine/commands/main.py``."""
