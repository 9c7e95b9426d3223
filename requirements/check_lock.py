"""Does this interpreter have exactly the versions a lock file names?  ``python requirements/check_lock.py LOCK``

Prints each package whose installed version differs from the lock (or that is missing) and exits 1; exits 0
when every ``name==version`` line of the lock is what is installed. ``make setup`` runs it after installing, and
``tests/test_lock.py`` runs it on the test environment.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import sys
from pathlib import Path


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(lock: Path) -> dict[str, str]:
    out = {}
    for line in lock.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep:
            raise SystemExit(f"{lock}: {line!r} is not a name==version pin; regenerate it with `make lock`")
        out[_norm(name.split("[")[0])] = version.strip()
    return out


def mismatches(lock: Path) -> list[str]:
    installed = {_norm(d.metadata["Name"]): d.version for d in md.distributions()}
    bad = []
    for name, version in sorted(pins(lock).items()):
        have = installed.get(name)
        if have != version:
            bad.append(f"{name}: locked {version}, installed {have or 'nothing'}")
    return bad


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        return 2
    lock = Path(argv[0])
    bad = mismatches(lock)
    for line in bad:
        print(f"check_lock: {line}", file=sys.stderr)
    if bad:
        print(f"check_lock: {len(bad)} package(s) differ from {lock}; run `make setup` again (or `make lock` "
              f"to take the new versions on purpose)", file=sys.stderr)
        return 1
    print(f"check_lock: every one of the {len(pins(lock))} packages of {lock} is installed at its locked version")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
