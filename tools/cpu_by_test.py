"""Sums the CPU of the processes the tests started, by test file and by test.

    KERASDIST_TEST_CPU_LOG=/tmp/cpu.jsonl make test
    python tools/cpu_by_test.py /tmp/cpu.jsonl [TOP]

Each line of the log is one process that exited normally (see
tests/support/rank_site/sitecustomize.py); processes killed by a signal or
ended with os._exit are not there, so the sums are lower bounds.
"""

import collections
import json
import sys


def main(path, top=25):
    by_file, by_test = collections.Counter(), collections.Counter()
    by_kind, count = collections.Counter(), collections.Counter()
    total = 0.0
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            test = rec["test"].rsplit(" (", 1)[0]
            if not test or rec["argv"][:1] == ["pytest"] or \
                    "xdist" in " ".join(rec["argv"]):
                continue  # the test runner itself
            total += rec["cpu"]
            by_file[test.split("::")[0]] += rec["cpu"]
            by_test[test] += rec["cpu"]
            kind = "+".join(rec["mods"]) or "none"
            by_kind[kind] += rec["cpu"]
            count[kind] += 1
    print(f"{total / 60:.1f} CPU minutes in the processes the tests started")
    print("\nby framework imported (processes, CPU s, s each):")
    for kind, cpu in by_kind.most_common():
        print(f"  {kind:32s} {count[kind]:5d} {cpu:8.0f} "
              f"{cpu / count[kind]:6.1f}")
    for title, counter in (("file", by_file), ("test", by_test)):
        print(f"\nby {title} (CPU s):")
        for name, cpu in counter.most_common(top):
            print(f"  {cpu:7.0f}  {name}")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
