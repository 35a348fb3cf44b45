"""Request ids: the client's `x-request-id` when it is a sane token, else a fresh one."""

from __future__ import annotations

import random
import re

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")   # fullmatch: `$` lets a final newline through
# Request ids need to be unique, not secret: 128 bits from a generator seeded once from the OS, not an
# os.urandom call (a syscall) per request as uuid4 makes.
_IDS = random.Random()


def new_request_id(given: str | None) -> str:
    return given if given is not None and REQUEST_ID.fullmatch(given) else f"{_IDS.getrandbits(128):032x}"
