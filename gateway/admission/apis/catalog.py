"""Every API the gateway serves, by route and by name: the server's routes, the metrics' ``api``
label, the shape of an error on any path, are all read from here (adding an API: its module,
and one line below)."""

from __future__ import annotations

from types import MappingProxyType

from ..upload import EDITS, TRANSCRIPTIONS, TRANSLATIONS
from . import CHAT, COMPLETIONS, IMAGES, REALTIME, SPEECH, Api, ErrorShape
from .messages import COUNT_TOKENS, MESSAGES
from .pooling import EMBEDDINGS, RERANK, SCORE
from .responses import RESPONSES

APIS: tuple[Api, ...] = (
    CHAT, COMPLETIONS, RESPONSES, MESSAGES, COUNT_TOKENS, EMBEDDINGS, SCORE, RERANK, TRANSCRIPTIONS, TRANSLATIONS,
    IMAGES, EDITS, SPEECH, REALTIME,
)  # fmt: skip
BY_PATH = MappingProxyType({path: api for api in APIS for path in api.paths})
BY_NAME = MappingProxyType({api.name: api for api in reversed(APIS)})  # messages: MESSAGES, not COUNT_TOKENS
UNVERSIONED = frozenset(path for path in BY_PATH if not path.startswith("/v1/"))  # vLLM's pooling routes


def shape_of(path: str) -> ErrorShape:
    """The shape of the errors (and request ids) a path answers: its API's; below an API's path
    (``/v1/messages/batches``, which the gateway does not serve), that API's; else OpenAI's."""
    api = BY_PATH.get(path)
    if api is not None:
        return api.errors
    return next((a.errors for a in APIS if path.startswith(a.path + "/")), "openai")


def is_api(path: str) -> bool:
    """Whether a path is an API's (with ``auth:``, a key is needed)."""
    return path.startswith("/v1/") or path in UNVERSIONED
