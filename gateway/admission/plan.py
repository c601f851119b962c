"""The admission decision: what happens to a request, decided before any upstream is touched.

The same for every API whose requests carry parts (gateway.admission.apis): the API says where
the parts are; the model must serve the API (``apis:``, else 400 ``unsupported_api``), and so
must a redirect target.

:func:`admit` turns a parsed request body into a :class:`RoutePlan` or raises a
:class:`~gateway.errors.GatewayError`. The rules, applied to the modalities the request carries:

1. **Redirect.** If the model does not accept a modality whose policy is ``{redirect: M}``, the whole
   request goes to ``M``, which applies its own table (step 1 again). When several modalities
   redirect, the first target (in text, image, video, audio order) that accepts every modality of
   the request wins, else the first target. routing.yaml validation forbids redirect cycles.
2. **Reject.** Any remaining modality the model does not accept with policy ``reject`` (the default)
   fails with 400 ``unsupported_modality`` at the first offending part.
3. **Strip.** Parts of a modality with policy ``strip`` are removed; a message left with no parts
   gets ``""`` as content. A video that carries its audio track (``use_audio_in_video``) stays when
   only audio is stripped: the flag is turned off instead.
4. **Limits** of the serving model apply to what is left (400 ``too_many_items``).

:mod:`gateway.admission.rewrite` applies a plan to the body, when the plan changes something.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config import GatewayConfig, ModelConfig
from ..config.engines import DIALECTS
from ..config.keys import PRODUCING_APIS
from ..config.types import Policy
from ..errors import (
    GatewayError,
    InvalidRequestError,
    ModelNotFoundError,
    Rejection,
    TooManyItemsError,
    UnsupportedApiError,
    UnsupportedModalityError,
    clip,
    did_you_mean,
)
from ..modalities import Modality
from . import outputs
from .apis import CHAT, Api
from .parts import Classification, Content, Part
from .route import Redirect, RoutePlan, Visible
from .strings import Deferred
from .visual import VisualCount, measure


# What X-Gateway-Route names, in this order, comma-separated; "direct" when none (docs/openapi.yaml)
def lookup(config: GatewayConfig, body: Mapping[str, Any], visible: Visible = None, api: str = "chat") -> ModelConfig:
    """The model a request names; 400 when it names none, 404 when the table lacks it or
    ``visible`` (the caller's API key) does not show it: the two are the same answer; 400
    ``unsupported_api`` when its upstreams do not serve ``api`` (the engine is not asked). On an
    API whose answer is an output (images, edits, speech), a model that does not produce it is
    refused at ``model``, unless its ``on_unsupported_output`` redirects the output: the model
    is then the one asked, and :func:`gateway.admission.outputs.serving` decides."""
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError("'model' is required and must be a non-empty string", param="model")
    model = config.model(name)
    if model is None or (visible is not None and not visible(name)):
        names = [m.name for m in config.models if visible is None or visible(m.name)]  # never one it may not see
        raise ModelNotFoundError(
            f"The model '{clip(name)}' does not exist (models: {', '.join(names) or 'none'})"
            + did_you_mean(name, names),
            param="model",
        )
    if (made := PRODUCING_APIS.get(api)) is not None and Modality(made) not in model.produces:
        if model.output_policy(Modality(made)).action == "redirect":
            return model
        raise outputs.unproduced(model, Modality(made), "model")
    if api not in model.apis:
        raise UnsupportedApiError(
            f"Model '{model.name}' is not served on the {api} API here (it serves: {', '.join(model.apis)})",
            param="model",
        )
    return model


def admit(
    config: GatewayConfig,
    body: dict[str, Any],
    visible: Visible = None,
    *,
    requested: ModelConfig | None = None,
    api: Api = CHAT,
    deferred: Deferred | None = None,
) -> RoutePlan:
    """The routing decision for a body of ``api`` (chat by default); ``visible``: which model
    names the caller may use; ``requested``: the model :func:`lookup` found for it already (else
    looked up here); ``deferred``: the rest of the body's images' data URLs, where it holds their
    first characters only (gateway.admission.strings): put back if a header goes on past them."""
    if requested is None:
        requested = lookup(config, body, visible, api.name)
    model = requested
    redirects: list[Redirect] = []
    asked = api.outputs(body) if api.outputs is not None else None
    speaker = None
    if asked:  # audio or images out, not text alone
        model, moved, speaker = outputs.decide(
            config,
            model,
            asked,
            lambda name: _may_use(visible, name) and _serves(config, name, api.name),
            may_speak=lambda name: _may_use(visible, name),
            streams=body.get("stream") is True,
        )
        if moved is not None:
            redirects.append(Redirect(*moved, output=True))
    decided = model.name
    bounds = config.server.content_bounds
    contents = api.contents(body, bounds)  # the API's view: classified, and its images sized
    classification = api.classify(body, model=requested.name, bounds=bounds, contents=contents)
    present = classification.present
    normalized = classification.normalized
    lacking = model.dialect.lacking(api.name)  # model.takes_on(api.name), without building it
    if all(m in model.accepts and m not in lacking for m in present):  # nothing to redirect, reject or strip
        if api.engine_shapes:
            _check_shapes(model, contents)
        _enforce_limits(model, classification, frozenset())
        if asked:
            speaker = outputs.spoken(model, decided, body.get("audio"), asked, redirects, speaker)
            outputs.tool_sizes(model, body)  # the serving model's output_limits
        visual = _measure(model, classification, contents, deferred=deferred) if model.counts_images else None
        return RoutePlan(
            requested.name,
            model,
            classification,
            tuple(redirects),
            api=api,
            normalized=normalized,
            visual=visual,
            speaker=speaker,
        )
    configured = model.accepts  # the model's own, before its engine narrows them on this API
    model = _on_api(model, api.name)
    while True:
        redirect = _choose_redirect(config, model, present, _Caller(visible, api.name))
        if redirect is None:
            break
        if any(r.source == redirect.target for r in redirects) or redirect.target == requested.name:
            if any(r.output for r in redirects):  # back to the model an output redirect left: the part is refused here
                break
            # validation forbids cycles; this guards a config built in code without it
            raise GatewayError(f"redirect loop at model '{model.name}'")
        redirects.append(redirect)
        target = config.model(redirect.target)
        if target is None:  # validation forbids this too
            raise GatewayError(f"model '{model.name}' redirects to '{redirect.target}', which does not exist")
        configured = target.accepts
        model = _on_api(target, api.name)
    if asked:  # an input redirect may have led away from a model that produces them (or speaks them)
        speaker = outputs.spoken(model, decided, body.get("audio"), asked, redirects, speaker)
        made = [(m, p) for m, p in asked if not (speaker is not None and m is Modality.AUDIO)]
        outputs.check(model, made, redirects)
        outputs.tool_sizes(model, body)  # the serving model's output_limits
    if api.engine_shapes:
        _check_shapes(model, contents)
    unsupported = [m for m in present if m not in model.accepts]
    # each unsupported modality by what its policy does (one the key may not use its model for: rejected)
    policies = [(m, model.policy(m)) for m in unsupported]
    history = _history(api, body, contents, classification, policies)
    on = (api.name, configured)
    # the parts {history: strip} strips are not the rejection's
    judged = classification if not history else _without(classification, history)
    if all(policy.action == "reject" for _, policy in policies):  # the common refusal: nothing else to weigh
        _reject_unsupported(model, judged, unsupported, frozenset(), redirects, on)
    doing: dict[str, set[Modality]] = {}
    for m, policy in policies:
        if policy.action not in ("transcribe", "describe") or _may_use(visible, policy.target or ""):
            doing.setdefault(policy.action, set()).add(m)
    stripped, transcribed, described, framed, extracted = (
        frozenset(doing.get(action, ())) for action in ("strip", "transcribe", "describe", "frames", "extract")
    )
    as_text = transcribed | described | extracted  # sent as a text part of the API's: only where it has one
    refused = (framed if not api.converts else frozenset()) | (as_text if not api.transcribes else frozenset())
    if refused:
        _refuse_conversion(model, classification, refused, api)
    for converted in (described, extracted):
        for m in converted:
            _hold_conversions(model, classification, m)
    handled = stripped | as_text | framed
    _reject_unsupported(model, judged, unsupported, handled, redirects, on)
    _enforce_limits(model, judged, handled)  # what is sent: not the parts {history: strip} strips
    per_video = _frames_per_video(model, judged, stripped) if framed else 0
    gone = stripped | framed | described  # not sent as images
    visual = _measure(model, judged, contents, gone, deferred) if model.counts_images else None
    plan = RoutePlan(
        requested.name,
        model,
        classification,
        tuple(redirects),
        stripped,
        transcribed,
        per_video,
        api,
        visual=visual,
        described=described,
        extracted=extracted,
        history_stripped=history,
        speaker=speaker,
    )
    if not normalized:
        return plan
    parts = (*plan.stripped_parts, *plan.transcribe_parts, *plan.describe_parts, *plan.extract_parts)
    gone_at = {(p.message, p.index) for p in parts}  # not sent as parts
    return dataclasses.replace(plan, normalized=normalized - gone_at)


def _history(
    api: Api,
    body: Mapping[str, Any],
    contents: list[Content],
    classification: Classification,
    policies: list[tuple[Modality, Policy]],
) -> frozenset[tuple[int, int]]:
    """The parts that ``{history: strip}`` strips, of a modality the model rejects: every one but
    those the user attached in the newest turn (after the model's last turn, outside tool results:
    :attr:`Api.newest`). An agent's tools' results and the earlier turns, which agents and chat
    apps resend every turn, are stripped with a note; what the user sent now is refused, so that
    they know. Computed only for a model with such a policy."""
    modalities = {m for m, policy in policies if policy.action == "reject" and policy.history == "strip"}
    if not modalities or api.newest is None:
        return frozenset()
    newest = api.newest(body)
    return frozenset(
        (p.message, p.index)
        for p in classification.parts
        if p.index is not None
        and p.modality in modalities
        and (holder := contents[p.message].holder) is not body
        and id(holder) not in newest
    )


def _without(classification: Classification, gone: frozenset[tuple[int, int]]) -> Classification:
    parts = tuple(p for p in classification.parts if (p.message, p.index) not in gone)
    return dataclasses.replace(classification, parts=parts)


def _check_shapes(model: ModelConfig, contents: list[Content]) -> None:
    """400 for a place of the request that is one engine's shape alone (vLLM's conversations,
    SGLang's items) when the model runs on another, which would refuse it or drop its media."""
    dialect = model.dialect
    if not dialect.own_shapes:  # an engine of its own: what it reads is its to say
        return
    for content in contents:
        if content.engine is not None and content.engine != dialect.name:
            raise InvalidRequestError(
                f"{content.where} is {DIALECTS[content.engine].title}'s shape, which model '{model.name}' does not "
                f"take: its engine is {dialect.title} (engine: {dialect.name}; docs/engines.md)",
                param=content.where,
            )


def _on_api(model: ModelConfig, api: str) -> ModelConfig:
    """The model as it is on ``api``: without the modalities it accepts that its engine has no
    part for there (gateway/config/engines.py), which its ``on_unsupported`` then decides."""
    takes = model.takes_on(api)
    return model if takes == model.accepts else dataclasses.replace(model, accepts=takes)


def _measure(
    model: ModelConfig,
    classification: Classification,
    contents: list[Content],
    gone: frozenset[Modality] = frozenset(),
    deferred: Deferred | None = None,
) -> VisualCount | None:
    """The request's images (and videos, with ``visual_tokens: {video: ...}``) sized and counted
    against the model's limits (gateway.admission.visual); ``gone``: the modalities not sent as
    parts (stripped, or videos as frames: counted as images once sampled)."""
    counts = classification.counts
    images = bool(counts.get(Modality.IMAGE)) and Modality.IMAGE not in gone
    spec = model.visual_tokens
    videos = (
        spec is not None and spec.video is not None and Modality.VIDEO not in gone and bool(counts.get(Modality.VIDEO))
    )
    if not (images or videos):
        return None
    kinds = (Modality.IMAGE,) * images + (Modality.VIDEO,) * videos
    parts = [p for p in classification.parts if p.modalities[0] in kinds and p.index is not None]
    return measure(model, parts, contents, deferred=deferred)


def _hold_conversions(model: ModelConfig, classification: Classification, modality: Modality) -> None:
    """A request's images to describe (at most the policy's ``max_images``: each a generation of
    the describing model) or files to read (``max_files``: each a reading in a reader process)."""
    policy = model.policy(modality)
    most, key, taken = (
        (policy.max_images, "max_images", "images as their description")
        if modality is Modality.IMAGE
        else (policy.max_files, "max_files", "files as their text")
    )
    parts = [p for p in classification.parts if p.modality is modality and p.index is not None]
    if len(parts) > most:
        part = parts[most]
        raise TooManyItemsError(
            f"Model '{model.name}' takes {taken}, at most {most} a request "
            f"(on_unsupported.{modality}.{key}); this one has {len(parts)}: {part.location} is one too many",
            param=part.location,
            rejection=Rejection(model.name, modality.value, "too_many_items"),
        )


def _refuse_conversion(
    model: ModelConfig, classification: Classification, converted: frozenset[Modality], api: Api
) -> None:
    """Audio to transcribe or video to sample, on an API whose parts the gateway does not convert:
    refused as the model's own modality, saying where it is served."""
    part = next(p for p in classification.parts if p.modality in converted)
    action = {Modality.AUDIO: "as its transcript", Modality.IMAGE: "as its description",
              Modality.FILE: "as its text"}.get(part.modality, "as frames")  # fmt: skip
    where = "the chat API" if part.modality is Modality.VIDEO else "the chat, Responses and Messages APIs"
    raise UnsupportedModalityError(
        f"Model '{model.name}' does not accept {part.modality} input, and takes it only {action}, which the gateway "
        f"makes on {where}, not on the {api.name} API: {part.location} is '{part.type}'. "
        f"It accepts: {model.accepts_text()}.",
        param=part.location,
        rejection=Rejection(model.name, part.modality.value, "unsupported"),
    )


def _frames_per_video(model: ModelConfig, classification: Classification, stripped: frozenset[Modality]) -> int:
    """How many frames each video becomes: the policy's, fewer when the model's image limit would
    be passed; 400 too_many_items when not even one frame per video fits."""
    policy = model.policy(Modality.VIDEO)
    videos = [p for p in classification.parts if p.type == "video_url"]
    if not videos:
        return policy.frames
    images = [p for p in classification.parts_with(Modality.IMAGE) if p.modality not in stripped]
    # the model's image limit, and MAX_FRAMES_PER_REQUEST frames in all whatever it says
    limit = min(model.limits.get(Modality.IMAGE, len(images) + MAX_FRAMES), len(images) + MAX_FRAMES)
    per_video = min(policy.frames, (limit - len(images)) // len(videos))
    if per_video < 1:
        raise too_many_images(
            model,
            videos[0],
            f"Model '{model.name}' accepts at most {limit} image(s) per request and takes video as frames: "
            f"{len(images)} image(s) and {len(videos)} video(s) leave no room for even one frame per video "
            f"({videos[0].location}).",
        )
    return per_video


def too_many_images(model: ModelConfig, part: Part, message: str) -> TooManyItemsError:
    """400 too_many_items at ``part``: the images a request would send pass the model's limit."""
    return TooManyItemsError(
        message, param=part.location, rejection=Rejection(model.name, Modality.IMAGE.value, "too_many_items")
    )


NOTHING = Classification((), {}, False)  # a request of no content parts


def admit_output(
    config: GatewayConfig, body: Mapping[str, Any], visible: Visible, *, requested: ModelConfig, api: Api
) -> tuple[RoutePlan, dict[str, str]]:
    """The plan of a request whose answer is an output of its own (images, speech): the model
    that produces it (the one named, or its output's redirect target), and, for images, the
    request held to that model's ``output_limits`` and the fields to set of it
    (:func:`gateway.admission.outputs.generation`)."""
    model = outputs.serving(config, requested, api.name, lambda name: _may_use(visible, name))
    made = Modality(PRODUCING_APIS[api.name])
    moved = () if model is requested else (Redirect(requested.name, made, model.name, output=True),)
    setting = outputs.generation(model, body.get) if made is Modality.IMAGE else {}
    if made is Modality.AUDIO:
        outputs.speech(model, body.get)
    return RoutePlan(requested.name, model, NOTHING, moved, api=api), setting


def _may_use(visible: Visible, model: str) -> bool:
    """Whether the caller's key may use ``model``: a model a request is redirected to, or that
    converts its media (a transcription model), counts as used by the key. One outside the key's
    list is not there for it: the modality is refused as the model's own, naming neither."""
    return visible is None or visible(model)


@dataclass(frozen=True, slots=True)
class _Caller:
    visible: Visible  # the models its key may use
    api: str  # the API it came in on: a redirect target must serve it


def _serves(config: GatewayConfig, name: str, api: str) -> bool:
    target = config.model(name)
    return target is None or api in target.apis  # a missing one: admit() says so


def _choose_redirect(
    config: GatewayConfig, model: ModelConfig, present: tuple[Modality, ...], caller: _Caller
) -> Redirect | None:
    candidates = [
        Redirect(model.name, m, policy.target)
        for m in present
        if m not in model.accepts
        and (policy := model.policy(m)).action == "redirect"
        and policy.target
        and _may_use(caller.visible, policy.target)
        and _serves(config, policy.target, caller.api)
    ]
    for candidate in candidates:
        target = config.model(candidate.target)
        if target is not None and all(m in target.takes_on(caller.api) for m in present):
            return candidate
    return candidates[0] if candidates else None


def _reject_unsupported(
    model: ModelConfig,
    classification: Classification,
    unsupported: list[Modality],
    stripped: frozenset[Modality],
    redirects: list[Redirect],
    on: tuple[str, tuple[Modality, ...]],  # the API, and the modalities the model itself accepts
) -> None:
    # reject, and a redirect or a conversion to a model outside the caller's key
    rejected = [m for m in unsupported if m not in stripped]
    # a stripped part takes what it carries with it (a video's audio track, say)
    offending = [
        p for p in classification.parts if p.modality not in stripped and any(m in rejected for m in p.modalities)
    ]
    if not offending:
        return
    part = offending[0]
    modality = next(m for m in part.modalities if m in rejected)
    via = ""
    if redirects:
        via = (
            " (redirected "
            + ", then ".join(
                f"from '{r.source}' for {r.modality} {'output' if r.output else 'input'}" for r in redirects
            )
            + ")"
        )
    carried = "" if part.modality is modality else f" ({part.type} with use_audio_in_video)"
    api, configured = on
    why = f" on the {api} API: {model.dialect.why(api, modality)}" if modality in configured else ""
    raise UnsupportedModalityError(
        f"Model '{model.name}'{via} does not accept {modality} input{why}: {part.location} is "
        f"'{part.type}'{carried}. It accepts: {model.accepts_text()}.",
        param=part.location,
        rejection=Rejection(model.name, modality.value, "unsupported"),
    )


def _enforce_limits(model: ModelConfig, classification: Classification, stripped: frozenset[Modality]) -> None:
    for modality, limit in model.limits.items():
        parts = [p for p in classification.parts_with(modality) if p.modality not in stripped]
        if len(parts) > limit:
            raise TooManyItemsError(
                f"Model '{model.name}' accepts at most {limit} {modality} item(s) per request; "
                f"this request has {len(parts)} (the first over the limit is {parts[limit].location}).",
                param=parts[limit].location,
                rejection=Rejection(model.name, modality.value, "too_many_items"),
            )


MAX_FRAMES = 64  # frames of all a request's videos (on_unsupported: {video: {frames: N}}), whatever the image limit

# A replacement that stands for several parts, {"type": EXPAND, "parts": [...]}, spliced in place
# once every replacement and strip is done (so that the indices of the others hold).
EXPAND = "__gateway_parts__"


def removed_note(modality: Modality, model: str, failed: str = "") -> str:
    """The text a part leaves where the gateway removed it (``strip``; ``failed``: the conversion
    that failed under ``on_error: strip``), so that the model, and through it the user, knows
    something was there and why it is not: without it a stripped image in a tool result reads as
    an empty file."""
    why = f"model '{model}' does not take {modality.value} input" + (f", and its {failed} failed" if failed else "")
    return f"[{_WHAT[modality]} was removed here by the gateway: {why}]"


_WHAT = {
    Modality.IMAGE: "An image",
    Modality.VIDEO: "A video",
    Modality.AUDIO: "An audio clip",
    Modality.FILE: "A file",
    Modality.TEXT: "Text",
}
