"""The fault registry: one module per fault type, each declaring what it must; rules validated
against the declared schemas; the documentation's table generated from the registry."""

from __future__ import annotations

import pkgutil
import re
from pathlib import Path

import pytest

import fakevendor
import fakevendor.faults.kinds as kinds
from fakevendor.faults import FAULTS, PARAMETERS, TYPES, RuleError, parse_rule
from fakevendor.faults import doc as fault_doc
from fakevendor.faults.base import FAMILIES, STAGES, Fault
from fakevendor.faults.registry import REGISTERED


def test_every_fault_module_is_registered_and_every_registered_type_is_one_module():
    modules = sorted(m.name for m in pkgutil.iter_modules(kinds.__path__))
    assert modules == sorted(REGISTERED), "a module under fakevendor/faults/kinds/ is not in registry.REGISTERED (or the reverse)"
    assert list(FAULTS) == list(REGISTERED) == list(TYPES)
    for name, fault in FAULTS.items():
        module = __import__(f"fakevendor.faults.kinds.{name}", fromlist=["FAULT"])
        assert module.FAULT is fault and isinstance(fault, Fault) and fault.name == name
        assert fault.family in FAMILIES and fault.stages and set(fault.stages) <= set(STAGES)
        assert fault.summary, f"{name} says what a client sees"
        assert PARAMETERS[name] == fault.params


@pytest.mark.parametrize("name", REGISTERED)
def test_every_example_and_every_parameter_example_is_a_valid_rule(name):
    fault = FAULTS[name]
    for example in fault.examples:
        parse_rule({"endpoint": "* *", "type": name, "params": example}, default_id="x")
    prefilled = {p.name: p.example for p in fault.params if p.example is not None}
    if name == "delay":
        prefilled = {"ms": prefilled["ms"]}  # delay's forms are alternatives
    parse_rule({"endpoint": "* *", "type": name, "params": prefilled}, default_id="x")


def test_fault_behaviour_lives_only_in_the_fault_modules():
    """No other module of the fake vendor chooses behaviour by comparing a fault's type with a
    name (the if/elif chains a new fault type used to need in 2-4 files)."""
    root = Path(fakevendor.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        if "kinds" in path.parts:
            continue
        text = path.read_text()
        for pattern in (r"\.type\s*(==|!=|in)\s*(\(|[\"'](?!ok[\"']))", r"kind\s*==\s*\"(" + "|".join(REGISTERED) + r")\""):
            offenders += [f"{path.relative_to(root)}: {m.group(0)}" for m in re.finditer(pattern, text)]
    assert offenders == []


@pytest.mark.parametrize("rule,field,message", [
    ({"type": "delay", "params": {"ms": 5, "msec": 1}}, "params.msec", "is not a parameter of delay"),
    ({"type": "http_error", "params": {"status": 200}}, "params.status", "at least 400"),
    ({"type": "http_error", "params": {"status": 600}}, "params.status", "at most 599"),
    ({"type": "dribble", "params": {"chunks": 2.5, "total_ms": 10}}, "params.chunks", "integer"),
    ({"type": "bandwidth", "params": {"bytes_per_s": 10, "direction": "sideways"}}, "params.direction", "one of"),
    ({"type": "reset", "params": {"stage": "mid_body"}}, "params.after_bytes", "required"),
    ({"type": "job_fail", "params": {"retryable": "yes"}}, "params.retryable", "true or false"),
    ({"type": "malformed", "params": {"status": 404}}, "params.status", "at most 299"),
    ({"sequence": ["delay", "reset"], "params": {"ms": 1, "stage": "sideways"}}, "params.stage", "one of"),
])
def test_parameters_are_checked_against_the_declared_schema_with_a_precise_message(rule, field, message):
    with pytest.raises(RuleError) as caught:
        parse_rule({"endpoint": "* *", **rule}, default_id="x")
    assert caught.value.field == field and message in caught.value.message


def test_a_sequence_accepts_the_parameters_of_each_of_its_types():
    parse_rule({"endpoint": "* *", "sequence": ["delay", "reset"], "params": {"ms": 1, "stage": "before_body"}},
               default_id="x")


def test_the_documentation_table_is_the_one_generated_from_the_registry():
    assert fault_doc.rendered(fault_doc.DOC.read_text()) == fault_doc.DOC.read_text(), \
        "docs/fakevendor.md is out of date: run python -m fakevendor.faults.doc"
    for name in REGISTERED:
        assert f"| `{name}` |" in fault_doc.table()
