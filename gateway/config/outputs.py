"""The keys of a model that say what it answers with: ``produces:`` (text, audio, image),
``on_unsupported_output:`` (reject, or a redirect), ``output_limits:`` (the images a request may
ask of it: how many, of what sizes) and ``image_urls:`` (whether the images it makes may come back
as URLs)."""

from __future__ import annotations

import re
from typing import Any

from ..modalities import Modality
from .keys import IMAGE_URLS, OUTPUT_ACTIONS, OUTPUT_LIMIT_KEYS, OUTPUT_MODALITIES
from .loader import MISSING
from .readers import Readers, describe, show, unknown_message
from .types import OutputLimits, Policy

MAX_SIDE = 1 << 16  # an image side beyond this is a typo
SIZE = re.compile(r"0*([1-9][0-9]{0,5})x0*([1-9][0-9]{0,5})")  # WIDTHxHEIGHT, as the images API spells it


def parse_size(value: str) -> tuple[int, int] | None:
    """``"1024x1536"`` as (width, height), as SGLang and vLLM-Omni read it (case and spaces aside); None if not one."""
    match = SIZE.fullmatch(value.lower().replace(" ", ""))
    return None if match is None else (int(match.group(1)), int(match.group(2)))


class OutputReaders(Readers):
    def outputs(self, raw: dict[str, Any], path: str) -> dict[str, Any]:
        """A model's output keys, as ModelConfig keyword arguments."""
        found: dict[str, Any] = {"produces": self.produces(raw.get("produces", MISSING), f"{path}.produces")}
        limits = self.output_limits(raw.get("output_limits", MISSING), f"{path}.output_limits")
        if limits is not None:
            found["output_limits"] = limits
        urls = raw.get("image_urls", MISSING)
        if urls is not MISSING:
            if urls in IMAGE_URLS:
                found["image_urls"] = urls
            else:
                self.problem(f"{path}.image_urls", unknown_message(urls, IMAGE_URLS, "value"))
        return found

    def produces(self, value: Any, path: str) -> tuple[Modality, ...]:
        """``produces:``, the modalities a model answers with: text, audio, image (default text)."""
        if value is MISSING:
            return (Modality.TEXT,)
        if not isinstance(value, list) or not value:
            self.problem(path, f"must be a non-empty list of {', '.join(OUTPUT_MODALITIES)}, not {describe(value)}")
            return (Modality.TEXT,)
        seen: list[Modality] = []
        for i, item in enumerate(value):
            if item not in OUTPUT_MODALITIES:
                self.problem(f"{path}[{i}]", unknown_message(item, OUTPUT_MODALITIES, "output modality"))
            elif Modality(item) in seen:
                self.problem(f"{path}[{i}]", f"modality '{item}' is listed twice")
            else:
                seen.append(Modality(item))
        return tuple(m for m in Modality if m in seen) or (Modality.TEXT,)

    def output_policy(self, value: Any, path: str) -> Policy | None:
        """What becomes of an output a model does not produce: ``reject``, ``{redirect: MODEL}``,
        or, for audio, ``{speak: MODEL}`` (the model's text answer spoken by a speech model)."""
        if value in OUTPUT_ACTIONS:
            return Policy("reject")
        if isinstance(value, dict) and len(value) == 1 and (action := next(iter(value))) in ("redirect", "speak"):
            target = self.string(value[action], f"{path}.{action}")
            return Policy(action, target) if target else None
        self.problem(path, f"unknown policy {show(value)} (expected reject, {{redirect: MODEL}} or {{speak: MODEL}})")
        return None

    def output_limits(self, value: Any, path: str) -> OutputLimits | None:
        """``output_limits: {image: N, image_sizes: [WxH, ...], image_pixels: N,
        speech_input_chars: N}``: the images a request may ask for (``n``), the sizes it may ask
        them in, the most pixels of one; the most characters the speech API speaks at once."""
        if value is MISSING:
            return None
        raw = self.mapping(value, path, OUTPUT_LIMIT_KEYS, what="output_limits")
        if raw is None:
            return None
        count = raw.get("image", MISSING)
        images = None if count is MISSING else self.integer(count, f"{path}.image", 1, minimum=1, maximum=1024)
        pixels = raw.get("image_pixels", MISSING)
        most = (
            None
            if pixels is MISSING
            else self.integer(pixels, f"{path}.image_pixels", 1, minimum=1, maximum=MAX_SIDE**2)
        )
        sizes: list[tuple[int, int]] = []
        listed = raw.get("image_sizes", MISSING)
        if listed is not MISSING:
            for item, where in self.string_list(listed, f"{path}.image_sizes"):
                size = parse_size(item)
                if size is None or max(size) > MAX_SIDE:
                    self.problem(where, f"must be WIDTHxHEIGHT (1024x1024), not {show(item)}")
                elif size in sizes:
                    self.problem(where, f"size '{item}' is listed twice")
                elif most is not None and size[0] * size[1] > most:
                    self.problem(where, f"{item} is over image_pixels ({most}): it could never be asked")
                else:
                    sizes.append(size)
            if isinstance(listed, list) and not listed:
                self.problem(f"{path}.image_sizes", "must list at least one size (leave it out for any)")
        chars = raw.get("speech_input_chars", MISSING)
        speech = None
        if chars is not MISSING:
            speech = self.integer(chars, f"{path}.speech_input_chars", 1, minimum=1, maximum=1 << 24)
        return OutputLimits(images, tuple(sizes), most, speech)
