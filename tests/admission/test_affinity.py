"""The affinity key: the turns of one conversation share it; other conversations do not."""

from __future__ import annotations

from gateway.admission.affinity import URL_SAMPLE, chat_key, prompt_key


def image(url: str) -> dict[str, object]:
    return {"type": "image_url", "image_url": {"url": url}}


CAT = "data:image/png;base64," + "Q" * 50_000
DOG = "data:image/png;base64," + "R" * 50_000


def turn(n: int, first_image: str = CAT, system: str = "be brief") -> dict[str, object]:
    messages: list[dict[str, object]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": [{"type": "text", "text": "what is this?"}, image(first_image)]},
    ]
    for i in range(n):
        messages += [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": f"and {i}?"}]
    return {"model": "m", "messages": messages}


def test_every_turn_of_a_conversation_has_the_same_key() -> None:
    assert chat_key(turn(0)) == chat_key(turn(1)) == chat_key(turn(5)) is not None


def test_another_first_image_or_system_prompt_is_another_key() -> None:
    assert chat_key(turn(1, first_image=DOG)) != chat_key(turn(1))
    assert chat_key(turn(1, system="be thorough")) != chat_key(turn(1))
    # an image that differs only between the sampled ends is the same key: a miss at worst
    middle = CAT[: len(CAT) // 2] + "S" + CAT[len(CAT) // 2 + 1 :]
    assert len(CAT) > 2 * URL_SAMPLE and chat_key(turn(1, first_image=middle)) == chat_key(turn(1))


def test_bodies_with_nothing_to_key_on_have_no_key() -> None:
    assert chat_key({"messages": [{"role": "system", "content": "x"}]}) is None
    assert chat_key({"messages": "hi"}) is None
    assert chat_key({"messages": [["not a message"]]}) is None


def test_completions_are_keyed_by_their_prompt_opening() -> None:
    preamble = "You are a helpful assistant. " * 200
    assert prompt_key({"prompt": preamble + "one"}) == prompt_key({"prompt": [preamble + "two"]})
    assert prompt_key({"prompt": "short"}) != prompt_key({"prompt": "other"})
    assert prompt_key({"prompt": [1, 2, 3]}) is None and prompt_key({}) is None
