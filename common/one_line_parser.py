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
