"""Every relative link in the documentation reaches a file, and its #anchor
a heading of that file; every place in the code that cites a page of docs/
names one that exists, and a section of it that exists.

- Markdown links `[text](path#anchor)` (and `[ref]: path#anchor`) in
  docs/, README.md, CONTRIBUTING.md, SECURITY.md and benchmarks/, outside
  code blocks and code spans: the path, relative to the file, must exist,
  and an anchor into a .md file must be one of its headings' anchors as
  GitHub makes them (lowercase; punctuation dropped except `-` and `_`;
  spaces to `-`; a repeated heading gets `-1`, `-2`, ...).
- Citations in the sources, tests, benchmarks and docs: `docs/page.md#anchor`
  (as the settings' doc lines write `[page.md](page.md#anchor)`) and
  `docs/page.md, "Heading"` (the quoted text starts a heading of that page),
  the forms error messages and docstrings use.

Standard library only; reads files, imports nothing of kerasdist.
"""

import functools
import os
import re

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
DOCS = os.path.join(REPO_ROOT, "docs")

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
_MD_LINK_TEXT = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
# docs/page.md#anchor, or page.md#anchor after ( or [ as in a Markdown
# link inside a string.
_CITED_ANCHOR = re.compile(r"(?:docs/|(?<=[(\[]))([\w-]+\.md)#([\w-]+)")
_CITED_HEADING = re.compile(r"docs/([\w-]+\.md), \\?\"([^\"\\]+)\\?\"")
_CITED_HEADING_IN_DOCS = re.compile(r"\b([\w-]+\.md), \"([^\"]+)\"")


def _markdown_files():
    """The documentation's .md files, relative to the repository."""
    out = [name for name in ("README.md", "CONTRIBUTING.md", "SECURITY.md")
           if os.path.exists(os.path.join(REPO_ROOT, name))]
    for top in ("docs", "benchmarks"):
        for root, dirs, files in os.walk(os.path.join(REPO_ROOT, top)):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            out += [os.path.relpath(os.path.join(root, f), REPO_ROOT)
                    for f in sorted(files) if f.endswith(".md")]
    return out


def _prose_lines(text):
    """(line number, line) outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if m:
            if fence is None:
                fence = m.group(1)
            elif m.group(1) == fence:
                fence = None
            continue
        if fence is None:
            yield number, line


def slug(heading):
    """GitHub's anchor for a heading's text (without the -N of repeats)."""
    text = _MD_LINK_TEXT.sub(r"\1", heading).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.lru_cache(maxsize=None)
def headings(path):
    """[(heading text, anchor)] of a Markdown file, in order."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    out, seen = [], {}
    for _, line in _prose_lines(text):
        m = _HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.append((m.group(2), base if n == 0 else f"{base}-{n}"))
        if "<a " in line:
            out += [(None, name) for name in _HTML_ANCHOR.findall(line)]
    return out


@functools.lru_cache(maxsize=None)
def anchors(path):
    """The anchors a link may name in a Markdown file."""
    return {a for _, a in headings(os.path.normpath(path))}


def _links(text):
    """(line number, target) of every link outside code."""
    for number, line in _prose_lines(text):
        line = _CODE_SPAN.sub("", line)
        for target in _LINK.findall(line):
            yield number, target
        m = _REF_DEF.match(line)
        if m:
            yield number, m.group(1)


def _broken(rel):
    """Messages for the links of one file that lead nowhere."""
    path = os.path.join(REPO_ROOT, rel)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    out = []
    for number, target in _links(text):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target) or \
                target.startswith("//"):
            continue  # a URL: https:, mailto:, ...
        where = f"{rel}:{number}: ({target})"
        file_part, _, anchor = target.partition("#")
        dest = (os.path.normpath(os.path.join(os.path.dirname(path),
                                              file_part))
                if file_part else path)
        if os.path.relpath(dest, REPO_ROOT).startswith(".."):
            out.append(f"{where} leaves the repository")
        elif not os.path.exists(dest):
            out.append(f"{where}: no such file")
        elif anchor and dest.endswith(".md") and \
                anchor not in anchors(dest):
            out.append(f"{where}: no heading with the anchor #{anchor} "
                       f"in {os.path.relpath(dest, REPO_ROOT)}")
    return out


