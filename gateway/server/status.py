"""The status page: ``GET /`` (a page, no build step, no external asset) and ``GET /status`` (what
it shows, JSON), refreshed in place every few seconds.

What it shows is what the table says and what the gateway has done since it started: each model
against each modality, in and out, and in each cell what becomes of such a part (accepted within
its limits, encoded, sampled as frames, rejected, redirected, transcribed, described, extracted,
stripped, downscaled); each model's engine, APIs and replicas with their health; and per model the
requests answered, refused and failed, and those converted, counted as ``/metrics`` counts them
(every worker's under ``serve --workers N``).

Who sees it follows ``/metrics`` and ``/readyz``: without ``auth:`` the page and its JSON are open,
as ``/metrics`` is, but a replica's address and its last error (for operators, never for clients:
the port is public) only with the admin token, as ``/readyz`` says them; with ``auth:`` on, the JSON
needs the admin token as ``/metrics`` does, and the page asks for it (kept in the browser's session
storage, sent as ``Authorization: Bearer``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from importlib.resources import files
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from ..config import GatewayConfig, ModelConfig, Policy
from ..modalities import MODALITIES, Modality
from .handlers import Handler, check_operator, is_admin, json_response, readiness
from .state import SERVICES_KEY

PAGE = files("gateway.server").joinpath("status.html").read_bytes()  # read once: the page is static
OUTPUTS = (Modality.TEXT, Modality.AUDIO, Modality.IMAGE)  # what a model may produce (produces:)

# the counters a model's row sums, by family (without _total) and how: what the page calls each
COUNTED = {
    "gateway_requests": "requests",
    "gateway_modality_rejections": "rejected_for_content",
    "gateway_modality_redirects": "redirected",
    "gateway_modality_stripped_parts": "converted",
    "gateway_images_described": "converted",
    "gateway_files_extracted": "converted",
    "gateway_images_downscaled": "converted",
}


ROW = ("answered", "refused", "failed", "rejected_for_content", "redirected", "converted")
CLIENT_LEFT = 499  # gateway_requests_total's code for a client that left before its answer


def cell(model: ModelConfig, modality: Modality, encoders: Mapping[str, str]) -> dict[str, Any]:
    """What becomes of a ``modality`` part sent to ``model``: ``verdict`` (accepted, converted,
    rejected: the cell's colour), ``text`` (what happens, in words), ``notes`` (its limits, and
    the APIs where the engine has no such part and what happens there instead)."""
    notes: list[str] = []
    if modality in model.accepts:
        verdict, text = "accepted", "accepted"
        if (most := model.limits.get(modality)) is not None:
            notes.append(f"at most {most} a request")
        if modality is Modality.IMAGE:
            if (encoder := model.encode.get(modality)) is not None:
                text = f"encoded by {encoder}" + (f" ({encoders[encoder]})" if encoder in encoders else "")
            if model.max_image_pixels is not None:
                notes.append(f"at most {model.max_image_pixels / 1e6:.1f} MP each")
            if model.max_visual_tokens is not None:
                notes.append(f"at most {model.max_visual_tokens:,} visual tokens a request")
            if model.on_oversize.action == "downscale" and model.counts_images:
                notes.append("downscaled past its limits")
        if modality is Modality.VIDEO and model.video_sample is not None:
            verdict, text = "converted", f"as {model.video_sample.frames} frames"
        for api in model.apis:
            if modality not in model.takes_on(api):
                notes.append(f"on {api} (no such part there): {said(model.policy(modality))}")
        return {"verdict": verdict, "text": text, "notes": notes}
    policy = model.policy(modality)
    if policy.action == "reject" and policy.history == "strip":
        notes.append("in earlier turns and tool results: stripped")
    verdict = "rejected" if policy.action == "reject" else "converted"
    return {"verdict": verdict, "text": said(policy), "target": policy.target, "notes": notes}


def said(policy: Policy) -> str:
    """What a policy does to a part, in the page's words."""
    match policy.action:
        case "reject":
            return "rejected (400)"
        case "strip":
            return "stripped"
        case "redirect":
            return f"redirected to {policy.target}"
        case "transcribe":
            return f"transcribed by {policy.target}"
        case "describe":
            return f"described by {policy.target}"
        case "frames":
            return f"as {policy.frames} frames"
        case _:  # extract
            return f"text and page images ({policy.dpi} dpi)" if policy.page_images else "text extracted"


