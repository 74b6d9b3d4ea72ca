"""``kvledger completion SHELL``: a completion script for bash, zsh or tcsh, generated from the
parser itself by ``shtab`` (so it names every command, option and choice there is, and never goes
stale). Install: ``kvledger completion bash > /etc/bash_completion.d/kvledger`` (or source it from
``~/.bashrc``); zsh: ``kvledger completion zsh > "${fpath[1]}/_kvledger"``."""
from __future__ import annotations

from dataclasses import dataclass

SHELLS = ("bash", "zsh", "tcsh")


@dataclass(frozen=True, slots=True)
class CompletionConfig:
    shell: str


def add_arguments(p) -> None:
    p.add_argument("shell", choices=SHELLS, help="the shell to complete in: bash, zsh or tcsh")


def make_config(a) -> CompletionConfig:
    return CompletionConfig(a.shell)


def run(c: CompletionConfig) -> int:
    import shtab

    from engine.commands.main import build_parser
    print(shtab.complete(build_parser(), shell=c.shell))
    return 0
