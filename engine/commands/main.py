"""The ``kvledger`` entry point: it assembles the commands each layer owns and maps errors to exit codes.

Each command is one module, ``<layer>/commands/<name>.py``, with the same three functions (as
pip's ``commands/`` and vLLM's ``entrypoints/cli``):

    add_arguments(parser)      its options, each with a help line naming its default
    make_config(args)          a typed, frozen config built from the flags (bad input -> InputError,
                               before any resource is taken); nothing below the command sees argparse
    run(config) -> int         the work, and the exit code

``COMMANDS`` names the modules by string and only the one asked for is imported, so ``kvledger
--help`` loads no torch, no DuckDB and no server. The command modules are the top layer of the
house: they may import every layer; no other module imports them (``tests/test_layers.py``).
"""
from __future__ import annotations

import argparse
import importlib
import sys

from engine.errors import KvledgerError

# name -> (module, one line for `kvledger --help`), in the order --help lists them
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("engine.commands.generate", "run the engine on one prompt, print the text and per-request stats"),
    "replay": ("engine.commands.replay", "run a scenario (glm53 or a fault of its bug family) and print what happened"),
    "preflight": ("engine.commands.preflight",
                  "each node's KV pool in tokens against the context length; non-zero exit when smaller"),
    "serve": ("engine.commands.serve", "OpenAI-compatible server (tenants from API keys), recording into the store"),
    "collect": ("telemetry.commands.collect", "receive a vLLM/SGLang fleet's telemetry (OTLP/HTTP spans and "
                                              "metrics, ZMQ KV cache events) into a store until SIGTERM/SIGINT"),
    "ingest-logs": ("telemetry.commands.ingest_logs",
                    "a vLLM/SGLang log's capacity, KV canary and KV checksum lines into a store"),
    "verify": ("telemetry.commands.verify", "verify the store's signed chain against its anchor; non-zero exit "
                                            "naming the first broken link or the truncation; needs no secret, "
                                            "writes nothing"),
    "export": ("telemetry.commands.export", "copy the store into ClickHouse (a server, or embedded chdb), "
                                            "idempotent per segment; --follow keeps copying a live store"),
    "forensics": ("forensics.commands.query", "forensic queries over the store"),
    "report": ("forensics.commands.report", "disclosure report: Markdown, HTML, JSON (schema-validated), CSV"),
    "tenants": ("forensics.commands.tenants",
                "tenants resolve: map the store's tenant pseudonyms back to names (key holder only; writes nothing)"),
    "probe": ("forensics.commands.probe",
              "isolation probe against any OpenAI-compatible endpoint: exit 0 pass, 1 finding, 3 inconclusive"),
    "dashboard": ("dashboard.commands.dashboard", "the live Streamlit exposure dashboard (loopback by default)"),
    "completion": ("engine.commands.completion", "print a shell completion script (bash, zsh or tcsh) for kvledger"),
}
EXIT_BAD_INPUT = 2          # argparse's own code for a usage error; every refused input exits with it


def die(msg: str) -> int:
    """One line on stderr, the bad-input exit code: how every command refuses."""
    print(f"kvledger: error: {msg}", file=sys.stderr)
    return EXIT_BAD_INPUT


class Parser(argparse.ArgumentParser):
    """argparse with the house's error form: one line, ``kvledger: error: ...``, a "did you mean"
    for a misspelt command, choice or flag, and where the help is - never the usage block."""

    def error(self, message: str):
        import difflib
        import re
        hint = ""
        m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if m:
            choices = re.findall(r"'([^']*)'", m.group(2)) or [c.strip() for c in m.group(2).split(",")]
            close = difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.6)
            message = f"{message.split(':')[0]}: invalid choice {m.group(1)!r}"
            hint = f"; did you mean {close[0]!r}?" if close else f" (one of: {', '.join(choices)})"
        m = re.match(r"unrecognized arguments: (\S+)", message)
        if m and m.group(1).startswith("-"):
            flags = [o for p in self._walk() for a in p._actions for o in a.option_strings]
            close = difflib.get_close_matches(m.group(1).split("=")[0], flags, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
        print(f"kvledger: error: {message}{hint} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)

    def _walk(self):
        """This parser and the subparsers of the command line's words (argparse reports a stray
        flag of a subcommand from the top parser)."""
        yield self
        for a in self._actions:
            if isinstance(a, argparse._SubParsersAction):
                for word in getattr(self, "words", ()):
                    if word in a.choices:
                        a.choices[word].words = self.words
                        yield from a.choices[word]._walk()


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as v
    try:
        return v("kvledger")
    except PackageNotFoundError:
        return "unknown (not installed)"


class Version(argparse.Action):
    """--version: the installed version, looked up only when asked (importlib.metadata: ~40 ms of
    every command's start otherwise)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"kvledger {version()}")
        parser.exit()


def command(name: str):
    """The module of command ``name`` (imported on first use)."""
    return importlib.import_module(COMMANDS[name][0])


def _parser(only: str | None) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    p = Parser(prog="kvledger", description="Paged-attention engine and KV-exposure forensics. The store "
               "defaults to $KVLEDGER_STORE, else ./kvledger-store.")
    p.add_argument("--version", action=Version, nargs=0, help="print the version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    subs = {name: sub.add_parser(name, help=summary, description=summary)
            for name, (_, summary) in COMMANDS.items()}
    for name, sp in subs.items():
        if only is None or name == only:
            command(name).add_arguments(sp)
    return p, subs


def build_parser() -> argparse.ArgumentParser:
    """Every command's parser, all options added (tests and shell completion walk it)."""
    return _parser(None)[0]


OWN_PROCESS = False      # main() runs this process's own command line (the shell's kvledger), not a caller's list


def exit_at_once(rc: int) -> None:
    """End this process now, its answer written: stdout and stderr flushed, every non-daemon thread
    joined and the atexit functions run as at a normal exit - then ``os._exit``, without the
    interpreter's teardown (every module and object freed one by one: ~0.1 s after a forensics
    command at 121 M read rows, whose process holds the snapshot's Arrow tables). Only for a command
    that declares ``EXIT_AT_ONCE`` (its files are written and closed when ``run`` returns) run as
    the process's own command line."""
    import atexit
    import os
    import threading
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):       # a closed pipe (| head): nothing more to say there
            pass
    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    os._exit(rc)


def main(argv: list[str] | None = None) -> int:
    global OWN_PROCESS
    OWN_PROCESS = argv is None
    argv = sys.argv[1:] if argv is None else list(argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser, _ = _parser(chosen if chosen in COMMANDS else "")
    parser.words = [a for a in argv if not a.startswith("-")]      # where a "did you mean" looks for flags
    args = parser.parse_args(argv)
    mod = command(args.command)
    try:
        rc = mod.run(mod.make_config(args))
        if OWN_PROCESS and getattr(mod, "EXIT_AT_ONCE", False):
            exit_at_once(rc)
        return rc
    except KvledgerError as e:
        return die(str(e))
    except OSError as e:          # read-only or full disk, a path that is a file: name it, no traceback
        where = f"{e.filename}: " if e.filename else ""
        return die(f"{where}{e.strerror or e}")
    except KeyboardInterrupt:
        return die("interrupted")
