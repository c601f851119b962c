"""What a batch of spans costs to write as OTLP: the gateway's own encoding (gateway/otlp.py) against
the SDK exporter's (opentelemetry-exporter-otlp-proto-common's ``encode_spans``, then serialized).

The spans are a traced text request's, as the gateway makes them: a request's span (SERVER) with
its admission and usage attributes, and its attempt's (CLIENT). Both encodings run on the same
batch, alternating, in this process; µs a span, median of the rounds (the machine is shared:
compare the two columns of one run, never runs).

    .venv/bin/python -m bench.otlp                     # 512 spans a batch (the SDK's batch size), 7 rounds
    .venv/bin/python -m bench.otlp --spans 64 --rounds 11
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any


def request_spans(n: int) -> Sequence[Any]:
    """``n`` spans, two a traced request, with the attributes the gateway gives them."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind, set_span_in_context

    kept = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "modality-gateway"}))
    provider.add_span_processor(SimpleSpanProcessor(kept))
    tracer = provider.get_tracer("modality-gateway", "0.1.0")
    for i in range(n // 2):
        root = tracer.start_span(
            "chat m",
            kind=SpanKind.SERVER,
            attributes={"http.request.method": "POST", "url.path": "/v1/chat/completions",
                        "gen_ai.operation.name": "chat", "gateway.request_id": f"{i:032x}"},
        )  # fmt: skip
        root.set_attributes({"gateway.media.text.count": 1, "gen_ai.response.model": "m", "gateway.route": "direct",
                             "gateway.priority": "default", "gen_ai.usage.input_tokens": 12,
                             "gen_ai.usage.output_tokens": 16})  # fmt: skip
        attempt = tracer.start_span(
            "gateway.upstream",
            context=set_span_in_context(root),
            kind=SpanKind.CLIENT,
            attributes={"server.address": "127.0.0.1", "server.port": 8000, "url.path": "/v1/chat/completions",
                        "gateway.attempt": 0, "http.request.method": "POST"},
        )  # fmt: skip
        attempt.set_attributes({"http.response.status_code": 200, "gateway.outcome": "ok"})
        attempt.end()
        root.set_attributes({"http.response.status_code": 200, "gen_ai.request.model": "m"})
        root.end()
    return kept.get_finished_spans()


def _per_span(encode: Callable[[Sequence[Any]], bytes], spans: Sequence[Any], repeat: int) -> float:
    started = time.perf_counter()
    for _ in range(repeat):
        encode(spans)
    return (time.perf_counter() - started) / repeat / len(spans) * 1e6


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spans", type=int, default=512, help="spans a batch (default 512, the SDK's batch size)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=20, help="batches encoded a round, each way")
    args = parser.parse_args(argv)
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    from gateway.otlp import encode

    spans = request_spans(args.spans)
    ways: dict[str, Callable[[Sequence[Any]], bytes]] = {
        "gateway.otlp.encode": encode,
        "the SDK's encode_spans + SerializePartialToString": lambda s: encode_spans(s).SerializePartialToString(),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, way in ways.items():
            times[name].append(_per_span(way, spans, args.repeat))
    print(f"{len(spans)} spans a batch, {args.rounds} rounds of {args.repeat} batches, µs a span (median):")
    for name, measured in times.items():
        print(f"  {statistics.median(measured):6.2f}  {name}")
    ours, theirs = (statistics.median(times[name]) for name in ways)
    print(f"  ratio: {theirs / ours:.2f}x")


if __name__ == "__main__":
    main()
