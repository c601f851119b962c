"""The conversions a request's plan asks for, as data: each one :class:`Converter` (whether the
plan wants it, its span, what it does), and the order they run in, written once
(:data:`CONVERTERS`). The exchange runs them (gateway.server.exchange's ``convert``): adding a
conversion is a module of its own and one line here.

The order matters: images of ``remote: fetch`` are fetched, and inline ones of other formats
opened, first, so that the limits hold on their sizes before anything is decoded; videos are
probed (their containers read) before anything is sampled; then images downscaled, audio
transcribed, images described, files extracted (their page images counted), videos sampled into
frames (counted), or pre-sampled as vLLM takes them. What a conversion makes is counted again by
admission (gateway.admission.recount's ``with_pages``, ``with_sampled_frames``, ``with_videos_sent``):
the limits hold on what the model will get.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..admission.recount import with_pages, with_sampled_frames, with_videos_sent
from ..admission.route import RoutePlan, with_strip
from ..config import MediaConfig
from ..config.generation import Generation
from ..metrics import GatewayMetrics
from ..tracing import Attributes, Tracing, stage
from ..upstream.replicas import Pool
from ..upstream.usage import Usage
from . import probe, remote, video
from .asking import dropped
from .conversions import ConversionCache
from .decoders import DecoderPool
from .describe import Describer
from .documents import Documents
from .downscale import Resizing, downscale_for
from .fetch import MediaFetcher
from .transcribe import Transcriber

Made = dict[tuple[int, int], dict[str, Any]]  # (place, index) -> what takes the part's place


@dataclass(frozen=True, slots=True)
class Tools:
    """What the conversions work with, of the process (gateway.server.state's Services)."""

    fetcher: MediaFetcher
    decoders: DecoderPool
    cache: ConversionCache
    metrics: GatewayMetrics
    transcriber: Transcriber | None
    describer: Describer | None
    documents: Documents | None


@dataclass(slots=True)
class Job:
    """One request's conversions: its plan (counted again as they go), its body whole, its
    config generation, and what they made; ``spend``: what a conversion's own request to a model
    cost (a description's), spent of the request's key."""

    plan: RoutePlan
    body: dict[str, Any]
    live: Generation[Pool]
    request_id: str
    tools: Tools
    spend: Callable[[str, Usage], None]
    made: Made = field(default_factory=dict)
    route: str | None = None  # X-Gateway-Route, where a conversion changed it (an image not described)
    fetched: dict[tuple[int, int], bytes] = field(default_factory=dict)  # remote images' bytes
    _sampling: video.Sampling | None = None

    @property
    def media(self) -> MediaConfig:
        return self.live.config.media  # the request's rules: a reload does not change them under it

    def sampling(self) -> video.Sampling:
        """What sampling the request's videos uses: made once, for all of them."""
        if self._sampling is None:
            t = self.tools
            self._sampling = video.Sampling(self.plan.model.name, t.fetcher, self.media, t.metrics, t.decoders, t.cache)
        return self._sampling


class Converter:
    """One conversion: ``wanted`` by a plan, run in a span named ``span``."""

    span: ClassVar[str] = "gateway.decode"
    conversion: ClassVar[str] = ""  # the span's gateway.conversion attribute, where it says one

    def wanted(self, plan: RoutePlan) -> bool:
        raise NotImplementedError

    def attributes(self, plan: RoutePlan) -> Attributes:
        return {"gateway.conversion": self.conversion}

    async def run(self, job: Job) -> None:
        raise NotImplementedError


class Sized(Converter):
    """Images sized after admission: remote ones fetched (``remote: fetch``), inline ones of other
    formats opened (gateway.media.remote); their bytes go inline, as measured."""

    span = "gateway.fetch"

    def wanted(self, plan: RoutePlan) -> bool:
        return plan.visual is not None and bool(plan.visual.to_fetch)

    def attributes(self, plan: RoutePlan) -> Attributes:
        assert plan.visual is not None
        return {"gateway.media.image.count": len(plan.visual.to_fetch)}

    async def run(self, job: Job) -> None:
        t = job.tools
        job.plan, job.fetched = await remote.sized(job.plan, job.body, t.fetcher, job.media, t.decoders)
        job.made |= remote.inline(job.plan, job.body, job.fetched)  # the bytes measured, not the URL again


class Probed(Converter):
    """Videos' containers read for what they cost (``visual_tokens: {video: ...}``), where the
    gateway samples none of them."""

    conversion = "probe"

    def wanted(self, plan: RoutePlan) -> bool:
        return plan.visual is not None and bool(plan.visual.to_probe) and not plan.presample_parts

    async def run(self, job: Job) -> None:
        videos, inline = await probe.probed(job.plan, job.body, job.sampling())  # the limits hold
        job.plan = with_videos_sent(job.plan, videos)
        job.made |= inline


class Downscaled(Converter):
    conversion = "downscale"

    def wanted(self, plan: RoutePlan) -> bool:
        return bool(plan.downscale_parts)

    async def run(self, job: Job) -> None:
        t = job.tools
        resizing = Resizing(t.decoders, t.cache, t.metrics, job.media.max_image_bytes)
        job.made |= await downscale_for(job.plan, job.body, resizing, job.fetched)


class Transcribed(Converter):
    span = "gateway.transcribe"

    def wanted(self, plan: RoutePlan) -> bool:
        return bool(plan.transcribe_parts)

    def attributes(self, plan: RoutePlan) -> Attributes:
        return {"gateway.media.audio.count": len(plan.transcribe_parts)}

    async def run(self, job: Job) -> None:
        assert job.tools.transcriber is not None
        job.made |= await job.tools.transcriber.transcribe(job.plan, job.body, job.live, request_id=job.request_id)


class Described(Converter):
    span = "gateway.describe"

    def wanted(self, plan: RoutePlan) -> bool:
        return bool(plan.describe_parts)

    def attributes(self, plan: RoutePlan) -> Attributes:
        return {"gateway.media.image.count": len(plan.describe_parts)}

    async def run(self, job: Job) -> None:
        describer, plan = job.tools.describer, job.plan
        assert describer is not None
        described = await describer.describe(plan, job.body, job.live, request_id=job.request_id, spend=job.spend)
        if gone := dropped(described):  # on_error: strip: counted and said as strip's are
            job.tools.metrics.stripped_parts.labels(plan.model.name, "image").inc(gone)
            job.route = with_strip(plan.route)
        job.made |= described


class Extracted(Converter):
    span = "gateway.extract"

    def wanted(self, plan: RoutePlan) -> bool:
        return bool(plan.extract_parts)

    def attributes(self, plan: RoutePlan) -> Attributes:
        return {"gateway.media.file.count": len(plan.extract_parts)}

    async def run(self, job: Job) -> None:
        documents, plan = job.tools.documents, job.plan
        assert documents is not None
        chars = job.live.config.server.max_text_chars
        extracted = await documents.extract(plan, job.body, max_text_chars=chars, media=job.media)
        job.made |= extracted
        if plan.page_images:  # the pages are images to the model: held to its image limit, their tokens count
            job.plan = with_pages(plan, extracted)


class Frames(Converter):
    conversion = "frames"

    def wanted(self, plan: RoutePlan) -> bool:
        return bool(plan.frame_parts)

    async def run(self, job: Job) -> None:
        frames = await video.frames_for(job.plan, job.body, job.sampling())
        job.made |= frames
        job.plan = with_sampled_frames(job.plan, frames)  # the frames are images to the model


class Presampled(Converter):
    conversion = "presample"

    def wanted(self, plan: RoutePlan) -> bool:
        return bool(plan.presample_parts)

    async def run(self, job: Job) -> None:
        plan = job.plan
        presampled = await video.presampled_for(plan, job.body, job.sampling())
        job.made |= presampled
        if plan.visual is not None and plan.visual.to_probe:  # counted as the engine gets them: the frames sent
            sent = {at: probe.sampled_info(part["video_url"]["url"]) for at, part in presampled.items()}
            job.plan = with_videos_sent(plan, sent)


CONVERTERS: tuple[Converter, ...] = (
    Sized(), Probed(), Downscaled(), Transcribed(), Described(), Extracted(), Frames(), Presampled()
)  # fmt: skip


def wanted(plan: RoutePlan) -> bool:
    """Whether the plan asks for any conversion: every converter's ``wanted`` at once, read
    without a call (the text request, which wants none, asks it; tests/media/test_converters.py
    holds it to the converters)."""
    visual = plan.visual
    return bool(
        (visual is not None and (visual.to_fetch or visual.to_probe))
        or plan.downscale_parts
        or plan.transcribe_parts
        or plan.describe_parts
        or plan.extract_parts
        or plan.frame_parts
        or plan.presample_parts
    )


async def convert(job: Job, tracing: Tracing | None) -> None:
    """Every conversion the job's plan wants, in order, each in its span."""
    for converter in CONVERTERS:
        if converter.wanted(job.plan):
            with stage(tracing, converter.span, converter.attributes(job.plan)):
                await converter.run(job)
