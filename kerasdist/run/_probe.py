"""Run on a host by the launcher's check before a restart (elastic.py):
connects back to the launcher's machine at ADDRESS:PORT and exits 0, or
fails with the reason. Run as a file (`python -I -S _probe.py ...`), like
_rank.py, so that it needs nothing but the interpreter.
"""

import socket
import sys


def main(argv):
    address, port, timeout = argv[1], int(argv[2]), float(argv[3])
    try:
        socket.create_connection((address, port), timeout=timeout).close()
    except OSError as e:
        sys.stderr.write(f"cannot connect back to {address}:{port}: "
                         f"{e.strerror or e}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
