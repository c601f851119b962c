"""Checks that span sections of routing.yaml (names, redirects and their loops, encoders, limits),
and the checks of the host that will run it."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path

from ..modalities import Modality
from ..tracing import available as tracing_available
from .environment import env_secret
from .keys import AUDIO_BYTES_PER_S, BUILTIN_TOWERS, ENCODABLE, OUTPUT_MODALITIES, PRODUCING_APIS
from .loader import MarkedDocument
from .types import GatewayConfig, ModelConfig


def validate(config: GatewayConfig, p: MarkedDocument) -> None:
    """Checks that span sections: names, redirects, encoders, limits."""
    first: dict[str, int] = {}
    for i, model in enumerate(config.models):
        path = f"models[{i}]"
        if model.name in first:
            line = p.value_marks[f"models[{first[model.name]}].name"].line + 1
            p.problem(f"{path}.name", f"duplicate model name '{model.name}' (first defined at line {line})")
        else:
            first[model.name] = i
        for m in model.limits:
            if m not in model.accepts:
                p.problem(f"{path}.limits.{m}", f"a limit for '{m}', which the model does not accept", at_key=True)
        for m, encoder in model.encode.items():
            where = f"{path}.encode.{m}"
            if m not in ENCODABLE:
                p.problem(where, f"only {', '.join(ENCODABLE)} parts can be encoded, not '{m}'", at_key=True)
            elif m not in model.accepts:
                p.problem(where, f"encodes '{m}', which the model does not accept", at_key=True)
            if encoder not in config.encoders:
                known = ", ".join(config.encoders) or "none defined"
                p.problem(where, f"unknown encoder '{encoder}' (encoders: {known})")
        if model.on_encoder_error != "fail" and not model.encode:
            p.problem(f"{path}.on_encoder_error", "applies only to a model with 'encode'", at_key=True)
        _check_engine(model, path, p)
        for m, policy in model.on_unsupported.items():
            where = f"{path}.on_unsupported.{m}"
            if m in model.accepts and not _lacked(model, m):
                p.problem(where, f"'{m}' is accepted by this model, so this policy would never apply", at_key=True)
                continue
            if policy.action == "frames":
                if m != Modality.VIDEO:
                    p.problem(f"{where}.frames", f"only video can be sent as frames, not '{m}'")
                elif Modality.IMAGE not in model.accepts:
                    p.problem(f"{where}.frames", "frames are images: the model must accept image")
                continue
            if policy.action == "describe":
                describer = config.model(policy.target or "")
                if m != Modality.IMAGE:
                    p.problem(f"{where}.describe", f"only images can be described, not '{m}'")
                elif describer is None:
                    names = ", ".join(mm.name for mm in config.models)
                    p.problem(f"{where}.describe", f"describing model '{policy.target}' is not a model here ({names})")
                elif Modality.IMAGE not in describer.accepts or "chat" not in describer.apis:
                    p.problem(
                        f"{where}.describe",
                        f"describing model '{describer.name}' must accept image and serve chat (it accepts: "
                        f"{describer.accepts_text()}; apis: {', '.join(describer.apis)})",
                    )
                continue
            if policy.action == "extract" and m is not Modality.FILE:
                p.problem(f"{where}.extract", f"only files can be extracted, not '{m}'")
            elif policy.action == "extract" and policy.page_images and Modality.IMAGE not in model.accepts:
                p.problem(f"{where}.extract.page_images", "page images are images: the model must accept image")
            if policy.action == "transcribe":
                transcriber = config.model(policy.target or "")
                if m != Modality.AUDIO:
                    p.problem(f"{where}.transcribe", f"only audio can be transcribed, not '{m}'")
                elif transcriber is None:
                    names = ", ".join(mm.name for mm in config.models)
                    p.problem(
                        f"{where}.transcribe", f"transcription model '{policy.target}' is not a model here ({names})"
                    )
                elif Modality.AUDIO not in transcriber.accepts:
                    p.problem(
                        f"{where}.transcribe",
                        f"transcription model '{transcriber.name}' must accept audio (it accepts: "
                        f"{transcriber.accepts_text()})",
                    )
                continue
            if policy.action != "redirect":
                continue
            if policy.target == model.name:
                p.problem(f"{where}.redirect", f"model '{model.name}' redirects to itself")
            elif (target := _target(config, p, f"{where}.redirect", policy.target, (m, "accept"))) is not None and (
                missing := [a for a in model.apis if a not in NOT_REDIRECTED and a not in target.apis]
            ):
                # a request on an API the target does not serve could not be redirected there
                p.problem(
                    f"{where}.redirect",
                    f"redirect target '{target.name}' does not serve {', '.join(missing)} (its apis: "
                    f"{', '.join(target.apis)}), which '{model.name}' does: add them to its apis or remove them "
                    f"from this model's",
                )
        _check_outputs(config, model, path, p)
        if Modality.TEXT not in model.produces and (serving := [a for a in model.apis if a in TEXT_APIS]):
            p.problem(f"{path}.produces", f"must include 'text': the model serves {', '.join(serving)}")
        if "realtime" in model.apis and Modality.AUDIO not in model.accepts:
            p.problem(f"{path}.apis", "the realtime API takes audio: the model must accept it (accepts:)")
        bounds = model.realtime
        if bounds.max_append_bytes / AUDIO_BYTES_PER_S > bounds.audio_burst_s:
            p.problem(
                f"{path}.realtime.audio_burst_s",
                f"an append of max_append_bytes ({bounds.max_append_bytes}) is "
                f"{bounds.max_append_bytes / AUDIO_BYTES_PER_S:g}s of audio, over the burst: it could never be sent",
            )
        for api, made in PRODUCING_APIS.items():
            if api in model.apis and Modality(made) not in model.produces:
                p.problem(f"{path}.apis", f"the {api} API answers with {made}: the model must produce it (produces:)")
    if config.auth is not None:
        _check_keys(config, p)
    _check_encoder_ports(config, p)
    if not p.problems:
        _check_redirect_loops(config, p)


# the APIs whose requests an input redirect never moves: text alone, or one output of its own
NOT_REDIRECTED = frozenset({"completions", *PRODUCING_APIS})
TEXT_APIS = ("chat", "completions", "responses", "messages")  # what a model that serves one answers with
# the APIs a request asks for each output on (gateway.admission.outputs): a redirect for it must serve them
ASKED_ON = {Modality.AUDIO: ("chat",), Modality.IMAGE: ("responses",)}


def _target(
    config: GatewayConfig, p: MarkedDocument, where: str, name: str | None, offers: tuple[Modality, str]
) -> ModelConfig | None:
    """A redirect's target: a model of the table that does what ``offers`` says (a modality, and
    ``accept`` or ``produce``) with it; else None, its problem said at ``where``."""
    target = config.model(name or "")
    if target is None:
        names = ", ".join(mm.name for mm in config.models)
        p.problem(where, f"redirect target '{name}' is not a model here ({names})")
        return None
    m, verb = offers
    offered = target.accepts if verb == "accept" else target.produces
    if m not in offered:
        p.problem(where, f"redirect target '{target.name}' does not {verb} '{m}' (it {verb}s: {', '.join(offered)})")
        return None
    return target


def _check_outputs(config: GatewayConfig, model: ModelConfig, path: str, p: MarkedDocument) -> None:
    """``on_unsupported_output``: for outputs the model does not produce; a redirect to a model of
    the table that produces it and serves its APIs (a redirect of a redirect is not followed);
    ``output_limits`` of images and ``image_urls`` for a model that makes images, of speech for
    one that makes audio."""
    limits = model.output_limits
    if Modality.IMAGE not in model.produces:
        for key, set_ in (
            ("output_limits", limits is not None and limits.of_images),
            ("image_urls", model.image_urls != "inline"),
        ):
            if set_:
                p.problem(f"{path}.{key}", "is for a model that makes images (produces: [..., image])", at_key=True)
    if Modality.AUDIO not in model.produces and limits is not None and limits.speech_chars is not None:
        p.problem(
            f"{path}.output_limits.speech_input_chars",
            "is for a model that makes audio (produces: [..., audio])",
            at_key=True,
        )
    for m, policy in model.on_unsupported_output.items():
        where = f"{path}.on_unsupported_output.{m}"
        if m.value not in OUTPUT_MODALITIES or m is Modality.TEXT:
            p.problem(where, f"'{m}' is no output a request asks for (audio, image)", at_key=True)
            continue
        if m in model.produces:
            p.problem(where, f"the model produces '{m}', so this policy would never apply", at_key=True)
            continue
        if policy.action == "speak":
            if m is not Modality.AUDIO:
                p.problem(f"{where}.speak", f"speak is for audio: a speech model cannot make '{m}'")
            elif (target := _target(config, p, f"{where}.speak", policy.target, (m, "produce"))) is not None and (
                "speech" not in target.apis
            ):
                p.problem(f"{where}.speak", f"speaking model '{target.name}' does not serve the speech API (its apis: "
                          f"{', '.join(target.apis)})")  # fmt: skip
            continue
        if policy.action != "redirect":
            continue
        target = _target(config, p, f"{where}.redirect", policy.target, (m, "produce"))
        if target is not None and (missing := [a for a in model.apis if a in ASKED_ON[m] and a not in target.apis]):
            p.problem(
                f"{where}.redirect",
                f"redirect target '{target.name}' does not serve {', '.join(missing)} (its apis: "
                f"{', '.join(target.apis)}), which '{model.name}' does",
            )


def _check_encoder_ports(config: GatewayConfig, p: MarkedDocument) -> None:
    """A local encoder's fixed port is its own: not another's, nor the gateway's."""
    taken = {config.server.port: "server.port"}
    if (admin := config.server.admin_address) is not None:
        taken[admin[1]] = "server.admin_listen"
    for name, spec in config.encoders.items():
        if spec.kind != "local" or not spec.port:
            continue
        if (other := taken.get(spec.port)) is not None:
            p.problem(f"encoders.{name}.port", f"port {spec.port} is {other}'s already")
        else:
            taken[spec.port] = f"encoders.{name}.port"


