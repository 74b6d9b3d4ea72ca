"""Errors the engine raises. Each names the problem and, where there is one, the limit."""


class KvledgerError(Exception):
    """Base class of every kvledger error."""


class InputError(KvledgerError, ValueError):
    """Bad input, detected before any resource (page, slot, telemetry row) is taken."""


class ModelLoadError(KvledgerError):
    """A model directory that cannot be loaded: missing files, or shapes that do not match its config."""


class AllocatorError(KvledgerError):
    """The allocator's invariants were violated (double free, page owned twice, lost pages)."""


class DoubleFree(AllocatorError):
    pass


class OutOfPages(KvledgerError):
    """Not enough free pages; the caller preempts or waits."""


class ReadCheckViolation(KvledgerError):
    """A request attempted to read KV slots it does not own (wrong generation or foreign content tag)."""

    def __init__(self, incarnation: int, bad_pages: list[int], bad_slots: int):
        self.incarnation = incarnation
        self.bad_pages = bad_pages
        self.bad_slots = bad_slots
        super().__init__(
            f"read check failed for request {incarnation}: {bad_slots} slot(s) on page(s) "
            f"{bad_pages[:8]}{'...' if len(bad_pages) > 8 else ''} do not carry this request's "
            "generation and content tags; the request was failed, no foreign KV was used for its output"
        )
