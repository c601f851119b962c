"""The modalities a model may accept: below everything that names them (config, admission, metrics)."""

from __future__ import annotations

from enum import StrEnum


class Modality(StrEnum):
    TEXT = "text"
    IMAGE = "image"
    VIDEO = "video"
    AUDIO = "audio"
    FILE = "file"  # documents: a chat `file` part, a Responses `input_file`, an Anthropic `document`


MODALITIES = tuple(Modality)  # in order; iterating the Enum class itself costs a call per member
MODALITY_NAMES = tuple(m.value for m in MODALITIES)