# the APIs whose requests carry content parts (the others: text, or an upload of the model's own modality)
CONTENT_APIS = ("chat", "responses", "messages", "embeddings", "score", "rerank")


def _lacked(model: ModelConfig, modality: Modality) -> list[str]:
    """The content APIs the model serves where its engine has no part for ``modality``."""
    return [a for a in model.apis if a in CONTENT_APIS and modality in model.dialect.lacking(a)]


def _check_engine(model: ModelConfig, path: str, p: MarkedDocument) -> None:
    """What the model's table asks of its engine that the engine cannot take (its dialect,
    gateway/config/engines.py)."""
    dialect = model.dialect
    if model.encode and not dialect.embeds:
        p.problem(
            f"{path}.encode",
            f"encoded images reach the engine as image_embeds parts (or primed in vLLM's encoder cache), which "
            f"only vLLM takes; this model's engine is {dialect.name} (engine: vllm, or no encode)",
            at_key=True,
        )
    served = [a for a in model.apis if a in CONTENT_APIS]
    for m in model.accepts:
        if served and len(_lacked(model, m)) == len(served):
            hint = " (take files as their text: on_unsupported.file: {extract: ...})" if m is Modality.FILE else ""
            p.problem(
                f"{path}.accepts",
                f"'{m}' is taken on none of this model's APIs ({', '.join(served)}): {dialect.why(served[0], m)}{hint}",
            )


