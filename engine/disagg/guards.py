"""The guards: one switch per fix of the GLM-5.3 bug family (``hardened`` turns on all,
``vulnerable`` none). With a guard off, the lifecycle code takes the named deviation the guard
exists to prevent (``cluster.py``'s docstring lists which guard stops which fault)."""
from __future__ import annotations

from dataclasses import dataclass, fields

from engine.errors import InputError


@dataclass(slots=True, frozen=True)
class Guards:
    terminal_predicate: bool = True
    reject_before_bootstrap: bool = True
    landed_set_check: bool = True
    checksum: bool = True
    read_check: bool = True
    deferred_release: bool = True
    transfer_batch_bound: bool = True
    cancel_both_halves: bool = True
    incarnation_ids: bool = True
    single_release: bool = True
    double_free_check: bool = True

    @classmethod
    def policy(cls, name: str) -> "Guards":
        if name == "hardened":
            return cls()
        if name == "vulnerable":
            return cls.only()
        raise InputError(f"unknown policy {name!r}: expected 'vulnerable' or 'hardened'")

    @classmethod
    def only(cls, *names: str) -> "Guards":
        """Every guard off except ``names`` (the fix x fault matrix)."""
        known = [f.name for f in fields(cls)]
        bad = [n for n in names if n not in known]
        if bad:
            raise InputError(f"unknown guard(s) {bad}: known are {known}")
        return cls(**{f: f in names for f in known})
