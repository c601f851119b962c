"""What renaming the model costs: writing the body again with orjson, against splicing the name
into the client's bytes (issue 11 asked for the splice; this is why the gateway does not).

A splice must find the key (a scan of the body: media is one long string to skip) and copy the
body around the new name; orjson writes a parsed body again at memory speed. The splice measured
here is its lower bound: one ``find`` over the whole body and one copy, none of the checks a
correct splice needs (the key at the top level, given once, unescaped).

    .venv/bin/python -m bench.rename
"""

from __future__ import annotations

import statistics
import timeit
from typing import Any

import orjson

from gateway.admission.body import dump_body, exact


def body_of(image_bytes: int) -> bytes:
    image = "data:image/png;base64," + "iVBORw0KGg" * (image_bytes // 10)
    content = [{"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": image}}]
    return orjson.dumps({"model": "alias", "messages": [{"role": "user", "content": content}], "max_tokens": 16})


def main() -> None:
    print("| body | write again (exact + orjson) | splice, lower bound (find + one copy) |")
    print("|---|---:|---:|")
    for size in (2_000, 100_000, 2_000_000):
        raw = body_of(size)
        parsed = orjson.loads(raw)

        def rewrite(raw: bytes = raw, parsed: dict[str, Any] = parsed) -> bytes:
            body = exact(raw, parsed)
            body["model"] = "org/real-model"
            return dump_body(body)

        def splice(raw: bytes = raw) -> bytes:
            view = memoryview(raw)
            at = raw.find(b'"model"')
            quote = 0
            while quote != -1:  # from quote to quote to the end: a second "model" would change the answer
                quote = raw.find(b'"', quote + 1)
            return b"".join((view[:at], b'"model":"org/real-model"', view[at + 15 :]))

        n = max(50, 20_000_000 // len(raw))
        again = statistics.median(timeit.repeat(rewrite, number=n, repeat=5)) / n * 1e6
        spliced = statistics.median(timeit.repeat(splice, number=n, repeat=5)) / n * 1e6
        print(f"| {len(raw) / 1e3:,.0f} KB | {again:.1f} us | {spliced:.1f} us |")


if __name__ == "__main__":
    main()
