"""Authoring checks on every task family: templates render, names never clash, every bug is observable."""

from __future__ import annotations

import ast
import itertools
from random import Random
from string import Template

import pytest

from services.catalog.evaluate import run_probes
from services.catalog.families import FAMILIES, Family, Unit
from services.catalog.families.base import Mutation

UNITS = [(family, unit) for family in FAMILIES for unit in family.units]
MUTATIONS = [(family, unit, m) for family, unit in UNITS for m in unit.mutations]


def _ids(case: tuple) -> str:
    return ".".join(str(getattr(part, "key", getattr(part, "kind", part))) for part in case)


def _render(family: Family, unit: Unit, names: dict[str, str], *, source: str | None = None) -> str:
    rng = Random(0)
    params = {f"p_{key}": repr(draw(rng)) for key, draw in unit.params.items()}
    return Template(source or unit.source).substitute(names | params)


def _whole_family(family: Family, names: dict[str, str], *, bug: tuple[Unit, Mutation] | None = None) -> str:
    imports = sorted({name for unit in family.units for name in unit.imports})
    bodies = []
    for unit in family.units:
        source = unit.source
        if bug is not None and bug[0] is unit:
            source = source.replace(bug[1].find, bug[1].replace)
        bodies.append(_render(family, unit, names, source=source))
    return "\n".join(f"import {name}" for name in imports) + "\n\n" + "\n\n".join(bodies)


def test_family_keys_and_names_are_unique():
    assert len({f.key for f in FAMILIES}) == len(FAMILIES)
    for family in FAMILIES:
        names = [name for unit in family.units for name in unit.names]
        assert len(names) == len(set(names)), family.key


@pytest.mark.parametrize("case", UNITS, ids=_ids)
def test_every_name_choice_renders_and_no_local_shadows_a_callee(case):
    family, unit = case
    callees = [family.unit(key) for key in unit.calls]
    for chosen in itertools.product(unit.names, *(c.names for c in callees)):
        names = {u.key: u.names[0] for u in family.units} | dict(
            zip([unit.key, *unit.calls], chosen, strict=True)
        )
        tree = ast.parse(_render(family, unit, names))
        assigned = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        assigned |= {
            a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in n.args + n.kwonlyargs
        }
        assert not assigned & set(chosen[1:]), (
            f"{unit.key} shadows a callee with {assigned & set(chosen[1:])}"
        )


@pytest.mark.parametrize("case", UNITS, ids=_ids)
def test_probes_run_on_the_fixed_code(case):
    family, unit = case
    names = {u.key: u.names[0] for u in family.units}
    probes = [
        (Template(p.setup).substitute(names), Template(p.expr).substitute(names))
        for p in unit.probes(Random(1))
    ]
    exports = {u.names[0]: "m" for u in family.units}
    outcomes = run_probes(modules=[("m", _whole_family(family, names))], exports=exports, probes=probes)
    assert len(outcomes) >= 3
    assert any(o.error is None for o in outcomes), f"every probe of {unit.key} raises: {outcomes}"
    unexpected = [
        o for o in outcomes if o.error in ("NameError", "TypeError", "AttributeError", "SyntaxError")
    ]
    assert not unexpected, unexpected


@pytest.mark.parametrize("case", MUTATIONS, ids=_ids)
def test_every_mutation_changes_some_probe_outcome(case):
    """No equivalent mutants: each injected bug is visible to the unit's own probes for some seed."""
    family, unit, mutation = case
    names = {u.key: u.names[0] for u in family.units}
    exports = {u.names[0]: "m" for u in family.units}
    for seed in range(5):
        probes = [
            (Template(p.setup).substitute(names), Template(p.expr).substitute(names))
            for p in unit.probes(Random(seed))
        ]
        fixed = run_probes(modules=[("m", _whole_family(family, names))], exports=exports, probes=probes)
        buggy = run_probes(
            modules=[("m", _whole_family(family, names, bug=(unit, mutation)))],
            exports=exports,
            probes=probes,
        )
        if any(not f.same_as(b) for f, b in zip(fixed, buggy, strict=True)):
            return
    pytest.fail(
        f"{family.key}.{unit.key}: mutation {mutation.find!r} -> {mutation.replace!r} is never observed"
    )


def test_a_mutation_must_match_its_unit_exactly_once():
    with pytest.raises(ValueError, match="exactly once"):
        Unit(
            key="u",
            layer=0,
            names=("u",),
            summary="s",
            source="def $u(x):\n    return x + x\n",
            probes=lambda rng: [],
            mutations=(Mutation(kind="off_by_one", find="x", replace="y"),),
        )
    with pytest.raises(ValueError, match="unknown bug kind"):
        Mutation(kind="typo", find="a", replace="b")
