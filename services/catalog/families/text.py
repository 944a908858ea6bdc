"""Text utilities: words, truncation, wrapping, slugs, word frequencies."""

from __future__ import annotations

from random import Random

from services.catalog.families.base import Family, Mutation, Unit, call

_VOCABULARY = [
    "river",
    "stone",
    "light",
    "quick",
    "amber",
    "north",
    "garden",
    "paper",
    "window",
    "silver",
    "cloud",
    "market",
    "ember",
    "tide",
    "owl",
    "a",
    "an",
    "of",
    "to",
    "in",
    "on",
    "by",
    "it",
    "is",
    "we",
    "be",
    "at",
    "go",
]


def _sentence(rng: Random, *, low: int = 2, high: int = 9) -> str:
    words = [rng.choice(_VOCABULARY) for _ in range(rng.randint(low, high))]
    if rng.random() < 0.4:
        words[0] = words[0].capitalize()
    text = " ".join(words)
    return text + rng.choice(["", ".", "!", ", then " + rng.choice(_VOCABULARY) + "."])


def _texts(rng: Random) -> list[str]:
    repeated = " ".join([rng.choice(_VOCABULARY[:15])] * 3 + [rng.choice(_VOCABULARY[:15])] * 2)
    return [_sentence(rng) for _ in range(4)] + [repeated, _sentence(rng, low=1, high=1), "", "Go, go GO!"]


WORDS = Unit(
    key="words",
    layer=0,
    names=("words", "tokenize", "split_words"),
    summary="the words of a text (runs of letters and digits), lower-cased",
    imports=("re",),
    source='''
def $words(text):
    """The words of a text (runs of letters and digits), lower-cased."""
    return [word.lower() for word in re.findall(r"[A-Za-z0-9]+", text)]
''',
    mutations=(Mutation(kind="missing_edge_case", find="[word.lower() for word", replace="[word for word"),),
    probes=lambda rng: [call("words", t) for t in _texts(rng)],
)

TRUNCATE = Unit(
    key="truncate",
    layer=0,
    names=("truncate", "shorten", "clip_text"),
    summary="the text cut to at most width characters, ending with the suffix when something was cut",
    params={"suffix": lambda rng: rng.choice(["...", "~", "…", ">>"])},
    source='''
def $truncate(text, width, suffix=$p_suffix):
    """The text cut to at most width characters, ending with suffix when something was cut."""
    if width < len(suffix):
        raise ValueError("width is smaller than the suffix")
    if len(text) <= width:
        return text
    return text[: width - len(suffix)] + suffix
''',
    mutations=(
        Mutation(kind="comparison", find="if len(text) <= width:", replace="if len(text) < width:"),
        Mutation(
            kind="off_by_one", find="text[: width - len(suffix)]", replace="text[: width - len(suffix) + 1]"
        ),
        Mutation(
            kind="wrong_return",
            find="return text[: width - len(suffix)] + suffix",
            replace="return text[:width] + suffix",
        ),
    ),
    probes=lambda rng: (
        [call("truncate", t, len(t)) for t in _texts(rng)[:3]]
        + [call("truncate", t, rng.randint(4, 12)) for t in _texts(rng)]
        + [call("truncate", "abcdef", 1, suffix="....")]
    ),
)

WRAP = Unit(
    key="wrap",
    layer=1,
    names=("wrap", "wrap_lines", "fill_lines"),
    summary="greedy word wrap into lines of at most width characters; longer words are cut to fit",
    calls=("truncate",),
    params={"width": lambda rng: rng.choice([10, 12, 16])},
    source='''
def $wrap(text, width=$p_width):
    """Greedy word wrap into lines of at most width characters; longer words are cut to fit."""
    lines = []
    line = ""
    for word in text.split():
        word = $truncate(word, width)
        if not line:
            line = word
        elif len(line) + 1 + len(word) <= width:
            line = line + " " + word
        else:
            lines.append(line)
            line = word
    if line:
        lines.append(line)
    return lines
''',
    mutations=(
        Mutation(
            kind="comparison",
            find="len(line) + 1 + len(word) <= width",
            replace="len(line) + 1 + len(word) < width",
        ),
        Mutation(
            kind="off_by_one",
            find="len(line) + 1 + len(word) <= width",
            replace="len(line) + len(word) <= width",
        ),
        Mutation(kind="missing_edge_case", find="    if line:\n        lines.append(line)\n", replace=""),
    ),
    probes=lambda rng: (
        [call("wrap", t, rng.choice([5, 8, 11, 14])) for t in _texts(rng)]
        + [call("wrap", "aaaa bbbb cccc", 9), call("wrap", "supercalifragilistic word", 10)]
    ),
)

