"""What a request spends of its API key's token budgets, and counts in ``gateway_tokens_total``:
its reply's usage (or, where the reply says none, what was known before it: its visual tokens),
and what its conversions cost the models of the table that made them (an image's description).
Spent at the request's end (gateway.server.middlewares, the request's ``Tab``), whatever becomes of it."""

from __future__ import annotations

from ..admission.route import RoutePlan
from ..config import ApiKey
from ..metrics import NO_KEY
from ..upstream.usage import Usage
from .state import Services, Tab


def floor(plan: RoutePlan | None) -> int:
    """The tokens a request is known to cost before any reply: its visual tokens (a reply that
    says nothing of its usage spends these of the key's budgets)."""
    if plan is None or plan.visual is None or not plan.api.spends:
        return 0
    return plan.visual.tokens


def reply(services: Services, key: ApiKey | None, tab: Tab | None, model: str, known: int, usage: Usage | None) -> None:
    """A successful reply's usage: counted, and left to be spent of the key's token budgets at
    the request's end (with what its conversions spent already); without one, the tokens known
    before it (``known``). (Functions, not a class: bound with functools.partial for each
    request, which costs no call.)"""
    tokens = known
    if usage is not None:
        _count(services, key, model, usage)
        tokens = usage.total
        if services.tracing is not None and services.tracing.recording():  # GenAI usage, on the request's span
            services.tracing.current().set_attributes(
                {"gen_ai.usage.input_tokens": usage.prompt, "gen_ai.usage.output_tokens": usage.completion,
                 "gen_ai.usage.cache_read.input_tokens": usage.cached}
            )  # fmt: skip
    if tab is not None:  # (a keyed request's)
        tab.spent += tokens


def conversion(services: Services, key: ApiKey | None, tab: Tab | None, model: str, usage: Usage) -> None:
    """What a conversion cost a model of the table (an image's description): counted as that
    model's tokens for the request's key, and spent of the key's budgets at the request's end
    whatever becomes of the request."""
    _count(services, key, model, usage)
    if tab is not None:
        tab.spent += usage.total


def _count(services: Services, key: ApiKey | None, model: str, usage: Usage) -> None:
    """``usage`` of ``model`` for the request's key, in gateway_tokens_total."""
    metrics, label = services.metrics, key.name if key is not None else NO_KEY
    metrics.child(metrics.tokens, model, label, "prompt").inc(usage.prompt)
    if usage.completion:  # pooling APIs complete nothing
        metrics.child(metrics.tokens, model, label, "completion").inc(usage.completion)
    if usage.cached:
        metrics.child(metrics.tokens, model, label, "cached").inc(usage.cached)
