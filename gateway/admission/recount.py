"""A plan counted again with what its conversions made (gateway.media.converters): a PDF's page
images held to the model's image limit (its videos' frames fewer to make room) and counted with
its other images, a video's sampled frames counted as the images they are, videos counted as
probed or as sent. Admission's, as the first count was: the limits hold on what the model gets."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from ..modalities import Modality
from .dimensions import Dimensions, read_dimensions
from .parts import Part
from .plan import too_many_images
from .route import RoutePlan
from .visual import with_frames, with_videos


def fit_page_images(plan: RoutePlan, pages: Sequence[tuple[Part, int]]) -> RoutePlan:
    """The plan with the page images of its PDFs (``pages``: each file part, its images) held to
    the model's image limit with the images it is sent besides: its own, and its videos' frames,
    which become fewer where the pages need the room (as a request's images make them, at
    admission); 400 too_many_items naming the file that passes it when not even one frame a
    video is left."""
    model = plan.model
    limit = model.limits.get(Modality.IMAGE)
    made = sum(count for _, count in pages)
    if limit is None or not made:
        return plan
    gone = plan.stripped | plan.described
    images = sum(1 for p in plan.classification.parts_with(Modality.IMAGE) if p.modality not in gone)
    videos = len(plan.frame_parts)
    room = limit - images - made  # for the videos' frames
    if room >= plan.frames_per_video * videos:
        return plan
    if videos and room >= videos:
        return dataclasses.replace(plan, frames_per_video=room // videos)
    sent = images + videos  # a frame a video at least
    for part, count in pages:
        sent += count
        if sent > limit:
            besides = f"{images} image(s)" + (f" and a frame for each of {videos} video(s)" if videos else "")
            raise too_many_images(
                model,
                part,
                f"Model '{model.name}' accepts at most {limit} image(s) per request, and a PDF's pages go to it as "
                f"images (on_unsupported.file.extract.page_images): {besides} and the pages up to "
                f"{part.location}'s {count} make {sent}; send shorter or fewer PDFs, or fewer images",
            )
    return plan  # pragma: no cover - the loop passes the limit: room < 0 above


def counts_frames(plan: RoutePlan) -> bool:
    """Whether the plan's visual tokens wait for its videos' frames (counted once sampled)."""
    return bool(plan.frame_parts) and plan.model.visual_tokens is not None


def counted_later(plan: RoutePlan) -> bool:
    """Whether the plan's visual tokens are known only after admission: remote images fetched,
    images of other formats opened, videos probed or sampled, PDFs' pages rendered."""
    if counts_frames(plan) or (plan.page_images and plan.model.visual_tokens is not None):
        return True
    return plan.visual is not None and plan.visual.waits


def with_pages(plan: RoutePlan, extracted: Mapping[tuple[int, int], Mapping[str, Any]]) -> RoutePlan:
    """The plan with its PDFs' page images held to the model's image limit (its videos' frames
    fewer to make room) and, where the model counts visual tokens, counted with its other
    images and held to their limit."""
    sizes = [(p, extracted[(p.message, p.index or 0)].get("sizes", ())) for p in plan.extract_parts]
    plan = fit_page_images(plan, [(part, len(pages)) for part, pages in sizes if pages])
    if plan.model.visual_tokens is None:
        return plan
    made = [(part, [Dimensions(w, h, "png") for w, h in pages]) for part, pages in sizes if pages]
    return dataclasses.replace(plan, visual=with_frames(plan.model, plan.visual, made, "pages"))


def with_sampled_frames(plan: RoutePlan, frames: Mapping[tuple[int, int], Mapping[str, Any]]) -> RoutePlan:
    """The plan with its videos' sampled frames counted as the images they are to the model
    (sized from their JPEGs' headers), where it counts them."""
    if not counts_frames(plan):
        return plan
    sizes = [
        (p, [read_dimensions(jpeg) for jpeg in frames[(p.message, p.index or 0)].get("frames", {}).values()])
        for p in plan.frame_parts
    ]
    return dataclasses.replace(plan, visual=with_frames(plan.model, plan.visual, sizes))


def with_videos_sent(plan: RoutePlan, videos: Mapping[tuple[int, int], Any]) -> RoutePlan:
    """The plan with its videos counted as ``videos`` says (probed, or their frames as sent)."""
    assert plan.visual is not None
    return dataclasses.replace(plan, visual=with_videos(plan.model, plan.visual, videos))
