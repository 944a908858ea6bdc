"""Bugs planted in real code by AST, of the catalog's bug kinds (families.base.BUG_KINDS).

Each mutation rewrites one expression or statement inside one function and leaves the rest of the file
byte for byte: the node's source span is replaced by the unparsed mutated node. Listing them is cheap
(one parse per file); the mutated file is built, and checked to parse, only for the ones tried
(`Mutation.source`, `Mutation.parses`).
"""

from __future__ import annotations

import ast
import copy
from collections.abc import Iterator
from dataclasses import dataclass, field

from crucible import pyast

_COMPARE_SWAP = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
_OPERATOR_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult,
                  ast.Mod: ast.FloorDiv, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Mutation:
    path: str
    function: str
    kind: str
    line: int
    before: str
    """The source span as written."""
    after: str
    """What replaces it."""
    text: str = field(repr=False)
    """The original file."""
    start: int
    end: int

    @property
    def label(self) -> str:
        return f"{self.path}:{self.line}:{self.function}:{self.kind}"

    @property
    def source(self) -> str:
        """The whole mutated file."""
        return self.text[: self.start] + self.after + self.text[self.end :]

    def parses(self) -> bool:
        try:
            pyast.parse(self.source)
        except SyntaxError:
            return False
        return True


class _Offsets:
    """Character offsets of (line, UTF-8 column) positions in one file."""

    def __init__(self, text: str) -> None:
        self.lines = text.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def at(self, lineno: int, col: int) -> int:
        line = self.lines[lineno - 1]
        return self.starts[lineno - 1] + len(line.encode("utf-8")[:col].decode("utf-8", "replace"))

    def bounds(self, node: ast.AST) -> tuple[int, int]:
        return self.at(node.lineno, node.col_offset), self.at(node.end_lineno, node.end_col_offset)  # type: ignore[arg-type]


def _variants(node: ast.AST) -> Iterator[tuple[str, ast.AST | None]]:
    """(kind, replacement) for one node; None as replacement removes the statement."""
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE_SWAP:
        new = copy.deepcopy(node)
        new.ops = [_COMPARE_SWAP[type(node.ops[0])]()]
        yield "comparison", new
    elif isinstance(node, ast.BoolOp):
        new = copy.deepcopy(node)
        new.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        yield "boolean", new
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        yield "boolean", copy.deepcopy(node.operand)
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATOR_SWAP:
        new = copy.deepcopy(node)
        new.op = _OPERATOR_SWAP[type(node.op)]()
        yield "wrong_operator", new
        if (
            isinstance(node.right, ast.Constant)
            and node.right.value == 1
            and isinstance(node.op, ast.Add | ast.Sub)
        ):
            yield "off_by_one", copy.deepcopy(node.left)
    elif isinstance(node, ast.Constant) and type(node.value) is bool:
        yield "wrong_constant", ast.Constant(value=not node.value)
    elif isinstance(node, ast.Constant) and type(node.value) is int and 0 <= node.value <= 2:
        yield "off_by_one", ast.Constant(value=node.value + 1)
    elif isinstance(node, ast.Call) and len(node.args) == 2 and not node.keywords:
        if not any(isinstance(a, ast.Starred) for a in node.args) and ast.dump(node.args[0]) != ast.dump(
            node.args[1]
        ):
            new = copy.deepcopy(node)
            new.args = [new.args[1], new.args[0]]
            yield "swapped_args", new
    elif (
        isinstance(node, ast.Return)
        and node.value is not None
        and not (isinstance(node.value, ast.Constant) and node.value.value is None)
    ):
        yield "wrong_return", ast.Return(value=ast.Constant(value=None))
    elif isinstance(node, ast.If) and not node.orelse and len(node.body) == 1:
        if isinstance(node.body[0], ast.Return | ast.Raise | ast.Continue | ast.Break):
            yield "missing_edge_case", None


def _removable(function: ast.AST, node: ast.AST) -> bool:
    """A statement can go if its block keeps another statement."""
    for parent in ast.walk(function):
        for name in ("body", "orelse", "finalbody"):
            block = getattr(parent, name, None)
            if isinstance(block, list) and node in block:
                return len(block) > 1
    return False


def mutations(path: str, text: str) -> list[Mutation]:
    """Every mutation of the module's functions (nested ones and methods included); check `parses()`
    before using one."""
    try:
        tree = pyast.parse(text)
    except SyntaxError:
        return []
    out: list[Mutation] = []
    offsets = _Offsets(text)
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        body = function.body[1:] if ast.get_docstring(function) else function.body
        for statement in body:
            for node in ast.walk(statement):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                    continue
                for kind, replacement in _variants(node):
                    mutation = _apply(path, text, offsets, function.name, kind, node, replacement, function)
                    if mutation is not None:
                        out.append(mutation)
    unique = {(m.line, m.before, m.after): m for m in out}
    return list(unique.values())


def _apply(path, text, offsets, function_name, kind, node, replacement, function) -> Mutation | None:
    start, end = offsets.bounds(node)
    before = text[start:end]
    if replacement is None:
        if not _removable(function, node):
            return None
        line_start = text.rfind("\n", 0, start) + 1
        line_end = text.find("\n", end)
        line_end = len(text) if line_end < 0 else line_end + 1
        if text[line_start:start].strip():
            return None
        after, start, end = "", line_start, line_end
        before = text[start:end]
    else:
        after = ast.unparse(replacement)
        if "\n" in before and isinstance(node, ast.expr):
            after = f"({after})"
    if before == after:
        return None
    return Mutation(
        path=path,
        function=function_name,
        kind=kind,
        line=node.lineno,
        before=before,
        after=after,
        text=text,
        start=start,
        end=end,
    )
