"""Every repository path the docs name exists: the *.md files, Python docstrings and comments,
and Rust comments (doc comments and plain ones) of the tracked tree.

Pure Python, no daemon and no native core. A *path* is a token of path characters that
contains a ``/`` and either ends in a source or doc extension (``.rs``, ``.py``, ``.md``, ...)
or starts with one of the repository's top-level directories. It is found when it exists

- relative to the repository root, to the naming file's directory (relative links) or to the
  naming file's crate (the nearest directory above it with a Cargo.toml: a crate doc naming
  its own integration test), or
- for a partial path that does not start at a top-level directory (a module doc naming a
  sibling module's file under its parent module's directory), as the tail of a tracked path:
  in the naming file's own top-level directory for code, anywhere for the top-level docs.

``{a,b}`` alternatives are expanded and ``*`` globs must match a tracked path. URLs and
absolute paths are skipped, and so are paths git ignores (build outputs such as
``target/bench/results.json``); paths of other projects are listed in ``FOREIGN`` with a reason.
Run: ``python3 -m pytest python/tests/test_docs_paths.py -q`` (or this file as a script).
"""

from __future__ import annotations

import ast
import fnmatch
import io
import re
import subprocess
import tokenize
from pathlib import Path, PurePosixPath
from typing import Dict, Iterator, List, Set, Tuple

REPO = Path(__file__).resolve().parents[2]

EXTENSIONS = (".rs", ".py", ".pyi", ".md", ".toml", ".sh", ".json", ".txt", ".yml", ".yaml", ".c", ".h")

# Paths of other projects that the docs name on purpose: never looked for in this tree.
FOREIGN = {
    # pyarrow 11's own Plasma test suite, which scripts/plasma-conformance.sh runs against vovp.plasma.
    "pyarrow/tests/test_plasma.py",
    "tests/test_plasma.py",
    # Ray's source tree (how Ray does what the cluster layer or the benchmarks compare with).
    "ray/",
    # The kernel's header, for a constant copied from it.
    "linux/magic.h",
    # A criterion benchmark's id (group/function), not a file.
    "engine/contains",
}

# A token: path characters, optionally with {a,b} alternatives; stops at spaces, quotes,
# backticks, brackets, commas outside braces, colons (`file.rs:42`).
TOKEN = re.compile(r"(?<![\w./{}*-])((?:[\w.*-]|\{[\w.,*-]*\})+(?:/(?:[\w.*-]|\{[\w.,*/*-]*\})*)+)")


def tracked() -> List[str]:
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True
    ).stdout.decode()
    return [p for p in out.split("\0") if p]


def top_dirs(files: List[str]) -> Set[str]:
    return {f.split("/", 1)[0] for f in files if "/" in f}


def rust_comments(text: str) -> Iterator[Tuple[int, str]]:
    """The comments of a Rust file (`//`, `///`, `//!`), one line each; string literals that
    contain `//` are not comments (a line's comment starts at a `//` outside quotes)."""
    for number, line in enumerate(text.splitlines(), 1):
        quoted = False
        i = 0
        while i < len(line) - 1:
            c = line[i]
            if c == "\\" and quoted:
                i += 2
                continue
            if c == '"':
                quoted = not quoted
            elif not quoted and line.startswith("//", i):
                yield number, line[i:]
                break
            i += 1


def python_docs(text: str) -> Iterator[Tuple[int, str]]:
    """The docstrings and `#` comments of a Python file."""
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                yield tok.start[0], tok.string
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc and node.body:
                yield node.body[0].lineno, doc


def prose(path: str, text: str) -> Iterator[Tuple[int, str]]:
    if path.endswith(".md"):
        return enumerate(text.splitlines(), 1)
    if path.endswith(".rs"):
        return rust_comments(text)
    return python_docs(text)


def expand(token: str) -> List[str]:
    """Each alternative of every brace pair (``{b,c}``), nested ones too."""
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    out = []
    for alt in m.group(1).split(","):
        out.extend(expand(token[: m.start()] + alt + token[m.end() :]))
    return out


def candidates(line: str, tops: Set[str]) -> Iterator[str]:
    for m in TOKEN.finditer(line):
        token = m.group(1)
        before = line[max(0, m.start() - 3) : m.start()]
        if before.endswith("://") or before.endswith("/") or token.startswith("/"):
            continue  # a URL or an absolute path: not this repository's
        token = token.rstrip(".")  # a sentence's full stop
        for path in expand(token):
            path = path.rstrip(".")
            if path.startswith("./"):
                path = path[2:]
            first = path.split("/", 1)[0]
            if path.endswith(EXTENSIONS) or (first in tops and "/" in path.rstrip("/")):
                yield path


