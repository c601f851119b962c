"""Audio uploads: ``POST /v1/audio/transcriptions`` and ``/v1/audio/translations`` (multipart/form-data).

The body is an HTML form (RFC 7578): a ``file`` part (the audio), ``model``, and the engine's own
fields (``language``, ``prompt``, ``response_format``, ``stream``, ...). The gateway reads the
form's parts where they lie in the body (no copy of the audio), admits the request under the
table (the model, or a redirect target, must accept audio; the file within
``media.max_audio_bytes``), and forwards the body as the client sent it, its ``model`` field
renamed for the upstream where it must be (a splice: nothing else is written again).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config import GatewayConfig, ModelConfig
from ..errors import (
    InvalidRequestError,
    MediaRefusedError,
    Rejection,
    TooManyItemsError,
    UnsupportedModalityError,
    clip,
)
from ..modalities import Modality
from . import outputs
from .apis import Api
from .parts import CHAT_PARTS, Classification, Content, Part
from .plan import lookup
from .route import Redirect, RoutePlan, Visible

MAX_FIELDS = 64  # parts of one form
MAX_HEAD_BYTES = 8 * 1024  # the headers of one part
MAX_VALUE_BYTES = 64 * 1024  # a field other than the file (model, prompt, language, ...)
_BOUNDARY = re.compile(r'boundary=(?:"([^"]{1,70})"|([^\s;"]{1,70}))', re.IGNORECASE)
_NAME = re.compile(rb'\bname="([^"]*)"', re.IGNORECASE)
_FILENAME = re.compile(rb'\bfilename="([^"]*)"', re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    filename: str | None
    start: int  # its content: body[start:end]
    end: int


@dataclass(frozen=True, slots=True)
class Form:
    """A parsed form: its fields, where they lie in the body."""

    body: bytes
    fields: tuple[Field, ...]
    delimiter: bytes = b""  # --BOUNDARY
    closing: int = 0  # where the closing delimiter (--BOUNDARY--) begins

    def field(self, name: str) -> Field | None:
        return next((f for f in self.fields if f.name == name), None)

    def value(self, name: str) -> str | None:
        """A small field's text (None when absent); 400 when it is not UTF-8 or too large."""
        found = self.field(name)
        if found is None:
            return None
        if found.end - found.start > MAX_VALUE_BYTES:
            raise InvalidRequestError(f"the form field '{name}' is over {MAX_VALUE_BYTES} bytes", param=name)
        try:
            return self.body[found.start : found.end].decode()
        except UnicodeDecodeError:
            raise InvalidRequestError(f"the form field '{name}' is not UTF-8", param=name) from None

    def with_value(self, name: str, value: str) -> bytes:
        """The body with one field's content replaced (the rest as sent)."""
        return self.with_values({name: value})

    def with_values(self, values: Mapping[str, str]) -> bytes:
        """The body with these fields' contents: each replaced where the form has it, added as a
        part of its own before the closing delimiter where it has not (the rest as sent)."""
        pieces, at = [], 0
        for f in sorted((f for f in self.fields if f.name in values), key=lambda f: f.start):
            pieces += [self.body[at : f.start], values[f.name].encode()]
            at = f.end
        pieces.append(self.body[at : self.closing])
        for name, value in values.items():
            if self.field(name) is None:
                head = f'\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode()
                pieces += [self.delimiter, head, value.encode(), b"\r\n"]
        pieces.append(self.body[self.closing :])
        return b"".join(pieces)