def _check_keys(config: GatewayConfig, p: MarkedDocument) -> None:
    assert config.auth is not None
    names: dict[str, int] = {}
    digests: dict[str, int] = {}
    for i, key in enumerate(config.auth.keys):
        path = f"auth.keys[{i}]"
        if key.name in names:
            p.problem(f"{path}.name", f"duplicate key name '{key.name}' (first at auth.keys[{names[key.name]}])")
        names.setdefault(key.name, i)
        if key.key_sha256 is not None:
            if key.key_sha256 in digests:
                p.problem(f"{path}.key_sha256", f"the same key as auth.keys[{digests[key.key_sha256]}]")
            digests.setdefault(key.key_sha256, i)
        for j, pattern in enumerate(key.models):
            if not any(fnmatch.fnmatchcase(m.name, pattern) for m in config.models):
                p.problem(f"{path}.models[{j}]", f"'{pattern}' names no model here")


def _check_redirect_loops(config: GatewayConfig, p: MarkedDocument) -> None:
    """A request carrying several modalities may follow redirects of different modalities, so any
    cycle in the redirect graph can loop."""
    index = {m.name: i for i, m in enumerate(config.models)}
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    reported: set[frozenset[str]] = set()

    def edges(model: ModelConfig) -> Iterator[tuple[Modality, str]]:
        for m, policy in model.on_unsupported.items():
            if policy.action == "redirect" and policy.target:
                yield m, policy.target

    def report(cycle: list[tuple[str, Modality]], target: str) -> None:
        key = frozenset(n for n, _ in cycle)
        if key in reported:
            return
        reported.add(key)
        route = " ".join(f"'{n}' -({mm})->" for n, mm in cycle) + f" '{target}'"
        first_name, first_modality = cycle[0]
        p.problem(f"models[{index[first_name]}].on_unsupported.{first_modality}.redirect", f"redirect loop: {route}")

    # An iterative depth-first search: a chain of thousands of redirects is valid and must not
    # exhaust Python's recursion limit. ``trail`` holds the (model, modality) edges taken so far.
    for root in config.models:
        if root.name in state:
            continue
        state[root.name] = 1
        trail: list[tuple[str, Modality]] = []
        stack: list[tuple[str, Iterator[tuple[Modality, str]]]] = [(root.name, edges(root))]
        while stack:
            name, pending = stack[-1]
            step = next(pending, None)
            if step is None:
                state[name] = 2
                stack.pop()
                if trail:
                    trail.pop()
                continue
            m, target = step
            if state.get(target) == 1:
                path = [*trail, (name, m)]
                start = next(k for k, (n, _) in enumerate(path) if n == target)
                report(path[start:], target)
            elif target not in state:
                state[target] = 1
                trail.append((name, m))
                stack.append((target, edges(config.models[index[target]])))