def exists(path: str, source: str, files: List[str], dirs: Set[str], tops: Set[str]) -> bool:
    if any(path == f or path.startswith(f) for f in FOREIGN):
        return True
    here = PurePosixPath(source).parent
    bare = path.rstrip("/")
    tries = [bare, str(PurePosixPath(here, bare))]
    crate = next((str(d) for d in here.parents if str(d) != "." and f"{d}/Cargo.toml" in _FILES), None)
    if crate is None and f"{here}/Cargo.toml" in _FILES:
        crate = str(here)
    if crate is not None:
        tries.append(f"{crate}/{bare}")
    tries = [str(PurePosixPath(*_normal(t))) if _normal(t) else t for t in tries]
    if "*" in bare:
        return any(fnmatch.fnmatchcase(f, t) for t in tries for f in files)
    if any(t in dirs or t in _FILES for t in tries):
        return True
    if bare.split("/", 1)[0] in tops:
        return False  # starts at the root: must be exactly there
    # A partial path: the tail of a tracked path, in the naming file's own top-level directory
    # (code) or anywhere (top-level docs).
    scope = "" if "/" not in source else source.split("/", 1)[0] + "/"
    tail = "/" + bare
    return any(f.startswith(scope) and (f.endswith(tail) or (f + "/").find(tail + "/") >= 0) for f in files)


def _normal(path: str) -> List[str]:
    parts: List[str] = []
    for part in PurePosixPath(path).parts:
        if part == "..":
            if not parts:
                return []
            parts.pop()
        elif part != ".":
            parts.append(part)
    return parts


_FILES: Set[str] = set()


def missing_paths() -> Dict[str, List[str]]:
    files = tracked()
    _FILES.clear()
    _FILES.update(files)
    dirs = {str(PurePosixPath(f).parents[i]) for f in files for i in range(len(PurePosixPath(f).parents) - 1)}
    tops = top_dirs(files)
    missing: Dict[str, List[str]] = {}
    for source in files:
        if not source.endswith((".md", ".py", ".pyi", ".rs")) or source.startswith("fuzz/corpus"):
            continue
        full = REPO / source
        if not full.is_file():
            continue  # deleted in the work tree, not yet in the index
        text = full.read_text(encoding="utf-8", errors="replace")
        for number, chunk in prose(source, text):
            for path in candidates(chunk, tops):
                if not exists(path, source, files, dirs, tops):
                    missing.setdefault(path, []).append(f"{source}:{number}")
    skipped = ignored(list(missing))
    return {p: where for p, where in missing.items() if p not in skipped}


def ignored(paths: List[str]) -> Set[str]:
    """The paths git ignores (build outputs, working directories): named, never tracked."""
    if not paths:
        return set()
    out = subprocess.run(
        ["git", "check-ignore", "--no-index", "--stdin"],
        cwd=REPO,
        input="\n".join(paths).encode(),
        capture_output=True,
    ).stdout.decode()
    return set(out.split())


def test_every_path_the_docs_name_exists() -> None:
    missing = missing_paths()
    report = "\n".join(f"  {path}  (named in {', '.join(where[:4])})" for path, where in sorted(missing.items()))
    assert not missing, f"{len(missing)} paths named in docs or comments do not exist:\n{report}"


def test_the_checker_finds_paths() -> None:
    """The scan is not vacuous: it sees known names, rejects a made-up one and skips URLs."""
    tops = {"shm", "actors"}
    line = "see [layout](shm/src/layout.rs), https://x.org/a/b.py and actors/src/table/{lru,stats}.rs."
    assert list(candidates(line, tops)) == [
        "shm/src/layout.rs",
        "actors/src/table/lru.rs",
        "actors/src/table/stats.rs",
    ]
    files = tracked()
    _FILES.clear()
    _FILES.update(files)
    dirs = {str(PurePosixPath(f).parent) for f in files}
    all_tops = top_dirs(files)
    assert exists("shm/src/layout.rs", "README.md", files, dirs, all_tops)
    assert not exists("shm/src/no_such_module.rs", "README.md", files, dirs, all_tops)
    assert exists("server/actor.rs", "transport/src/lib.rs", files, dirs, all_tops)
    assert not exists("server/actor.rs", "shm/src/lib.rs", files, dirs, all_tops)


if __name__ == "__main__":
    gone = missing_paths()
    for p, where in sorted(gone.items()):
        print(p, " ".join(where))
    raise SystemExit(1 if gone else 0)
