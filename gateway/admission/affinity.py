"""The affinity key of a request: what must be the same for two requests to share engine caches.

A multi-turn chat resends its whole history every turn, its images included; an engine that
served the previous turn holds that prefix in its KV cache (vLLM's automatic prefix caching,
SGLang's radix cache) and the images' encoder outputs in its multimodal cache. The key is the
conversation's opening: every message up to and including the first user message (the system
prompt, the first question and its images). Later turns of the same chat share it, so
``balance: affinity`` (gateway.upstream.replicas) sends them to the same replica.

Hashing must cost little next to the request: text is hashed whole (it is bounded by
``server.max_text_chars``), but an image URL, which may be a data URL of megabytes, by its length
and its first and last :data:`URL_SAMPLE` bytes: two different images of the same size that agree
there are a cache miss, nothing worse.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

URL_SAMPLE = 1024


def chat_key(body: Mapping[str, Any]) -> bytes | None:
    """The key of a chat completions (or Anthropic Messages) body; None when it has no user
    message to key on."""
    return _opening(body.get("messages"), body.get("system"))


def responses_key(body: Mapping[str, Any]) -> bytes | None:
    """The key of a Responses body: its instructions and input up to the first user message."""
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    return _opening(items, body.get("instructions"))


def _opening(messages: Any, system: Any) -> bytes | None:
    if not isinstance(messages, list):
        return None
    h = hashlib.blake2b(digest_size=16)
    if system is not None:
        _content(h, system)
    for message in messages:
        if not isinstance(message, dict):
            return None
        role = message.get("role")
        h.update(f"{role}\0".encode())
        _content(h, message.get("content"))
        if role == "user":
            return h.digest()
    return None


def prompt_key(body: Mapping[str, Any]) -> bytes | None:
    """The key of a completions body: the prompt's first 4 KiB (a shared preamble)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        return None
    return hashlib.blake2b(prompt[:4096].encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _content(h: Any, content: Any) -> None:
    if isinstance(content, str):
        h.update(content.encode("utf-8", "surrogatepass"))
        return
    if not isinstance(content, list):
        return
    for part in content:
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        h.update(f"\0{kind}\0".encode())
        if kind in ("text", "input_text") and isinstance(part.get("text"), str):
            h.update(part["text"].encode("utf-8", "surrogatepass"))
            continue
        for field in ("image_url", "input_image", "video_url", "audio_url"):
            value = part.get(field)
            url = value.get("url") if isinstance(value, dict) else value
            if isinstance(url, str):
                data = url.encode("utf-8", "surrogatepass") if len(url) <= 2 * URL_SAMPLE else _sample(url)
                h.update(data)
        if isinstance(part.get("uuid"), str):
            h.update(part["uuid"].encode())


def _sample(url: str) -> bytes:
    return f"{len(url)}\0{url[:URL_SAMPLE]}\0{url[-URL_SAMPLE:]}".encode("utf-8", "surrogatepass")