def missing_software(config: GatewayConfig) -> list[tuple[str, str]]:
    """What the config needs that this machine lacks (PyAV, for video sampling; OpenTelemetry,
    for traces), as (dotted path, message): refused by serve, reloads and ``check --here`` with
    the file's lines, and by the config store for a config built in code."""
    problems = []
    if config.server.tracing is not None and not tracing_available():
        problems.append(
            ("server.tracing", "needs the OpenTelemetry SDK, which is not installed here: "
             "pip install 'modality-gateway[tracing]'")
        )  # fmt: skip
    if find_spec("av") is not None:
        return problems
    missing = "need PyAV, which is not installed here: pip install 'modality-gateway[video]'"
    for i, model in enumerate(config.models):
        for m, policy in model.on_unsupported.items():
            if policy.action == "frames":
                problems.append((f"models[{i}].on_unsupported.{m}.frames", f"video frames {missing}"))
        if model.video_sample is not None:
            problems.append((f"models[{i}].video.sample", f"pre-sampled video frames {missing}"))
        if _counts_videos(model):  # a video's container read for its frames and size
            problems.append((f"models[{i}].visual_tokens.video", f"a video's tokens counted {missing}"))
    return problems


def _counts_videos(model: ModelConfig) -> bool:
    return model.visual_tokens is not None and model.visual_tokens.video is not None and Modality.VIDEO in model.accepts


def extras(config: GatewayConfig) -> tuple[str, ...]:
    """The pip extras of modality-gateway that running ``config`` takes (``make serve`` installs
    these and no more): ``encoder`` (torch) for a local encoder backend, ``video`` (PyAV) for
    video sampled into frames or a video's tokens counted, ``tracing`` (the OpenTelemetry SDK)
    for ``server.tracing``."""
    needed = []
    if any(spec.kind == "local" for spec in config.encoders.values()):
        needed.append("encoder")
    if any(
        model.video_sample is not None
        or _counts_videos(model)
        or any(p.action == "frames" for p in model.on_unsupported.values())
        for model in config.models
    ):
        needed.append("video")
    if config.server.tracing is not None:
        needed.append("tracing")
    return tuple(needed)


def validate_host(config: GatewayConfig, p: MarkedDocument) -> None:
    """What only the machine that runs the gateway can check: local encoders' model directories,
    and that every ``api_key_env`` is set.

    `modality-gateway check FILE` answers the same on any machine; `serve`, a reload and
    `check --here` also run this."""
    for path, message in missing_software(config):
        p.problem(path, message)
    for name, encoder in config.encoders.items():
        if encoder.kind == "local" and not encoder.model.startswith("builtin:") and not Path(encoder.model).is_dir():
            p.problem(
                f"encoders.{name}.model",
                f"'{encoder.model}' is not a directory on this machine (expected {', '.join(BUILTIN_TOWERS)} "
                "or a model directory)",
            )
    seen: dict[str, str] = {}
    for i, key in enumerate(config.auth.keys if config.auth is not None else ()):
        if key.key_env is None:
            continue
        value = env_secret(key.key_env)
        if not value:
            p.problem(f"auth.keys[{i}].key_env", f"the environment variable {key.key_env} is not set")
        elif not value.isprintable():
            p.problem(
                f"auth.keys[{i}].key_env",
                f"the value of {key.key_env} holds a line break or another control character; "
                "no client could send it in an Authorization header",
            )
        elif value in seen:
            p.problem(f"auth.keys[{i}].key_env", f"{key.key_env} holds the same key as key '{seen[value]}'")
        else:
            seen[value] = key.name
    for i, model in enumerate(config.models):
        if model.api_key_env is not None:
            upstream_key = env_secret(model.api_key_env)
            if not upstream_key:
                p.problem(f"models[{i}].api_key_env", f"the environment variable {model.api_key_env} is not set")
            elif not upstream_key.isprintable():
                p.problem(
                    f"models[{i}].api_key_env",
                    f"the value of {model.api_key_env} holds a line break or another control character; "
                    "it cannot go into an Authorization header",
                )
