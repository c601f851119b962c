"""How vLLM's EC consumer says it missed an embedding that was primed for it.

A model served with ``encode:`` of ``kind: vllm`` sends its images' embeddings through vLLM's EC
connector (:mod:`gateway.encode.epd`); its upstreams load them by the images' uuids. When one is
not there (evicted, lost), the consumer answers a 500 before any byte, or a generation that ends
at once with ``finish_reason: "error"``. Such a reply is not relayed: it is a retry reason of the
upstream attempt (``ec_error``), which primes the images again (:attr:`Dispatch.reprime
<gateway.upstream.dispatch.Dispatch.reprime>`). The relay reads the bytes these functions judge:
the whole of a small reply, the opening of any other.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

from ..errors import EmbeddingsNotDeliveredError

# model text cannot forge it: inside a string its quotes are escaped
_EC_ERROR = re.compile(rb'"finish_reason":\s*"error"')
# A stream's opening that says the generation is under way: content, a tool call, another finish.
_EC_UNDER_WAY = re.compile(rb'"content":\s*"[^"]|"tool_calls":\s*\[\s*\{|"finish_reason":\s*"|\[DONE\]')
EC_PEEK_BYTES = 64 * 1024  # the most of a stream's opening read before deciding


def missed(model: str, status: int, data: bytes) -> EmbeddingsNotDeliveredError | None:
    """The error a reply with this status and these first bytes (b"": none read yet) stands for,
    or None when it is the engine's answer to relay."""
    if status == 500:
        return EmbeddingsNotDeliveredError(f"Upstream of model '{model}' answered 500")
    if _EC_ERROR.search(data) is not None:
        return EmbeddingsNotDeliveredError(f"Upstream of model '{model}' ended in error")
    return None


async def opening(chunks: AsyncIterator[bytes]) -> bytes:
    """A stream's first chunks, up to the one that says whether the generation is under way or
    ended in error (vLLM sends the assistant's role first, alone), or EC_PEEK_BYTES, or the end."""
    data = b""
    async for chunk in chunks:
        data += chunk
        if _EC_ERROR.search(data) or _EC_UNDER_WAY.search(data) or len(data) >= EC_PEEK_BYTES:
            break
    return data
