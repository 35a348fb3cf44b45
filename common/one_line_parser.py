"""One ArgumentParser for the project's commands (`gateway`, its subcommands, `gateway plan`, the engines).

argparse prints its whole usage block before an error's line, which buries the line (the gateway's usage
is nine lines of options); here a refusal is that one line and exit status 2, as every other refusal of
these commands is. `--help` still prints the usage."""

from __future__ import annotations

import argparse
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


# Argument types: a value out of range is argparse's one-line refusal naming the option, not a run that
# binds another port or fails later with a message about something else.
GRPC_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:")   # targets gRPC names by scheme


def port(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, not {text}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer (at least 1)")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:   # NaN too
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def share(text: str) -> float:
    """A fraction above 0 and at most 1."""
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not a share above 0 and at most 1")
    return value


def targets(text: str) -> str:
    """Comma-separated gRPC targets: host:port each (`[v6]:port`), or a target gRPC names by its scheme."""
    for target in text.split(","):
        if target.startswith(GRPC_SCHEMES):
            continue
        host, sep, number = target.rpartition(":")
        if not sep or not host or host.endswith(":") or not number.isdigit() or not 0 < int(number) < 65536:
            raise argparse.ArgumentTypeError(f"{target!r} is not host:port")
    return text