def parse_form(body: bytes, content_type: str) -> Form:
    """The parts of a multipart/form-data body; 400 for anything else or a malformed one."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise InvalidRequestError("An upload is multipart/form-data (an audio's 'file' part, an edit's 'image')")
    match = _BOUNDARY.search(content_type)
    if match is None:
        raise InvalidRequestError("multipart/form-data without a boundary")
    delimiter = b"--" + (match.group(1) or match.group(2)).encode("latin-1")
    pos = body.find(delimiter)
    if pos < 0:
        raise InvalidRequestError("The form's boundary is not in its body")
    fields: list[Field] = []
    pos += len(delimiter)
    while not body.startswith(b"--", pos):  # the closing delimiter
        if len(fields) >= MAX_FIELDS:
            raise InvalidRequestError(f"The form has more than {MAX_FIELDS} parts")
        if not body.startswith(b"\r\n", pos):
            raise InvalidRequestError("A malformed multipart body (a delimiter not followed by a line break)")
        head_end = body.find(b"\r\n\r\n", pos + 2, pos + 2 + MAX_HEAD_BYTES)
        if head_end < 0:
            raise InvalidRequestError("A part of the form has no end to its headers (or over 8 KiB of them)")
        lines = body[pos + 2 : head_end].split(b"\r\n")
        disposition = next((line for line in lines if line.lower().startswith(b"content-disposition:")), b"")
        name = _NAME.search(disposition)
        if name is None:
            raise InvalidRequestError("A part of the form has no name (Content-Disposition: form-data; name=...)")
        end = body.find(b"\r\n" + delimiter, head_end + 4)
        if end < 0:
            raise InvalidRequestError("The form is cut short: a part without its closing boundary")
        filename = _FILENAME.search(disposition)
        field_name = name.group(1).decode("utf-8", "replace")
        if not field_name.endswith("[]") and any(f.name == field_name for f in fields):
            # the gateway would route by the first and the engine (starlette) serve the last: a second
            # file past max_audio_bytes, a second model; arrays (timestamp_granularities[]) repeat
            raise InvalidRequestError(f"The form has more than one '{clip(field_name)}' part", param=clip(field_name))
        fields.append(
            Field(
                field_name,
                filename.group(1).decode("utf-8", "replace") if filename else None,
                head_end + 4,
                end,
            )
        )
        pos = end + 2 + len(delimiter)
    return Form(body, tuple(fields), delimiter, pos - len(delimiter))


def _no_view(body: dict[str, Any], bounds: Any) -> list[Content]:
    return []  # the form is read by parse_form, not as JSON


TRANSCRIPTIONS = Api("transcriptions", "/v1/audio/transcriptions", CHAT_PARTS, _no_view, door="upload")
TRANSLATIONS = Api("translations", "/v1/audio/translations", CHAT_PARTS, _no_view, door="upload")
# an image edit: images in (its `image` parts, and a `mask`), an image out (the model must produce it)
EDITS = Api(
    "edits", "/v1/images/edits", CHAT_PARTS, _no_view, door="upload", operation="image_edit", makes=Modality.IMAGE
)
IMAGE_FIELDS = ("image", "image[]", "mask")  # as the OpenAI SDK sends one image, several, and the mask
_AUDIO = Classification((Part(0, None, "file", (Modality.AUDIO,), "file"),), {Modality.AUDIO: 1}, False)


def lookup_upload(config: GatewayConfig, form: Form, visible: Visible, api: Api) -> ModelConfig:
    """The model an upload names (its ``model`` field), as :func:`~gateway.admission.plan.lookup` finds it."""
    body: Mapping[str, Any] = {"model": form.value("model")}
    return lookup(config, body, visible, api.name)


def admit_upload(config: GatewayConfig, form: Form, visible: Visible, *, requested: ModelConfig, api: Api) -> RoutePlan:
    """The plan of an audio upload: its model takes audio, or redirects audio to one that does
    (and serves this API); the file within media.max_audio_bytes. Nothing else is converted.
    An image edit's: :func:`admit_edit`."""
    if api.makes is Modality.IMAGE:
        return admit_edit(config, form, visible, requested=requested, api=api)
    audio = form.field("file")
    if audio is None:
        raise InvalidRequestError("The form has no 'file' part (the audio)", param="file")
    limit = config.media.max_audio_bytes
    if audio.end - audio.start > limit:
        raise MediaRefusedError(
            f"file: the audio is {audio.end - audio.start} bytes, over media.max_audio_bytes ({limit} bytes)",
            param="file",
            rejection=Rejection(requested.name, "audio", "media_refused"),
        )
    model, redirects = _taken(config, requested, Modality.AUDIO, (visible, api.name), ("file", "'file' is audio"))
    return RoutePlan(requested.name, model, _AUDIO, redirects, api=api)


def _taken(
    config: GatewayConfig,
    requested: ModelConfig,
    modality: Modality,
    caller: tuple[Visible, str],
    where: tuple[str, str],
    produces: bool = False,
) -> tuple[ModelConfig, tuple[Redirect, ...]]:
    """The model that takes an upload's ``modality``: the one named, or the one its policy
    redirects it to (a model the ``caller``'s key may use, that serves its API, takes it, and with
    ``produces`` makes it too); else 400 ``unsupported_modality`` at ``where`` (its param, and what
    it is)."""
    if modality in requested.accepts:
        return requested, ()
    (visible, api), (param, said) = caller, where
    policy = requested.policy(modality)
    target = config.model(policy.target or "") if policy.action == "redirect" else None
    if (
        target is None
        or not (visible is None or visible(target.name))
        or api not in target.apis
        or modality not in target.accepts
        or (produces and modality not in target.produces)
    ):
        raise UnsupportedModalityError(
            f"Model '{requested.name}' does not accept {modality} input: {said}. It accepts: "
            f"{requested.accepts_text()}.",
            param=param,
            rejection=Rejection(requested.name, modality.value, "unsupported"),
        )
    return target, (Redirect(requested.name, modality, target.name),)


def admit_edit(config: GatewayConfig, form: Form, visible: Visible, *, requested: ModelConfig, api: Api) -> RoutePlan:
    """The plan of an image edit (``/v1/images/edits``): its model produces images (or its
    ``on_unsupported_output`` sends them to one that does) and takes them in, or redirects images
    to one that does both (and serves this API);
    each image and the mask within media.max_image_bytes, its images within the model's
    ``limits.image``; forwarded as sent."""
    images = [f for f in form.fields if f.name in IMAGE_FIELDS]
    if not any(f.name != "mask" for f in images):
        raise InvalidRequestError("The form has no 'image' part (the image to edit)", param="image")
    caller, where = (visible, api.name), ("image", "'image' is an image to edit")
    # a model that makes no images: where its on_unsupported_output sends them (else 400 at model)
    maker = outputs.serving(config, requested, api.name, lambda name: visible is None or visible(name))
    model, redirects = _taken(config, maker, Modality.IMAGE, caller, where, produces=True)
    if maker is not requested:
        redirects = (Redirect(requested.name, Modality.IMAGE, maker.name, output=True), *redirects)
    most = config.media.max_image_bytes
    for f in images:
        if f.end - f.start > most:
            raise MediaRefusedError(
                f"{f.name}: the image is {f.end - f.start} bytes, over media.max_image_bytes ({most} bytes)",
                param=f.name,
                rejection=Rejection(requested.name, "image", "media_refused"),
            )
    edited = [f for f in images if f.name != "mask"]
    if (limit := model.limits.get(Modality.IMAGE)) is not None and len(edited) > limit:
        raise TooManyItemsError(
            f"Model '{model.name}' takes at most {limit} image(s) per request; the form has {len(edited)}",
            param="image",
            rejection=Rejection(model.name, "image", "too_many_items"),
        )
    parts = tuple(Part(0, i, "image", (Modality.IMAGE,), f.name) for i, f in enumerate(images))
    classification = Classification(parts, {Modality.IMAGE: len(images)}, False)
    return RoutePlan(requested.name, model, classification, redirects, api=api)
