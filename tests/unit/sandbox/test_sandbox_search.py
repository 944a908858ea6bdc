"""The search tools over a real session: grep's options, file_search's fuzzy ranking, and
codebase_search (BM25 over code chunks, optionally re-ranked by a sentence embedding)."""

from __future__ import annotations

import re

import pytest
from sandbox_archives import REPO

from services.sandbox.tools import call_tool

SHOP = {
    **REPO,
    "shop/__init__.py": "",
    "shop/cart.py": (
        "class Cart:\n"
        "    def __init__(self):\n"
        "        self.items = []\n\n"
        "    def total_price(self, discount=0):\n"
        '        """The price of every item in the cart, less the discount."""\n'
        "        return sum(item.price for item in self.items) - discount\n"
    ),
    "shop/users.py": (
        "def login_user(name, password):\n"
        '    """Check a password and open a session for the user."""\n'
        "    return name == 'admin' and password == 'secret'\n"
    ),
    "docs/pricing.md": "# Pricing\n\nThe cart total price is the sum of the item prices.\n",
}


def paths_of(output: str) -> list[str]:
    """The path of each codebase_search hit (its header line is path:first-last)."""
    return re.findall(r"^(\S+):\d+-\d+$", output, flags=re.MULTILINE)


@pytest.fixture
async def shop(new_session):
    return await new_session(SHOP)


async def test_grep_include_and_exclude_globs(shop):
    py = await call_tool(shop, "grep", {"pattern": "price", "include": "*.py"})
    assert py.ok and {line.split(":")[0] for line in py.output.splitlines()} == {"shop/cart.py"}
    both = await call_tool(shop, "grep", {"pattern": "price", "include": ["*.py", "*.md"]})
    assert {line.split(":")[0] for line in both.output.splitlines()} == {"shop/cart.py", "docs/pricing.md"}
    not_md = await call_tool(shop, "grep", {"pattern": "price", "exclude": "*.md"})
    assert {line.split(":")[0] for line in not_md.output.splitlines()} == {"shop/cart.py"}
    neither = await call_tool(shop, "grep", {"pattern": "price", "exclude": ["cart.py", "docs/**"]})
    assert neither.ok and neither.output == "no matches"
    scoped = await call_tool(shop, "grep", {"pattern": "def", "path": "shop", "include_pattern": "users*"})
    assert scoped.ok and scoped.output == "shop/users.py:1:def login_user(name, password):"


async def test_grep_case_fixed_strings_and_max_matches(shop):
    exact = await call_tool(shop, "grep", {"pattern": "CLASS CART"})
    assert exact.ok and exact.output == "no matches"
    folded = await call_tool(shop, "grep", {"pattern": "CLASS CART", "case_sensitive": False})
    assert folded.ok and folded.output == "shop/cart.py:1:class Cart:"
    # As a regex, `add(a, a)` would look for "adda, a"; as a fixed string it finds the call.
    regex = await call_tool(shop, "grep", {"pattern": "add(a, a)"})
    assert regex.output == "no matches"
    fixed = await call_tool(shop, "grep", {"pattern": "add(a, a)", "fixed_strings": True})
    assert fixed.ok and fixed.output == "calc/ops.py:6:    return add(a, a)"
    capped = await call_tool(shop, "grep", {"pattern": "^line", "max_matches": 5})
    assert capped.ok and capped.truncated
    lines = capped.output.splitlines()
    assert lines[:5] == [f"README.md:{i}:line {i}" for i in range(2, 7)]
    assert len(lines) == 6 and "more than 5 matches" in lines[-1]
    whole = await call_tool(shop, "grep", {"pattern": "^line 99\\d$", "max_matches": 50})
    assert whole.ok and not whole.truncated and len(whole.output.splitlines()) == 10


async def test_file_search_ranks_fuzzy_path_matches(shop):
    # Every path containing "ops" matches it equally well; the file named ops comes first, ahead of
    # paths that sort before it.
    for path in ("app/test_ops.py", "app/ops_helpers.py"):
        assert (await call_tool(shop, "create_file", {"path": path, "content": ""})).ok
    ops = await call_tool(shop, "file_search", {"query": "ops"})
    assert ops.ok and ops.output.splitlines()[0] == "calc/ops.py"
    assert {"tests/test_ops.py", "app/test_ops.py", "app/ops_helpers.py"} <= set(ops.output.splitlines())
    cart = await call_tool(shop, "file_search", {"query": "shop cart"})
    assert cart.output.splitlines()[0] == "shop/cart.py"
    readme = await call_tool(shop, "file_search", {"query": "readme"})
    assert readme.output.splitlines()[0] == "README.md"
    one = await call_tool(shop, "find_file", {"file_name": "users", "max_results": 1})
    assert one.ok and one.output == "shop/users.py"
    none = await call_tool(shop, "file_search", {"query": "zzqqxxjj"})
    assert none.ok and none.output == "no matching files"


async def test_codebase_search_finds_the_relevant_chunk(shop):
    result = await call_tool(shop, "codebase_search", {"query": "total price of the cart"})
    assert result.ok, result
    hits = paths_of(result.output)
    assert hits[0] == "shop/cart.py", result.output
    assert result.output.startswith("shop/cart.py:1-7\nclass Cart:") and "def total_price" in result.output
    login = await call_tool(shop, "semantic_search", {"query": "log the user in with a password", "top_k": 1})
    assert paths_of(login.output) == ["shop/users.py"]
    unknown = await call_tool(shop, "codebase_search", {"query": "kubernetes"})
    assert unknown.ok and unknown.output == "no results"


async def test_codebase_search_path_restricts_the_scope(shop):
    everywhere = await call_tool(shop, "codebase_search", {"query": "cart total price"})
    assert {"shop/cart.py", "docs/pricing.md"} <= set(paths_of(everywhere.output))
    docs = await call_tool(shop, "codebase_search", {"query": "cart total price", "path": "docs"})
    assert docs.ok and paths_of(docs.output) == ["docs/pricing.md"]
    calc = await call_tool(shop, "codebase_search", {"query": "cart total price", "target_directory": "calc"})
    assert calc.ok and calc.output == "no results"


async def test_codebase_search_sees_edits(shop):
    before = await call_tool(shop, "codebase_search", {"query": "refund an order"})
    assert before.output == "no results"
    created = await call_tool(
        shop, "create_file", {"path": "shop/refunds.py", "content": "def refund_order(order):\n    pass\n"}
    )
    assert created.ok
    after = await call_tool(shop, "codebase_search", {"query": "refund an order"})
    assert paths_of(after.output) == ["shop/refunds.py"]
    # A change made by a command inside the sandbox is seen too.
    ran = await call_tool(
        shop, "run", {"command": "rm shop/refunds.py && echo 'def refund(): 0' > shop/money.py"}
    )
    assert ran.ok
    moved = await call_tool(shop, "codebase_search", {"query": "refund an order"})
    assert paths_of(moved.output) == ["shop/money.py"]


@pytest.mark.slow
async def test_codebase_search_rerank_with_the_embedding(shop):
    query = {"query": "check whether the password is right"}
    bm25 = await call_tool(shop, "codebase_search", query)
    reranked = await call_tool(shop, "codebase_search", {**query, "rerank": True})
    assert reranked.ok, reranked
    assert paths_of(reranked.output)[0] == "shop/users.py"
    # The embedding re-orders the BM25 candidates; it finds nothing BM25 did not.
    assert sorted(paths_of(reranked.output)) == sorted(paths_of(bm25.output))
