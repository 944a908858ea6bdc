"""Where a task's units live: which bug, where it shows, which modules, which names.

Level 1 keeps everything in one module and the bug in the function the report names. Level 2 moves
the bug into a base helper in another module, called by the function the report names. Level 3
spreads the family over three modules (base, helpers, API) plus an unrelated module, and the bug sits
in a base helper reached from the API through a middle-layer helper.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from random import Random
from string import Template

from services.catalog.families.base import Family, Mutation, Unit
from services.catalog.render import module_source

_CORE = ("core", "base", "primitives")
_MIDDLE = ("ops", "helpers", "calc")


@dataclass(kw_only=True)
class Placed:
    family: Family
    unit: Unit
    name: str
    module: str
    params: dict[str, object] = field(default_factory=dict)

    @property
    def uid(self) -> str:
        return f"{self.family.key}.{self.unit.key}"


@dataclass(kw_only=True)
class Placement:
    package: str
    description: str
    placed: list[Placed]
    bug: Placed
    mutation: Mutation
    symptom: Placed
    module_docs: dict[str, str]
    """Module name -> docstring, in load order (dependencies first)."""
    difficulty: int

    def mapping(self, placed: Placed) -> dict[str, str]:
        names = {p.unit.key: p.name for p in self.placed if p.family is placed.family}
        return names | {f"p_{key}": repr(value) for key, value in placed.params.items()}

    def render(self, template: str, placed: Placed | None = None) -> str:
        return Template(template).substitute(self.mapping(placed or self.bug))

    def body(self, placed: Placed, *, buggy: bool) -> str:
        source = placed.unit.source
        if buggy and placed is self.bug:
            source = source.replace(self.mutation.find, self.mutation.replace)
        return self.render(source, placed)

    def modules(self, *, buggy: bool) -> list[tuple[str, str]]:
        out = []
        for module, doc in self.module_docs.items():
            members = [p for p in self.placed if p.module == module]
            imports: dict[str, set[str]] = {}
            for p in members:
                for key in p.unit.calls:
                    callee = next(q for q in self.placed if q.family is p.family and q.unit.key == key)
                    if callee.module != module:
                        imports.setdefault(callee.module, set()).add(callee.name)
            out.append((module, _module_source(doc, members, imports, self, buggy)))
        return out

    def sources(self, *, buggy: bool) -> dict[str, str]:
        init = f'"""{self.description}"""\n'
        return {f"{self.package}/__init__.py": init} | {
            f"{self.package}/{module}.py": text for module, text in self.modules(buggy=buggy)
        }

    @property
    def exports(self) -> dict[str, str]:
        return {p.name: p.module for p in self.placed}

    def path_of(self, placed: Placed) -> str:
        return f"{self.package}/{placed.module}.py"

    def probes(self, rng: Random) -> list[tuple[Placed, str, str]]:
        seen: set[tuple[str, str]] = set()
        out = []
        for p in self.placed:
            for probe in p.unit.probes(rng):
                setup, expr = self.render(probe.setup, p), self.render(probe.expr, p)
                if (setup, expr) not in seen:
                    seen.add((setup, expr))
                    out.append((p, setup, expr))
        return out

    def leaks(self, text: str) -> bool:
        """Whether a statement gives away the fix: the changed code, or (above level 1) the buggy unit."""
        snippets = [self.render(self.mutation.find).strip(), self.render(self.mutation.replace).strip()]
        if any(len(s) >= 6 and s in text for s in snippets):
            return True
        return self.difficulty > 1 and re.search(rf"\b{re.escape(self.bug.name)}\b", text) is not None


def _module_source(
    doc: str, members: list[Placed], imports: dict[str, set[str]], p: Placement, buggy: bool
) -> str:
    stdlib = [name for m in members for name in m.unit.imports]
    bodies = [p.body(m, buggy=buggy) for m in members]
    return module_source(doc=doc, stdlib=stdlib, imports=imports, bodies=bodies)


def place(*, rng: Random, family: Family, difficulty: int, filler: Family) -> Placement | None:
    pairs = [
        (b, s) for b in family.units if b.mutations for s in family.units if _fits(family, b, s, difficulty)
    ]
    if not pairs:
        return None
    bug, symptom = rng.choice(pairs)
    mutation = rng.choice(bug.mutations)
    if difficulty == 3:
        keys = {u.key for u in family.units}
    else:
        others = [u.key for u in family.units if u.key != symptom.key]
        keys = family.closure({symptom.key, *rng.sample(others, k=min(difficulty, len(others)))})
    topic = rng.choice(family.topics)
    core, middle = rng.choice(_CORE), rng.choice(_MIDDLE)
    docs = {topic: family.description}
    if difficulty == 2:
        docs = {core: f"Building blocks of {family.key} helpers."} | docs
    elif difficulty == 3:
        docs = {
            core: f"Building blocks of {family.key} helpers.",
            middle: "Helpers built on the core functions.",
        } | docs

    def module_for(unit: Unit) -> str:
        if difficulty == 1 or (difficulty == 2 and unit.layer > 0):
            return topic
        return (core, middle, topic)[unit.layer] if difficulty == 3 else core

    placed = [
        Placed(family=family, unit=u, name=rng.choice(u.names), module=module_for(u))
        for u in sorted((family.unit(k) for k in keys), key=lambda u: (u.layer, family.units.index(u)))
    ]
    if difficulty == 3:
        filler_topic = rng.choice(filler.topics)
        if filler_topic in docs:
            return None
        docs[filler_topic] = filler.description
        filler_keys = filler.closure(set(rng.sample([u.key for u in filler.units], k=2)))
        placed += [
            Placed(
                family=filler, unit=filler.unit(k), name=rng.choice(filler.unit(k).names), module=filler_topic
            )
            for k in sorted(filler_keys, key=lambda k: [u.key for u in filler.units].index(k))
        ]
    if len({p.name for p in placed}) < len(placed) or {p.name for p in placed} & set(docs):
        return None
    for p in placed:
        p.params = {key: draw(rng) for key, draw in p.unit.params.items()}
    by_key = {p.unit.key: p for p in placed if p.family is family}
    return Placement(
        package=rng.choice(family.packages),
        description=family.description,
        placed=placed,
        bug=by_key[bug.key],
        mutation=mutation,
        symptom=by_key[symptom.key],
        module_docs=docs,
        difficulty=difficulty,
    )


def _fits(family: Family, bug: Unit, symptom: Unit, difficulty: int) -> bool:
    if difficulty == 1:
        return bug is symptom
    reaches = bug.key in family.closure({symptom.key}) and bug.layer == 0
    if difficulty == 2:
        return reaches and symptom.layer >= 1
    middles = [family.unit(k) for k in family.closure({symptom.key}) if family.unit(k).layer == 1]
    return reaches and symptom.layer == 2 and any(bug.key in family.closure({m.key}) for m in middles)