def test_markdown_files_are_found():
    files = _markdown_files()
    assert "README.md" in files and "docs/launcher.md" in files, files


def test_every_relative_link_resolves():
    broken = [m for rel in _markdown_files() for m in _broken(rel)]
    assert not broken, "links that lead nowhere:\n" + "\n".join(broken)


def test_slug_follows_github():
    assert slug("From Python: `kerasdist.run(fn)`") == \
        "from-python-kerasdistrunfn"
    assert slug("Without `kerasdist run`: torchrun, Kubernetes, JAX, "
                "TF_CONFIG, SageMaker, Slurm") == \
        "without-kerasdist-run-torchrun-kubernetes-jax-tf_config-" \
        "sagemaker-slurm"
    assert slug("Your cluster's MPI") == "your-clusters-mpi"
    assert slug("W1: allreduce latency and bandwidth (np=2)") == \
        "w1-allreduce-latency-and-bandwidth-np2"
    assert slug("See [the page](x.md) now") == "see-the-page-now"


def _source_files():
    """Sources, tests, benchmarks, build files: where messages, docstrings
    and comments cite the docs."""
    out = []
    for top in ("kerasdist", "ops", "tests", "benchmarks"):
        for root, dirs, files in os.walk(os.path.join(REPO_ROOT, top)):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".")
                             and d != "__pycache__")
            out += [os.path.join(root, f) for f in sorted(files)
                    if f.endswith((".py", ".cc", ".h", ".c", ".sh"))
                    or f == "Makefile"]
    return out


def _joined(text):
    """The text with comment and docstring line breaks as spaces, so that a
    citation broken over two lines reads as one."""
    return re.sub(r"\n[ \t]*(?:#+|//+|\*)?[ \t]*", " ", text)


def _broken_citations(path, text, in_docs):
    if ".md" not in text:
        return []
    rel = os.path.relpath(path, REPO_ROOT)
    out = []
    text = _joined(text)
    for page, anchor in _CITED_ANCHOR.findall(text):
        dest = os.path.join(DOCS, page)
        if not os.path.exists(dest):
            if not in_docs:  # a .md file elsewhere is another matter
                continue
            out.append(f"{rel}: {page}#{anchor}: no docs/{page}")
        elif anchor not in anchors(dest):
            out.append(f"{rel}: {page}#{anchor}: no such heading in "
                       f"docs/{page}")
    pattern = _CITED_HEADING_IN_DOCS if in_docs else _CITED_HEADING
    for page, quoted in pattern.findall(text):
        dest = os.path.join(DOCS, page)
        if not os.path.exists(dest):
            out.append(f"{rel}: {page}, \"{quoted}\": no docs/{page}")
            continue
        titles = [t for t, _ in headings(os.path.normpath(dest)) if t]
        if not any(t.startswith(quoted) for t in titles):
            out.append(f"{rel}: {page}, \"{quoted}\": no heading of "
                       f"docs/{page} starts so")
    return out


def test_citations_of_the_docs_resolve():
    broken = []
    for path in _source_files():
        if path == os.path.abspath(__file__):
            continue  # its docstring shows the forms
        with open(path, encoding="utf-8", errors="replace") as f:
            broken += _broken_citations(path, f.read(), in_docs=False)
    for rel in _markdown_files():
        path = os.path.join(REPO_ROOT, rel)
        with open(path, encoding="utf-8") as f:
            broken += _broken_citations(path, f.read(),
                                        in_docs=rel.startswith("docs/"))
    assert not broken, ("citations of docs/ that lead nowhere:\n"
                        + "\n".join(broken))
