"""Chat-template rendering with jinja2, in the same sandbox and with the same helpers as transformers.

We render with jinja2 directly instead of `tokenizer.apply_chat_template` because (1) transformers 5 drops
`None` values from messages, which changes what templates like DeepSeek-V3's render, (2) TITO renders two
tiny synthetic conversations per turn and the transformers call overhead would dominate, and (3) the session
server must not need transformers. The environment mirrors transformers' (`ImmutableSandboxedEnvironment`, here
with faster lookups that answer alike, `trim_blocks`, `lstrip_blocks`, loop controls, `tojson` without HTML
escaping and with `ensure_ascii=False`, `raise_exception`, `strftime_now`, `{% generation %}` blocks); a test checks
the output equals transformers'.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from miles.session.tito.errors import TemplateRenderError

Message = Mapping[str, Any]


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


_DICT_ATTRIBUTES = frozenset(dir(dict))
_SAFE_STR_METHODS = frozenset(name for name in dir(str) if not name.startswith("_")) - {"format", "format_map"}


class _ChatTemplateSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, with a fast path for the lookups chat templates make most: on a plain dict, a key that is no
    dict attribute (`message.role`); on a str, a public method other than `format`/`format_map`, which the sandbox
    wraps (`content.startswith`); a public name of jinja's `loop` or `namespace()` (`loop.first`, `ns.flag`).
    Each gives what `ImmutableSandboxedEnvironment.getattr` gives, without its exception and safety-check round
    trip (~40 % of a small render); anything else takes the sandbox's own path."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        kind = type(obj)
        if kind is dict and attribute not in _DICT_ATTRIBUTES:
            return obj[attribute] if attribute in obj else self.undefined(obj=obj, name=attribute)
        if kind is str and attribute in _SAFE_STR_METHODS:
            return getattr(obj, attribute)
        if (kind is LoopContext or kind is Namespace) and not attribute.startswith("_"):
            try:  # jinja's own `loop` and `namespace()`: the sandbox's checks pass every public name of theirs
                value = getattr(obj, attribute)
            except AttributeError:
                return self.undefined(obj=obj, name=attribute)
            wrapped = self.wrap_str_format(value)
            return value if wrapped is None else wrapped
        return super().getattr(obj, attribute)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """Chat templates' `tojson` filter, as transformers defines it (non-ASCII kept, `, ` and `: ` separators)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template once per process (the compiled form is the expensive part)."""
    env = _ChatTemplateSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateRenderError(f"the chat template does not compile: {exc}") from exc


def render_template(
    template: jinja2.Template,
    messages: Sequence[Message],
    *,
    tools: Sequence[Mapping[str, Any]] | None,
    add_generation_prompt: bool,
    bos_token: str,
    eos_token: str,
    template_kwargs: Mapping[str, Any],
) -> str:
    """Render `messages` (already normalised, see `messages.render_view`) to text."""
    try:
        return template.render(
            messages=list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **template_kwargs,
        )
    except jinja2.TemplateError as exc:
        raise TemplateRenderError(
            f"the chat template refused these messages: {exc}. Check the roles and fields the model's template "
            "supports (e.g. a system message after the first turn, tool messages without a preceding tool call)",
            details={"template_error": str(exc)},
        ) from exc
