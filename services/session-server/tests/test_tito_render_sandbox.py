"""The render sandbox's fast lookups give exactly what jinja's ImmutableSandboxedEnvironment gives, refusals
included; the lone-surrogate pre-check agrees with the path-naming walk."""

from __future__ import annotations

import random
from typing import Any

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from miles.session.tito.messages import _holds_lone_surrogate, first_json_path, lone_surrogate
from miles.session.tito.render import _ChatTemplateSandbox

CASES = [  # (template, what jinja's sandbox renders)
    ("{{ m.role }}|{{ m.missing is defined }}|{{ m.missing }}", "user|False|"),
    ("{{ m['role'] }}{{ m.get('role') }}", "useruser"),
    ("{{ m.items is string }}|{{ m['items'] }}|{{ m.keys() | list | length }}", "False|shadowed|3"),  # attribute first
    ("{{ m.content.startswith('he') }}|{{ m.content.split('l') | length }}|{{ m.content.upper() }}", "True|3|HELLO"),
    ("{{ m.content.nope is defined }}", "False"),
    (
        "{% for x in xs %}{{ loop.index0 }}{{ loop.first }}{{ loop.last }}{{ loop.previtem }}{% endfor %}",
        "0TrueFalse1FalseFalse12FalseTrue2",
    ),
    (
        "{% for x in xs %}{{ loop.cycle('a', 'b') }}{{ loop.changed(x) }}{{ loop.nope is defined }}{% endfor %}",
        "aTrueFalsebTrueFalseaFalseFalse",
    ),
    (
        "{% set ns = namespace(flag=false, n=0) %}{% for x in xs %}{% set ns.n = ns.n + x %}{% endfor %}"
        "{{ ns.n }}{{ ns.flag }}{{ ns.absent is defined }}",
        "5FalseFalse",
    ),
    ("{% set ns = namespace(f='<{0}>'.format) %}{{ ns.f('x') }}", "<x>"),
    # Refusals (a plain jinja Environment renders each differently): unsafe attributes, also through str.format,
    # render as undefined; mutating a dict raises.
    ("{{ m.content.__class__ }}|{{ m.__class__ }}|{{ m.content._x is defined }}", "||False"),
    ("{% for x in xs %}{{ loop._after is defined }}{% endfor %}", "FalseFalseFalse"),
    ("{% set ns = namespace(a=1) %}{{ ns._Namespace__attrs is defined }}", "False"),
    ("{{ '{0.__class__}'.format(1) }}", ""),
    ("{% set ns = namespace(f='{0.__class__}'.format) %}{{ ns.f(1) }}", ""),
    ("{{ m.update({'role': 'x'}) }}", "SecurityError"),
]
NUM_ALLOWED = 9
CONTEXT: dict[str, Any] = {"m": {"role": "user", "content": "hello", "items": "shadowed"}, "xs": [1, 2, 2]}


def _outcome(env: jinja2.Environment, source: str) -> str:
    try:
        return env.from_string(source).render(**CONTEXT)
    except SecurityError:
        return "SecurityError"


@pytest.mark.parametrize(("source", "expected"), CASES)
def test_fast_lookups_equal_the_jinja_sandbox(source: str, expected: str) -> None:
    assert _outcome(ImmutableSandboxedEnvironment(), source) == expected
    assert _outcome(_ChatTemplateSandbox(), source) == expected
    if CASES.index((source, expected)) >= NUM_ALLOWED:
        assert _outcome(jinja2.Environment(), source) != expected


def _random_json(rng: random.Random, depth: int = 0) -> Any:
    strings = ["plain", "Zürich ☕", "\ud800", "a\udfffb", "😀", ""]
    kind = rng.randrange(5 if depth < 4 else 2)
    if kind == 0:
        return rng.choice(strings)
    if kind == 1:
        return rng.choice([1, 2.5, None, True])
    if kind == 2:
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 3:
        return tuple(_random_json(rng, depth + 1) for _ in range(rng.randrange(3)))
    return {rng.choice(strings) + str(i): _random_json(rng, depth + 1) for i in range(rng.randrange(4))}


def test_the_surrogate_pre_check_agrees_with_the_path_walk() -> None:
    rng = random.Random(7)
    values = [_random_json(rng) for _ in range(2000)]
    found = [first_json_path(value, lone_surrogate) is not None for value in values]
    assert [_holds_lone_surrogate(value) for value in values] == found
    assert 200 < sum(found) < 1800  # both answers occur often
