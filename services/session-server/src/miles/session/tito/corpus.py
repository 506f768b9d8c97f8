"""The conformance corpus: multi-turn agent conversations that stress what breaks naive tokenization.

Every assistant message is a turn the (simulated) engine generates, except those marked `injected` (a client
sending an assistant message as history, e.g. a few-shot example). The corpus covers tool calls with nested
JSON arguments and non-ASCII text, parallel tool calls, reasoning, empty content, user injections mid-episode
(terminal output, "could not parse your tool call"), mid-task system reminders, very long tool outputs and
whitespace at message edges. Text is NFC-normalised (tokenizers normalise it; the suite compares text exactly).
"""

# ruff: noqa: RUF001 - DeepSeek's special tokens use fullwidth bars, and the corpus is deliberately multilingual

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

INJECTED_KEY = "_injected"
"""Marks a client-injected assistant message (history, not generated). Stripped before rendering."""


@dataclass(frozen=True)
class Conversation:
    name: str
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] = ()

    @property
    def appended_roles(self) -> frozenset[str]:
        """Roles appended after the first generated turn ({tool,user,system}; injected assistants are history)."""
        first = next(i for i, m in enumerate(self.messages) if m["role"] == "assistant" and not m.get(INJECTED_KEY))
        return frozenset(m["role"] for m in self.messages[first + 1 :] if m["role"] != "assistant")

    @property
    def max_tool_calls_per_turn(self) -> int:
        return max((len(m.get("tool_calls") or []) for m in self.messages), default=0)