WORD_COUNTS = Unit(
    key="word_counts",
    layer=1,
    names=("word_counts", "count_words", "frequencies"),
    summary="how often each word of at least min_length characters occurs",
    calls=("words",),
    params={"min_length": lambda rng: rng.choice([1, 2, 3])},
    source='''
def $word_counts(text, *, min_length=$p_min_length):
    """How often each word of at least min_length characters occurs."""
    counts = {}
    for word in $words(text):
        if len(word) >= min_length:
            counts[word] = counts.get(word, 0) + 1
    return counts
''',
    mutations=(
        Mutation(kind="comparison", find="if len(word) >= min_length:", replace="if len(word) > min_length:"),
        Mutation(kind="wrong_constant", find="counts.get(word, 0) + 1", replace="counts.get(word, 1) + 1"),
    ),
    probes=lambda rng: [call("word_counts", t, min_length=rng.choice([1, 2, 3])) for t in _texts(rng)],
)

SLUGIFY = Unit(
    key="slugify",
    layer=1,
    names=("slugify", "make_slug", "url_slug"),
    summary="a URL slug: lower-case words joined by sep, cut at a word boundary to at most max_length",
    calls=("words",),
    params={"sep": lambda rng: rng.choice(["-", "_"]), "max_length": lambda rng: rng.choice([20, 24, 32])},
    source='''
def $slugify(text, *, sep=$p_sep, max_length=$p_max_length):
    """A URL slug: lower-case words joined by sep, cut at a word boundary to at most max_length."""
    slug = ""
    for word in $words(text):
        candidate = word if not slug else slug + sep + word
        if len(candidate) > max_length:
            break
        slug = candidate
    return slug
''',
    mutations=(
        Mutation(
            kind="comparison",
            find="if len(candidate) > max_length:",
            replace="if len(candidate) >= max_length:",
        ),
        Mutation(kind="boolean", find="word if not slug else", replace="word if slug else"),
    ),
    probes=lambda rng: (
        [call("slugify", t, max_length=rng.choice([8, 12, 40])) for t in _texts(rng)]
        + [call("slugify", "ab cd ef", max_length=5)]
    ),
)

TOP_WORDS = Unit(
    key="top_words",
    layer=2,
    names=("top_words", "most_common", "frequent_words"),
    summary="the n most frequent words, most frequent first, ties in alphabetical order",
    calls=("word_counts",),
    params={"n": lambda rng: rng.choice([2, 3])},
    source='''
def $top_words(text, n=$p_n):
    """The n most frequent words, most frequent first, ties in alphabetical order."""
    counts = $word_counts(text, min_length=1)
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return [word for word, _ in ranked[:n]]
''',
    mutations=(
        Mutation(kind="off_by_one", find="ranked[:n]", replace="ranked[: n - 1]"),
        Mutation(kind="wrong_operator", find="(-item[1], item[0])", replace="(item[1], item[0])"),
    ),
    probes=lambda rng: [call("top_words", t, rng.choice([1, 2, 3])) for t in _texts(rng)],
)

EXCERPT = Unit(
    key="excerpt",
    layer=2,
    names=("excerpt", "preview", "teaser"),
    summary="the first lines of the wrapped text, joined by newlines",
    calls=("wrap",),
    params={"lines": lambda rng: rng.choice([1, 2])},
    source='''
def $excerpt(text, *, width, lines=$p_lines):
    """The first lines of the wrapped text, joined by newlines."""
    return "\\n".join($wrap(text, width)[:lines])
''',
    mutations=(Mutation(kind="off_by_one", find="[:lines]", replace="[: lines + 1]"),),
    probes=lambda rng: [
        call("excerpt", t, width=rng.choice([6, 9, 12]), lines=rng.choice([1, 2])) for t in _texts(rng)
    ],
)

TEXT_STATS = Unit(
    key="text_stats",
    layer=2,
    names=("text_stats", "word_report", "analyze"),
    summary="word count, number of distinct words and the longest word (the first one on ties) of a text",
    calls=("words", "word_counts"),
    source='''
def $text_stats(text):
    """Word count, number of distinct words and the longest word (the first one on ties)."""
    found = $words(text)
    longest = ""
    for word in found:
        if len(word) > len(longest):
            longest = word
    return {"words": len(found), "distinct": len($word_counts(text, min_length=1)), "longest": longest}
''',
    mutations=(
        Mutation(
            kind="comparison", find="if len(word) > len(longest):", replace="if len(word) >= len(longest):"
        ),
    ),
    probes=lambda rng: [call("text_stats", t) for t in _texts(rng)],
)

TEXT = Family(
    key="text",
    description="Helpers for short texts: words, truncation, wrapping, slugs and word counts.",
    packages=("wordsmith", "textkit", "quill", "inkwell", "prose"),
    topics=("text", "words", "formatting"),
    units=(WORDS, TRUNCATE, WRAP, WORD_COUNTS, SLUGIFY, TOP_WORDS, EXCERPT, TEXT_STATS),
)