def output_cell(model: ModelConfig, modality: Modality) -> dict[str, Any]:
    """What becomes of a request that asks ``model`` for ``modality`` out."""
    if modality in model.produces:
        return {"verdict": "accepted", "text": "produced", "notes": []}
    policy = model.output_policy(modality)
    asked, api = ASKED_BY[modality]
    if policy.action == "redirect":  # where a request asks for it beside text, and on the API of that output
        return {
            "verdict": "converted",
            "text": f"redirected to {policy.target}",
            "target": policy.target,
            "notes": [f"asked by {asked}, or on the {api} API"],
        }
    if policy.action == "speak":  # chat's audio only: the speech API is the speaker's own
        return {
            "verdict": "converted",
            "text": f"spoken by {policy.target}",
            "target": policy.target,
            "notes": [f"asked by {asked}, not streamed; on the {api} API: rejected (400)"],
        }
    return {"verdict": "rejected", "text": "rejected (400)", "notes": []}


# what asks a model for an output beside text (gateway.admission.outputs), and the API of that output alone
ASKED_BY = {
    Modality.AUDIO: ("chat's modalities or audio", "speech"),
    Modality.IMAGE: ("a Responses image_generation tool", "images"),
}


def capabilities(config: GatewayConfig) -> list[dict[str, Any]]:
    """Each model's row: its cells in and out, its engine and APIs."""
    encoders = {name: spec.kind for name, spec in config.encoders.items()}
    return [
        {
            "name": model.name,
            "engine": model.engine,
            "upstream_model": model.upstream_name,
            "apis": list(model.apis),
            "in": {str(m): cell(model, m, encoders) for m in MODALITIES},
            "out": {str(m): output_cell(model, m) for m in OUTPUTS},
        }
        for model in config.models
    ]


def counts(registry: CollectorRegistry, models: Iterable[str]) -> dict[str, dict[str, float]]:
    """Per model: requests answered (below 400), refused (4xx), failed (5xx), not those whose client
    left first (499); of them refused for their content, redirected to another model, and the
    parts converted (stripped, described, extracted, downscaled), as gateway_*_total count them."""
    totals = {name: dict.fromkeys(ROW, 0.0) for name in models}
    for family in registry.collect():
        what = COUNTED.get(family.name)
        if what is None:
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue  # a counter's _created
            row = totals.get(sample.labels.get("model", ""))
            if row is None:
                continue  # a model no longer in the table, or _unknown
            if what == "requests":
                code = int(sample.labels.get("code", "0") or 0)
                if code != CLIENT_LEFT:  # the client left first: neither refused nor failed
                    row["answered" if code < 400 else "refused" if code < 500 else "failed"] += sample.value
            else:
                row[what] += sample.value
    return totals


def replicas(config: GatewayConfig, snapshot: list[dict[str, object]], admin: bool) -> dict[str, list[dict[str, Any]]]:
    """Each model's replicas, in its table's order: healthy or not, in flight, its breaker; the
    address and last error with the admin token only."""
    by_url = {str(r["url"]): r for r in snapshot}
    out: dict[str, list[dict[str, Any]]] = {}
    for model in config.models:
        rows = []
        for index, url in enumerate(model.upstreams, 1):
            state = by_url.get(url, {})
            row: dict[str, Any] = {
                "replica": index,
                "healthy": bool(state.get("healthy", True)),
                "breaker": state.get("breaker", "closed"),
                "in_flight": state.get("in_flight", 0),
            }
            if admin:
                row["url"], row["last_error"] = url, state.get("last_error") or ""
            rows.append(row)
        out[model.name] = rows
    return out


def endpoint(scrape: CollectorRegistry) -> Handler:
    """``GET /status``: the page's JSON, counted from ``scrape`` (what ``/metrics`` answers from)."""

    async def status(request: web.Request) -> web.Response:
        services = request.app[SERVICES_KEY]
        check_operator(request, services, "the status needs", "send it")  # as /metrics
        live = services.store.live
        config = live.config
        admin = is_admin(request, services)
        encoders: dict[str, Any] = {name: {"kind": spec.kind} for name, spec in config.encoders.items()}
        for name, local in services.supervisor.encoders.items():
            state = local.status()
            encoders.setdefault(name, {})["ready"] = bool(state.get("ready"))
            if admin:
                encoders[name]["last_error"] = state.get("last_error", "")
        names = [m.name for m in config.models]
        return json_response(
            {
                "status": readiness(services),
                "config_generation": live.number,
                "loaded_at": services.store.loaded_at,
                "modalities": [str(m) for m in MODALITIES],
                "outputs": [str(m) for m in OUTPUTS],
                "models": capabilities(config),
                "replicas": replicas(config, services.store.replicas.snapshot(), admin),
                "encoders": encoders,
                "counts": counts(scrape, names),
                "admin": admin,
            }
        )

    return status


async def page(request: web.Request) -> web.Response:
    """``GET /``: the page; its data comes from ``/status``."""
    return web.Response(
        body=PAGE,
        content_type="text/html",
        charset="utf-8",
        headers={
            "Cache-Control": "no-cache",
            # nothing from elsewhere: its script and style are its own, it fetches /status alone
            "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
            "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
            "X-Content-Type-Options": "nosniff",
        },
    )