def _fn(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


TOOLS: tuple[dict[str, Any], ...] = (
    _fn(
        "get_weather",
        "Current weather of a city.",
        {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        ["city"],
    ),
    _fn(
        "search",
        "Search documents with filters.",
        {"query": {"type": "string"}, "filters": {"type": "object"}, "limit": {"type": "integer"}},
        ["query"],
    ),
    _fn("run_shell", "Run a shell command in the sandbox.", {"command": {"type": "string"}}, ["command"]),
    _fn(
        "write_file", "Write a file.", {"path": {"type": "string"}, "content": {"type": "string"}}, ["path", "content"]
    ),
)

_counter = iter(range(10_000))


def system(content: str) -> dict[str, Any]:
    return {"role": "system", "content": content}


def user(content: str) -> dict[str, Any]:
    return {"role": "user", "content": content}


def call(name: str, **arguments: Any) -> dict[str, Any]:
    return {
        "id": f"call_{next(_counter)}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def assistant(content: str = "", reasoning: str | None = None, *calls: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = list(calls)
    return message


def injected(content: str) -> dict[str, Any]:
    return {"role": "assistant", "content": content, INJECTED_KEY: True}


def tool(result: str, for_call: dict[str, Any]) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": for_call["id"], "content": result}


def _weather_episode() -> list[dict[str, Any]]:
    c = call("get_weather", city="Paris", unit="celsius")
    return [
        user("What's the weather in Paris?"),
        assistant("", "The user wants the weather; call the tool.", c),
        tool('{"temp_c": 21, "sky": "sunny"}', c),
        assistant("It is 21 °C and sunny in Paris.", "Report it."),
    ]


def _tool_call_conversations(sys_prompt: dict[str, Any]) -> list[Conversation]:
    """Tool calls: single, multi-step, parallel, nested non-ASCII arguments, a long chain."""
    out: list[Conversation] = []
    out.append(Conversation("single_tool", (sys_prompt, *_weather_episode()), TOOLS))
    c1, c2 = call("search", query="TITO tokenization"), call("search", query="prefix invariant", limit=3)
    out.append(
        Conversation(
            "multi_step_tools",
            (
                sys_prompt,
                user("Find what TITO means, then the invariant."),
                assistant("Searching first.", "Two searches needed.", c1),
                tool("TITO = token in, token out.", c1),
                assistant("", "Now the invariant.", c2),
                tool("Turn n's prompt extends turn n-1's.", c2),
                assistant("TITO keeps each prompt a bit-exact extension of the last one.", "Summarise."),
            ),
            TOOLS,
        )
    )
    p1, p2, p3 = call("get_weather", city="Tokyo"), call("get_weather", city="Zürich"), call("get_weather", city="Lima")
    out.append(
        Conversation(
            "parallel_tool_calls",
            (
                sys_prompt,
                user("Weather in Tokyo, Zürich and Lima?"),
                assistant("I'll check all three at once.", "Three independent calls.", p1, p2, p3),
                tool("Tokyo: 18 °C, rain", p1),
                tool("Zürich: 9 °C, fog", p2),
                tool("Lima: 24 °C, clear", p3),
                assistant("Tokyo 18 °C rain; Zürich 9 °C fog; Lima 24 °C clear.", "Combine."),
            ),
            TOOLS,
        )
    )
    nested = call(
        "search",
        query="東京 ramen – «best» ☕",
        limit=5,
        filters={
            "lang": ["ja", "en"],
            "price": {"max": 1200, "currency": "¥"},
            "open_now": True,
            "tags": [],
            "note": None,
            "rating": 4.5,
            "path": 'C:\\menus\\"2024"',
        },
    )
    out.append(
        Conversation(
            "nested_non_ascii_arguments",
            (
                sys_prompt,
                user("Find ramen in 東京 under ¥1200, open now."),
                assistant("", "Use filters.", nested),
                tool('[{"name": "一蘭", "price": 980}]', nested),
                assistant("一蘭 (¥980) is open now.", "One result."),
            ),
            TOOLS,
        )
    )
    chain: list[dict[str, Any]] = [sys_prompt, user("Set up the project: make a dir, write a file, list, test.")]
    for i, command in enumerate(["mkdir -p app", "ls app", "cat app/main.py", "python -m pytest -q app", "git status"]):
        c = call("run_shell", command=command)
        chain += [assistant(f"Step {i + 1}.", f"Run `{command}`.", c), tool(f"$ {command}\nok ({i})", c)]
    chain.append(assistant("All five steps ran.", "Done."))
    out.append(Conversation("long_tool_chain", tuple(chain), TOOLS))
    return out


def _edge_case_conversations(sys_prompt: dict[str, Any]) -> list[Conversation]:
    """Empty content and output, a very long tool output, whitespace at message edges, user follow-ups."""
    out: list[Conversation] = []
    e1 = call("run_shell", command="true")
    out.append(
        Conversation(
            "empty_content_and_output",
            (
                sys_prompt,
                user("Run `true`."),
                assistant("", "Just run it.", e1),
                tool("", e1),
                assistant("", "Nothing to add."),
                user("And now say done."),
                assistant("done", "Say done."),
            ),
            TOOLS,
        )
    )
    big = "\n".join(f"{i:05d} | INFO worker-{i % 7} processed batch {i} in {i % 97} ms — ok" for i in range(400))
    l1 = call("run_shell", command="cat /var/log/worker.log")
    out.append(
        Conversation(
            "very_long_tool_output",
            (
                sys_prompt,
                user("Read the worker log."),
                assistant("", "Read it.", l1),
                tool(big, l1),
                assistant("400 batches, all ok.", "Summarise the log."),
            ),
            TOOLS,
        )
    )
    w1 = call("write_file", path="notes.md", content="  # Title\n\n- item  \n\t- nested\n")
    out.append(
        Conversation(
            "whitespace_at_edges",
            (
                system("  Leading and trailing spaces.  \n"),
                user("\n\n  Write notes.md with a title.  \n"),
                assistant("Writing it.", "Keep the whitespace in the file.", w1),
                tool("\n  written 31 bytes  \n\n", w1),
                assistant("Wrote notes.md.", "Confirm."),
                user("   thanks   "),
                assistant("You're welcome.", "Polite."),
            ),
            TOOLS,
        )
    )
    out.append(
        Conversation(
            "user_follow_ups",
            (
                system("You are concise."),
                user("Name a prime."),
                assistant("7", "Small prime."),
                user("Another one?"),
                assistant("11", "Next."),
                user("Sum them."),
                assistant("18", "7 + 11."),
            ),
        )
    )
    return out


def _user_injection_conversations(sys_prompt: dict[str, Any]) -> list[Conversation]:
    """User messages injected mid-episode: tool chains across users, terminal output, parse-failed retries."""
    out: list[Conversation] = []
    u1, u2 = call("get_weather", city="Oslo"), call("get_weather", city="Bergen", unit="fahrenheit")
    out.append(
        Conversation(
            "multi_user_tool_chain",
            (
                sys_prompt,
                user("Oslo weather?"),
                assistant("", "Call.", u1),
                tool("Oslo: -2 °C, snow", u1),
                assistant("-2 °C and snowing in Oslo.", "Report."),
                user("And Bergen, in Fahrenheit?"),
                assistant("", "Call with unit.", u2),
                tool("Bergen: 39 °F, rain", u2),
                assistant("39 °F and rain.", "Report."),
            ),
            TOOLS,
        )
    )
    t1 = call("run_shell", command="ls")
    out.append(
        Conversation(
            "terminal_output_injection",
            (
                sys_prompt,
                user("What is in the directory?"),
                assistant("", "List it.", t1),
                tool("README.md\nsrc\n", t1),
                user(
                    "[terminal] $ ls -la\ntotal 8\ndrwxr-xr-x  2 agent agent 4096 .\n"
                    "-rw-r--r--  1 agent agent   42 README.md"
                ),
                assistant("A README.md and a src directory.", "The user pasted more output."),
            ),
            TOOLS,
        )
    )
    r1 = call("get_weather", city="Rome")
    out.append(
        Conversation(
            "parse_failed_retry",
            (
                sys_prompt,
                user("Weather in Rome?"),
                assistant('<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"', "Call it."),
                user("Your tool call could not be parsed (unterminated JSON). Respond with a valid tool call."),
                assistant("", "Retry with valid JSON.", r1),
                tool("Rome: 27 °C, clear", r1),
                assistant("27 °C and clear in Rome.", "Report."),
            ),
            TOOLS,
        )
    )
    out.append(
        Conversation(
            "thinking_multi_user",
            (
                system("Think step by step."),
                user("Is 91 prime?"),
                assistant("No: 91 = 7 × 13.", "Check small divisors: 7 × 13 = 91."),
                user("Is 97 prime?"),
                assistant("Yes, 97 is prime.", "Check 2, 3, 5, 7: none divide 97; √97 < 10."),
                user("Next prime after 97?"),
                assistant("101.", "98, 99, 100 are composite; 101 is prime."),
            ),
        )
    )
    return out


def _system_and_history_conversations(sys_prompt: dict[str, Any]) -> list[Conversation]:
    """Mid-task system messages, several roles in one append, client-injected assistant history."""
    out: list[Conversation] = []
    s1, s2 = call("run_shell", command="pytest -q"), call("run_shell", command="pytest -q -x")
    out.append(
        Conversation(
            "system_reminder_mid_task",
            (
                sys_prompt,
                user("Run the tests."),
                assistant("", "Run pytest.", s1),
                tool("3 failed, 10 passed", s1),
                system("Reminder: you have 2 tool calls left in this episode."),
                assistant("", "Stop at first failure.", s2),
                tool("1 failed", s2),
                assistant("One test fails first.", "Report."),
            ),
            TOOLS,
        )
    )
    f1, f2 = call("run_shell", command="curl -s example.com"), call("run_shell", command="curl -s example.org")
    out.append(
        Conversation(
            "retry_after_tool_error_system",
            (
                sys_prompt,
                user("Fetch example.com."),
                assistant("", "Fetch.", f1),
                tool("error: timeout after 10 s", f1),
                system("The previous tool call failed with a timeout. Try a different host."),
                assistant("Trying example.org instead.", "Switch host.", f2),
                tool("<html>ok</html>", f2),
                assistant("example.org answered.", "Done."),
            ),
            TOOLS,
        )
    )
    m1 = call("search", query="release notes")
    out.append(
        Conversation(
            "multi_role_append",
            (
                sys_prompt,
                user("Summarise the release notes."),
                assistant("", "Search.", m1),
                tool("v2: faster TITO", m1),
                user("Keep it to one line."),
                system("Answer in English."),
                assistant("v2 makes TITO faster.", "One line."),
            ),
            TOOLS,
        )
    )
    out.append(
        Conversation(
            "injected_assistant_history",
            (
                system("Answer like the example."),
                user("Capital of France?"),
                assistant("Paris.", "Easy."),
                user("Example format follows."),
                injected("Capital of Spain: Madrid."),
                user("Capital of Italy?"),
                assistant("Capital of Italy: Rome.", "Follow the example."),
            ),
        )
    )
    return out


def _mixed_conversations(sys_prompt: dict[str, Any]) -> list[Conversation]:
    """Tool and user in one append, multilingual chat, no system prompt, code and JSON in content."""
    out: list[Conversation] = []
    k1 = call("get_weather", city="Cairo")
    out.append(
        Conversation(
            "tool_then_user_in_one_append",
            (
                sys_prompt,
                user("Weather in Cairo?"),
                assistant("", "Call.", k1),
                tool("Cairo: 35 °C", k1),
                user("Also: is that hot?"),
                assistant("35 °C in Cairo; yes, that is hot.", "Answer both."),
            ),
            TOOLS,
        )
    )
    out.append(
        Conversation(
            "non_ascii_chat",
            (
                system("Réponds en français."),
                user("Qu'est-ce que «TITO» ? 🤖"),
                assistant("« Token in, token out » : le prompt est prolongé, jamais ré-encodé. ✅", "Définir TITO."),
                user("مرحبا! 你好! Привет!"),
                assistant("Bonjour ! 你好！Привет ! 👋", "Saluer dans plusieurs langues."),
            ),
        )
    )
    out.append(Conversation("no_system_prompt", tuple(_weather_episode()), TOOLS))
    code = "```python\ndef f(x: dict[str, int]) -> str:\n    return json.dumps({'a': x}, indent=2)\n```"
    cf = call("write_file", path="f.py", content=code)
    out.append(
        Conversation(
            "code_and_json_content",
            (
                sys_prompt,
                user("Write f.py that dumps JSON, show me first."),
                assistant(f"Here it is:\n{code}", "Show the code first."),
                user("Looks good, write it."),
                assistant("", "Write.", cf),
                tool('{"ok": true, "bytes": 87}', cf),
                assistant('Done: {"ok": true}.', "Report."),
            ),
            TOOLS,
        )
    )
    return out


def _conversations() -> list[Conversation]:
    sys_prompt = system("You are a careful agent. Use tools when they help.")
    groups = (
        _tool_call_conversations,
        _edge_case_conversations,
        _user_injection_conversations,
        _system_and_history_conversations,
        _mixed_conversations,
    )
    return [conversation for group in groups for conversation in group(sys_prompt)]


CORPUS: tuple[Conversation, ...] = tuple(_conversations())
