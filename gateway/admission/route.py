"""The decision admission makes for a request (:class:`RoutePlan`): the model that serves it, what
becomes of each of its parts (accepted, stripped, redirected, converted, encoded), its images
counted, its route as ``X-Gateway-Route`` says it; gateway.admission.plan makes it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

from ..config import ModelConfig
from ..config.types import ContentBounds
from ..modalities import Modality
from ..values import record
from .apis import CHAT, Api
from .parts import Classification, Content, Part
from .visual import VisualCount

# What X-Gateway-Route names, in this order, comma-separated; "direct" when none (docs/openapi.yaml)
_UNBOUNDED = ContentBounds(messages=1 << 62, parts=1 << 62, text_chars=1 << 62)


ROUTE_ACTIONS = (
    "redirect", "strip", "transcribe", "describe", "extract", "transcode", "normalize", "downscale", "speak"
)  # fmt: skip
# Image parts the gateway can turn into embeddings (image_embeds parts already are).
ENCODABLE_TYPES = frozenset({"image_url", "input_image"})

# the model names a caller may use (its API key's list); None: every model
Visible: TypeAlias = Callable[[str], bool] | None


@dataclass(frozen=True, slots=True)
class Redirect:
    source: str
    modality: Modality
    target: str
    output: bool = False  # for an output the request asked of the source (on_unsupported_output), not a part


@record
class RoutePlan:
    requested: str
    model: ModelConfig  # the model that serves the request
    classification: Classification
    redirects: tuple[Redirect, ...] = ()
    stripped: frozenset[Modality] = frozenset()
    transcribed: frozenset[Modality] = frozenset()  # audio sent to a transcription model, as text
    frames_per_video: int = 0  # on_unsupported: {video: {frames: N}}: each video as this many images
    api: Api = CHAT  # the API it came in on
    normalized: frozenset[tuple[int, int]] = frozenset()  # parts sent in the shape the engine reads (Api.normalize)
    visual: VisualCount | None = None  # its images sized and counted (the model's visual_tokens, image_pixels)
    described: frozenset[Modality] = frozenset()  # images sent to a vision model, as its description
    extracted: frozenset[Modality] = frozenset()  # files read, sent as their text
    # (place, index) of the parts of earlier turns stripped under {history: strip} (their modality rejected)
    history_stripped: frozenset[tuple[int, int]] = frozenset()
    # on_unsupported_output: {audio: {speak: M}}: the model's text answer spoken by M (gateway.server.spoken)
    speaker: str | None = None

    @property
    def route(self) -> str:
        """The X-Gateway-Route header value."""
        if not (
            self.redirects
            or self.stripped
            or self.history_stripped
            or self.transcribed
            or self.described
            or self.extracted
            or self.frames_per_video
            or self.model.video_sample
            or self.normalized
            or self.downscale_parts
            or self.speaker
        ):
            return "direct"
        stripped = bool(self.stripped_parts) or self.mutes_audio_in_video
        done = (
            bool(self.redirects),
            stripped,
            bool(self.transcribe_parts),
            bool(self.describe_parts),
            bool(self.extract_parts),
            bool(self.frame_parts or self.presample_parts),
            bool(self.normalized),
            bool(self.downscale_parts),
            self.speaker is not None,
        )
        return ", ".join(a for a, on in zip(ROUTE_ACTIONS, done, strict=True) if on) or "direct"

    @property
    def downscale_parts(self) -> tuple[Part, ...]:
        """Images the gateway resizes before sending (``on_oversize: downscale``)."""
        if self.visual is None or not self.visual.downscaled:
            return ()
        return tuple(s.part for s in self.visual.downscaled)

    @property
    def frame_parts(self) -> tuple[Part, ...]:
        """Video parts to replace by sampled frames (``on_unsupported: {video: {frames: N}}``)."""
        return self._video_urls if self.frames_per_video else ()

    @property
    def presample_parts(self) -> tuple[Part, ...]:
        """Video parts sent as vLLM's pre-sampled frames (the model's ``video: {sample: ...}``)."""
        return self._video_urls if self.model.video_sample is not None and self.api.converts else ()

    @property
    def _video_urls(self) -> tuple[Part, ...]:
        return tuple(p for p in self.classification.parts if p.type == "video_url" and p.index is not None)

    @property
    def describe_parts(self) -> tuple[Part, ...]:
        """Images to replace by their description (``on_unsupported: {image: {describe: M}}``)."""
        return self._parts_of(self.described) if self.described else ()

    @property
    def extract_parts(self) -> tuple[Part, ...]:
        """Files to replace by their text (``on_unsupported: {file: {extract: ...}}``)."""
        return self._parts_of(self.extracted) if self.extracted else ()

    @property
    def page_images(self) -> bool:
        """Whether the PDFs of ``extract_parts`` go with an image of each page (``extract:
        {page_images: true}``; validation holds that the model accepts images)."""
        return bool(self.extract_parts) and self.model.policy(Modality.FILE).page_images

    @property
    def encodes_pages(self) -> bool:
        """The PDFs' page images go through the model's image encoder, as the request's images do
        (an engine takes embeddings or pixels in one request, not both)."""
        return self.page_images and self.encoder is not None

    @property
    def transcribe_parts(self) -> tuple[Part, ...]:
        """Audio parts to replace by their transcript (``on_unsupported: {audio: {transcribe: M}}``)."""
        return self._parts_of(self.transcribed) if self.transcribed else ()

    def _parts_of(self, modalities: frozenset[Modality]) -> tuple[Part, ...]:
        """The parts (not plain strings) of these modalities, for a conversion that replaces them
        (its callers ask it only for some: these properties are read on every request)."""
        return tuple(p for p in self.classification.parts if p.modality in modalities and p.index is not None)

    @property
    def stripped_parts(self) -> tuple[Part, ...]:
        history = self.history_stripped
        return tuple(
            p for p in self.classification.parts if p.modality in self.stripped or (p.message, p.index) in history
        )

    @property
    def mutes_audio_in_video(self) -> bool:
        """Audio is stripped (or transcribed: a video's track cannot be) while kept videos carry
        their audio track, or the videos go as frames: the flag must go off."""
        if self.frames_per_video and self.classification.audio_in_video:
            return True
        return (
            (Modality.AUDIO in self.stripped or Modality.AUDIO in self.transcribed)
            and self.classification.audio_in_video
            and Modality.VIDEO not in self.stripped
            and Modality.VIDEO in self.classification.counts
        )

    def contents(self, body: dict[str, Any]) -> list[Content]:
        """The places of ``body`` the plan's parts index (its API's view; checked at admission)."""
        return self.api.contents(body, _UNBOUNDED)

    def needs_rewrite(self, body: Mapping[str, Any]) -> bool:
        if body.get("model") != self.model.upstream_name or self.normalized:
            return True
        if self.transcribe_parts or self.frame_parts or self.describe_parts or self.extract_parts:
            return True
        if self.history_stripped:
            return True
        return bool(self.stripped or self.transcribed) and (bool(self.stripped_parts) or self.mutes_audio_in_video)

    @property
    def encoder(self) -> str | None:
        """The encoder that turns this request's images into embeddings: the model's, unless the
        request has fewer images than its ``encode.min_images`` (then they go upstream raw)."""
        name = self.model.encode.get(Modality.IMAGE) if self.api.converts else None  # else: sent as they are
        if name is None or self.model.encode_min_images <= 1:
            return name
        images = len(self._encodable) + self.frames_per_video * len(self.frame_parts)  # frames planned
        return name if images >= self.model.encode_min_images else None

    @property
    def encode_decision(self) -> str | None:
        """For a request with images (or video as frames) to a model that encodes them:
        ``encoded``, or ``direct`` (under ``encode.min_images``); None otherwise."""
        if (
            Modality.IMAGE not in self.model.encode
            or not self.api.converts
            or not (self._encodable or self.frame_parts)
        ):
            return None
        return "encoded" if self.encoder is not None else "direct"

    @property
    def encodes_frames(self) -> bool:
        """Videos go as frames, and the frames go through the model's image encoder."""
        return self.encoder is not None and bool(self.frame_parts)

    @property
    def _encodable(self) -> tuple[Part, ...]:
        return tuple(p for p in self.classification.parts if p.type in ENCODABLE_TYPES)

    @property
    def encode_parts(self) -> tuple[Part, ...]:
        if self.encoder is None:
            return ()
        return self._encodable

    def action(self, part: Part) -> str:
        if self.visual is not None and (part.message, part.index) in self.visual.downscaled_at:
            return "downscale, encode" if self.encoder is not None else "downscale"
        if part.modality in self.stripped or (part.message, part.index) in self.history_stripped:
            return "strip"
        if part.modality in self.transcribed:
            return "transcribe"
        if part.modality in self.described:
            return "describe"
        if part.modality in self.extracted:
            return "extract, page images of a PDF" if self.page_images else "extract"
        if self.frames_per_video and part.type == "video_url":
            return "frames, encoded" if self.encoder is not None else "frames"
        return "encode" if self.encoder is not None and part.type in ENCODABLE_TYPES else "accept"

    def explain(self) -> dict[str, Any]:
        """The decision as JSON, for `modality-gateway explain` and debugging."""
        sized = {s.part.location: s.explain() for s in self.visual.images} if self.visual is not None else {}
        return {
            "decision": "accept",
            "requested_model": self.requested,
            "model": self.model.name,
            "upstream_model": self.model.upstream_name,
            "upstreams": list(self.model.upstreams),
            "route": self.route,
            "encoder": self.encoder,
            "encode_decision": self.encode_decision,
            "redirects": [
                {
                    "from": r.source,
                    "modality": r.modality.value,
                    "to": r.target,
                    "for": "output" if r.output else "input",
                }
                for r in self.redirects
            ],
            "counts": {m.value: n for m, n in self.classification.counts.items()},
            **({"spoken_by": self.speaker} if self.speaker is not None else {}),
            "parts": [
                {
                    "location": p.location,
                    "type": p.type,
                    "modalities": [m.value for m in p.modalities],
                    "action": self.action(p),
                    **sized.get(p.location, {}),
                }
                for p in self.classification.parts
            ],
            **({"visual_tokens": self.visual.tokens} if self.visual is not None else {}),
        }


def with_strip(route: str) -> str:
    """An X-Gateway-Route that says ``strip`` too, in its place (parts dropped after admission)."""
    done = [] if route == "direct" else route.split(", ")
    if "strip" not in done:
        done.insert(1 if done[:1] == ["redirect"] else 0, "strip")
    return ", ".join(done)
