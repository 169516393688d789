"""A kerasdist module over 500 lines says why at its top: its docstring
has a paragraph starting "Over 500 lines:" with the reason (one concern
that reads best whole, or a file run by path that may import nothing of
its own package). A module that grows past the line without one is split
or gets its reason in the same change. And the package's top holds at
most 14 modules."""

import ast
import os

from tests.support.helpers import REPO_ROOT

LIMIT = 500
MARK = "Over 500 lines:"


def _modules():
    package = os.path.join(REPO_ROOT, "kerasdist")
    for root, _, files in os.walk(package):
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.join(root, name)


def test_every_module_over_500_lines_says_why_at_its_top():
    unexplained, sizes = [], {}
    for path in _modules():
        with open(path, encoding="utf-8") as f:
            source = f.read()
        lines = source.count("\n")
        rel = os.path.relpath(path, REPO_ROOT)
        sizes[rel] = lines
        if lines <= LIMIT:
            continue
        doc = ast.get_docstring(ast.parse(source)) or ""
        reasons = [p for p in doc.split("\n\n") if p.startswith(MARK)]
        # A reason is a sentence, not the mark alone.
        if not reasons or len(reasons[0]) < len(MARK) + 20:
            unexplained.append(f"{rel} ({lines} lines)")
    assert len(sizes) > 50, sizes  # the walk found the package
    assert not unexplained, (
        f"modules over {LIMIT} lines without a paragraph starting "
        f"{MARK!r} in their docstring: {', '.join(unexplained)}")


# The package's top: the public modules and what every namespace shares;
# private plumbing lives under the layer it serves (_core/, rendezvous/,
# keras/, run/, ...).
TOP_LIMIT = 14


def test_the_package_top_has_at_most_14_modules():
    package = os.path.join(REPO_ROOT, "kerasdist")
    top = sorted(n for n in os.listdir(package) if n.endswith(".py"))
    assert len(top) <= TOP_LIMIT, (
        f"{len(top)} modules at the top of kerasdist/ (at most "
        f"{TOP_LIMIT}): {', '.join(top)}; move private ones under the "
        f"package of the layer they serve")
