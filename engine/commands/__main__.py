"""``python -m engine.commands ...`` is ``kvledger ...`` (what tests and benches start as a child)."""
import sys

from engine.commands.main import main

sys.exit(main())
