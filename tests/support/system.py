"""The Debian packages the tests need beyond pip's, as tools/system-packages.txt
lists them (tools/system-packages.sh installs them as root).

    from tests.support import system
    system.require("nftables")   # skips naming the package when missing

A test that needs a missing package skips with a reason naming it and the
command that installs it; under CI=true it fails instead (CI installs them
all, so a skip there would hide a test that never ran). Standard library
only.
"""

import os
import shutil
import subprocess

LIST = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "tools", "system-packages.txt")


def packages():
    """{package: (probe, what it enables)}, in the list's order."""
    out = {}
    with open(LIST, encoding="utf-8") as f:
        for line in f:
            if not line.strip() or line.startswith("#"):
                continue
            package, probe, purpose = line.split(None, 2)
            out[package] = (probe, purpose.strip())
    return out


def _libraries():
    for ldconfig in ("ldconfig", "/sbin/ldconfig"):
        try:
            out = subprocess.run([ldconfig, "-p"], capture_output=True,
                                 text=True, check=False).stdout
        except FileNotFoundError:
            continue
        return {line.split()[0] for line in out.splitlines()[1:]
                if line.strip()}
    return set()


def present(probe):
    """Whether a probe of the list (`command:NAME`, `lib:SONAME`) finds its
    thing here."""
    kind, _, name = probe.partition(":")
    if kind == "command":
        return shutil.which(name) is not None or os.access(
            f"/usr/sbin/{name}", os.X_OK)
    if kind == "lib":
        return name in _libraries()
    raise ValueError(f"{LIST}: unknown probe {probe!r}")


def missing(*names):
    """The packages among `names` that are not here."""
    table = packages()
    unknown = [n for n in names if n not in table]
    if unknown:
        raise KeyError(f"not in {LIST}: {unknown}")
    return [n for n in names if not present(table[n][0])]


def reason(*names):
    """Why a test needing `names` cannot run here, or None when it can."""
    gone = missing(*names)
    if not gone:
        return None
    them = "them" if len(gone) > 1 else "it"
    return (f"needs the Debian package{'s' if len(gone) > 1 else ''} "
            f"{', '.join(gone)} (tools/system-packages.sh installs {them} "
            f"as root; or apt-get install {' '.join(gone)})")


def require(*names):
    """Skips the calling test when a package of `names` is missing, naming
    it; fails instead under CI=true."""
    import pytest

    why = reason(*names)
    if why is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and the test {why}", pytrace=False)
    pytest.skip(why)
