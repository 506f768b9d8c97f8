"""A chat-completions call for connectors whose package brings no OpenAI client (standard library only).

Connectors whose package has its own client (verifiers, OpenEnv's examples) point that client at
`request.base_url` instead. The call runs in a thread: urllib blocks.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

from miles.envserver.protocol import EpisodeRequest


class ModelCallError(RuntimeError):
    """The session endpoint refused the call or answered something that is not a chat completion."""


def _post(url: str, api_key: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"}
    request = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            answer: dict[str, Any] = json.loads(response.read())
            return answer
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:2000]
        raise ModelCallError(f"{url} answered {exc.code}: {detail}") from exc


async def chat(
    request: EpisodeRequest, messages: list[dict[str, Any]], *, timeout_s: float = 600.0, **overrides: Any
) -> dict[str, Any]:
    """One chat completion through the session (the request's sampling parameters, then `overrides`);
    returns the assistant message (`{"role": "assistant", "content": ...}`) plus `finish_reason`."""
    body = {"model": "policy", **request.request_kwargs, **overrides, "messages": messages}
    url = request.base_url.rstrip("/") + "/chat/completions"
    answer = await asyncio.to_thread(_post, url, request.api_key, body, timeout_s)
    try:
        choice = answer["choices"][0]
        message = dict(choice["message"])
    except (KeyError, IndexError, TypeError) as exc:
        raise ModelCallError(f"not a chat completion: {str(answer)[:500]}") from exc
    message["finish_reason"] = choice.get("finish_reason")
    return message
