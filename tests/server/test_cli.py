from __future__ import annotations

import base64
import hashlib
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway.server.cli import main

ROOT = Path(__file__).resolve().parents[2]
ROUTING = str(ROOT / "routing.yaml")
BAD = "version: 2\nmodels:\n  - {name: a, upstreams: ['ftp://h'], accepts: [text, vidoe]}\n"
BAD_PROBLEMS = [
    "{path}:1:10: version: unsupported version 2 (the only version is 1)",
    "{path}:3:27: models[0].upstreams[0]: bad URL 'ftp://h': must be an http:// or https:// URL",
    "{path}:3:55: models[0].accepts[1]: unknown modality 'vidoe' "
    "(expected one of: text, image, video, audio, file); did you mean 'video'?",
]


def problem_lines(path: Path) -> list[str]:
    return [line.format(path=path) for line in BAD_PROBLEMS]


def chat(model: str, *parts: dict[str, Any]) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, *parts]}]}


VIDEO = {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}
IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}


@pytest.fixture
def bad_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD)
    return path


def write_request(tmp_path: Path, body: Any) -> str:
    path = tmp_path / "request.json"
    path.write_text(json.dumps(body))
    return str(path)


# --- check ------------------------------------------------------------------------------------


def test_check_valid_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", ROUTING]) == 0
    out, err = capsys.readouterr()
    assert (out, err) == (f"{ROUTING}: ok\n", "")


@pytest.mark.parametrize(
    ("files", "needed"),
    [
        # the shipped table runs a local encoder and samples videos into frames
        ([ROUTING], "encoder video"),
        # the example of the quick start needs the gateway alone
        ([str(ROOT / "docs" / "examples" / "text-and-images.yaml")], ""),
        # several files: what any of them needs, once
        ([ROUTING, str(ROOT / "docs" / "examples" / "text-and-images.yaml")], "encoder video"),
    ],
)
def test_check_extras_says_what_make_serve_installs(
    capsys: pytest.CaptureFixture[str], files: list[str], needed: str
) -> None:
    assert main(["check", "--extras", *files]) == 0
    assert capsys.readouterr() == (f"{needed}\n", "")


@pytest.mark.parametrize(
    ("table", "needed"),
    [
        (  # traces: the OpenTelemetry SDK
            "server: {tracing: {otlp_endpoint: 'http://127.0.0.1:4318'}}\n"
            "models:\n  - {name: m, upstreams: ['http://127.0.0.1:8000'], accepts: [text]}\n",
            "tracing",
        ),
        (  # a video's tokens counted: PyAV reads its container
            "models:\n  - {name: m, upstreams: ['http://127.0.0.1:8000'], accepts: [text, video],\n"
            "     visual_tokens: {preset: qwen2.5-vl, video: {frames: 8}}}\n",
            "video",
        ),
    ],
)
def test_check_extras_names_what_a_table_asks_for(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, table: str, needed: str
) -> None:
    path = tmp_path / "routing.yaml"
    path.write_text("version: 1\n" + table)
    assert main(["check", "--extras", str(path)]) == 0
    assert capsys.readouterr().out == f"{needed}\n"


def test_check_extras_of_an_invalid_table_says_its_problems(capsys: pytest.CaptureFixture[str], bad_yaml: Path) -> None:
    assert main(["check", "--extras", str(bad_yaml)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "bad.yaml:" in err


def test_version_and_help_with_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.startswith("modality-gateway 0.")
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "examples:" in out and "modality-gateway check routing.yaml" in out and "docs/routing.md" in out


def test_check_invalid_file_lists_every_problem(capsys: pytest.CaptureFixture[str], bad_yaml: Path) -> None:
    assert main(["check", str(bad_yaml)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == problem_lines(bad_yaml)


def test_check_several_files(capsys: pytest.CaptureFixture[str], tmp_path: Path, bad_yaml: Path) -> None:
    missing = tmp_path / "missing.yaml"
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert main(["check", str(bad_yaml), ROUTING, str(missing), str(empty)]) == 2
    out, err = capsys.readouterr()
    assert out == f"{ROUTING}: ok\n"
    assert err.splitlines() == [
        *problem_lines(bad_yaml),
        f"{missing}: cannot read file: [Errno 2] No such file or directory: '{missing}'",
        f"{empty}: the file is empty (expected a mapping with 'version' and 'models')",
    ]


def test_check_here_also_looks_for_model_directories(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = tmp_path / "routing.yaml"
    config.write_text(
        "version: 1\nencoders:\n  v: {kind: local, model: /no/such/dir}\n"
        "models: [{name: a, upstreams: ['http://h:1'], accepts: [text]}]\n"
    )
    assert main(["check", str(config)]) == 0  # the same answer on any machine
    assert main(["check", "--here", str(config)]) == 2  # this machine has no such directory
    _, err = capsys.readouterr()
    assert (
        err == f"{config}:3:27: encoders.v.model: '/no/such/dir' is not a directory on this machine (expected "
        "builtin:vit-small or a model directory)\n"
    )


def test_check_several_valid_files(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    other = tmp_path / "other.yaml"
    other.write_text("version: 1\nmodels: [{name: a, upstreams: ['http://h:1'], accepts: [text]}]\n")
    assert main(["check", ROUTING, str(other)]) == 0
    assert capsys.readouterr().out == f"{ROUTING}: ok\n{other}: ok\n"


def test_check_without_files_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["check"])
    assert info.value.code == 2
    assert "the following arguments are required: FILE" in capsys.readouterr().err


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith("usage: modality-gateway")


def test_check_in_a_subprocess(bad_yaml: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "check", ROUTING, str(bad_yaml)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert result.stdout == f"{ROUTING}: ok\n"
    assert result.stderr.splitlines() == problem_lines(bad_yaml)


# --- explain ----------------------------------------------------------------------------------


def explain(capsys: pytest.CaptureFixture[str], request: str, config: str = ROUTING) -> tuple[int, Any, str]:
    status = main(["explain", "--config", config, request])
    out, err = capsys.readouterr()
    return status, json.loads(out) if out else None, err


def test_explain_direct(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    status, decision, err = explain(capsys, write_request(tmp_path, chat("kimi-k3", IMAGE)))
    assert (status, err) == (0, "")
    assert decision == {
        "api": "chat",
        "outputs": ["text"],
        "decision": "accept",
        "requested_model": "kimi-k3",
        "model": "kimi-k3",
        "upstream_model": "moonshotai/Kimi-K3",
        "upstreams": ["http://127.0.0.1:30000"],
        "route": "direct",
        "encoder": None,
        "encode_decision": None,
        "redirects": [],
        "counts": {"text": 1, "image": 1},
        "parts": [
            {"location": "messages[0].content[0]", "type": "text", "modalities": ["text"], "action": "accept"},
            {"location": "messages[0].content[1]", "type": "image_url", "modalities": ["image"], "action": "accept"},
        ],
    }


def test_explain_redirect(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    status, decision, _ = explain(capsys, write_request(tmp_path, chat("kimi-k3", VIDEO)))
    assert status == 0
    assert decision["decision"] == "accept"
    assert (decision["requested_model"], decision["model"], decision["route"]) == ("kimi-k3", "qwen-omni", "redirect")
    assert decision["upstream_model"] == "Qwen/Qwen2.5-Omni-7B"
    assert decision["redirects"] == [{"from": "kimi-k3", "modality": "video", "to": "qwen-omni", "for": "input"}]
    assert [p["action"] for p in decision["parts"]] == ["accept", "accept"]


def test_explain_strip(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    status, decision, _ = explain(capsys, write_request(tmp_path, chat("kimi-k3-text", IMAGE)))
    assert status == 0
    assert (decision["model"], decision["route"], decision["redirects"]) == ("kimi-k3-text", "strip", [])
    assert [(p["location"], p["action"]) for p in decision["parts"]] == [
        ("messages[0].content[0]", "accept"),
        ("messages[0].content[1]", "strip"),
    ]


def test_explain_reject(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    status, decision, err = explain(capsys, write_request(tmp_path, chat("kimi-k3", AUDIO)))
    assert (status, err) == (1, "")
    assert decision == {
        "decision": "reject",
        "status": 400,
        "error": {
            "message": "Model 'kimi-k3' does not accept audio input: messages[0].content[1] is 'input_audio'. "
            "It accepts: text, image.",
            "type": "invalid_request_error",
            "param": "messages[0].content[1]",
            "code": "unsupported_modality",
        },
    }


def test_explain_reject_over_a_limit(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    status, decision, _ = explain(capsys, write_request(tmp_path, chat("qwen-omni", VIDEO, VIDEO, VIDEO)))
    assert status == 1
    assert decision["status"] == 400
    assert decision["error"]["code"] == "too_many_items"
    assert decision["error"]["param"] == "messages[0].content[3]"


def test_explain_unknown_model(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    status, decision, _ = explain(capsys, write_request(tmp_path, chat("gpt-9")))
    assert status == 1
    assert decision == {
        "decision": "reject",
        "status": 404,
        "error": {
            "message": (
                "The model 'gpt-9' does not exist (models: kimi-k3, qwen-omni, qwen-vl-epd, whisper, kimi-k3-text)"
            ),
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        },
    }


def test_explain_request_from_stdin(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    stdin = io.TextIOWrapper(io.BytesIO(json.dumps(chat("kimi-k3", VIDEO)).encode()))
    monkeypatch.setattr(sys, "stdin", stdin)
    status, decision, _ = explain(capsys, "-")
    assert status == 0
    assert decision["model"] == "qwen-omni"


def test_explain_missing_request_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    status, decision, err = explain(capsys, str(missing))
    assert (status, decision) == (2, None)
    assert err == f"{missing}: cannot read the request: [Errno 2] No such file or directory: '{missing}'\n"


@pytest.mark.parametrize(
    "raw",
    [pytest.param(b"{", id="truncated"), pytest.param(b"", id="empty"), pytest.param(b"\xff", id="not-utf8")],
)
def test_explain_invalid_json(capsys: pytest.CaptureFixture[str], tmp_path: Path, raw: bytes) -> None:
    path = tmp_path / "request.json"
    path.write_bytes(raw)
    status, decision, err = explain(capsys, str(path))
    assert (status, decision) == (2, None)
    assert err.startswith(f"{path}: cannot read the request: ")
    assert len(err.splitlines()) == 1


def test_explain_request_that_is_not_an_object(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = write_request(tmp_path, [chat("kimi-k3")])
    status, decision, err = explain(capsys, path)
    assert (status, decision) == (2, None)
    assert err == f"{path}: the request must be a JSON object\n"


def test_explain_invalid_stdin(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"not json")))
    status, decision, err = explain(capsys, "-")
    assert (status, decision) == (2, None)
    assert err.startswith("-: cannot read the request: ")


def test_explain_with_an_invalid_config(capsys: pytest.CaptureFixture[str], tmp_path: Path, bad_yaml: Path) -> None:
    status, decision, err = explain(capsys, write_request(tmp_path, chat("a")), config=str(bad_yaml))
    assert (status, decision) == (2, None)
    assert err.splitlines() == problem_lines(bad_yaml)


def test_explain_with_a_missing_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = tmp_path / "routing.yaml"
    status, decision, err = explain(capsys, write_request(tmp_path, chat("a")), config=str(config))
    assert (status, decision) == (2, None)
    assert err == f"{config}: cannot read file: [Errno 2] No such file or directory: '{config}'\n"


def test_explain_shows_the_encoder_kind_and_the_priming_plan(capsys: pytest.CaptureFixture[str], tmp_path: Path):
    config = tmp_path / "routing.yaml"
    config.write_text(
        "version: 1\nencoders:\n"
        "  v: {kind: vllm, urls: ['http://enc-0:8000', 'http://enc-1:8000'], max_batch_size: 4}\n"
        "models:\n  - {name: m, upstreams: ['http://pd:8000'], accepts: [text, image], encode: {image: v}}\n"
    )
    png = b"\x89PNG\r\n\x1a\n-not-decoded-by-explain"
    inline = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}
    status, decision, err = explain(capsys, write_request(tmp_path, chat("m", inline, IMAGE)), str(config))
    assert (status, err) == (0, "")
    assert decision["encode_decision"] == "encoded"
    encoding = decision["encoding"]
    assert (encoding["encoder"], encoding["kind"]) == ("v", "vllm")
    priming = encoding["priming"]
    assert priming["instances"] == ["http://enc-0:8000", "http://enc-1:8000"] and priming["max_batch_size"] == 4
    first, second = priming["images"]
    assert first["uuid"] == hashlib.sha256(png).hexdigest() and first["instance"] in priming["instances"]
    assert second == {"location": "messages[0].content[2]", "uuid": None, "instance": None}  # fetched when served


def test_explain_says_a_videos_frames_are_encoded(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = tmp_path / "routing.yaml"
    config.write_text(
        "version: 1\nencoders:\n  v: {kind: vllm, urls: ['http://enc-0:8000']}\n"
        "models:\n  - {name: m, upstreams: ['http://pd:8000'], accepts: [text, image], encode: {image: v},\n"
        "     on_unsupported: {video: {frames: 6}}}\n"
    )
    clip = {"type": "video_url", "video_url": {"url": "https://example.com/a.mp4"}}
    status, decision, err = explain(capsys, write_request(tmp_path, chat("m", clip, clip)), str(config))
    assert (status, err) == (0, "")
    assert [p["action"] for p in decision["parts"]] == ["accept", "frames, encoded", "frames, encoded"]
    assert decision["encode_decision"] == "encoded" and decision["route"] == "transcode"
    assert decision["encoding"]["frames"] == 12 and decision["encoding"]["priming"]["images"] == []


def explain_on(capsys: pytest.CaptureFixture[str], api: str, request: str) -> tuple[int, Any, str]:
    status = main(["explain", "--config", ROUTING, "--api", api, request])
    out, err = capsys.readouterr()
    return status, json.loads(out) if out else None, err


def test_explain_takes_a_responses_body_by_the_apis_name(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    picture = {"type": "input_image", "image_url": "https://example.com/a.png"}
    body = {
        "model": "kimi-k3-text",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}, picture]}],
    }
    status, decision, err = explain_on(capsys, "responses", write_request(tmp_path, body))
    assert (status, err) == (0, "")
    assert (decision["api"], decision["route"]) == ("responses", "strip")
    assert [(p["location"], p["action"]) for p in decision["parts"]] == [
        ("input[0].content[0]", "accept"),
        ("input[0].content[1]", "strip"),
    ]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_explain_takes_an_apis_body_by_any_of_its_paths(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, path: str
) -> None:
    block = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    body = {"model": "kimi-k3", "messages": [{"role": "user", "content": [block]}]}
    status, decision, err = explain_on(capsys, path, write_request(tmp_path, body))
    assert (status, err) == (0, "")
    assert (decision["api"], decision["decision"], decision["counts"]) == ("messages", "accept", {"image": 1})


def test_explain_refuses_an_api_the_model_does_not_serve(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    status, decision, _ = explain_on(
        capsys, "/v1/embeddings", write_request(tmp_path, {"model": "kimi-k3", "input": "hi"})
    )
    assert (status, decision["decision"], decision["status"]) == (1, "reject", 400)
    assert decision["error"]["code"] == "unsupported_api"


def test_explain_with_an_unknown_api_is_a_usage_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["explain", "--api", "/v1/nope", write_request(tmp_path, chat("kimi-k3"))])
    assert exited.value.code == 2
    assert "invalid choice: '/v1/nope'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("body", "api"),
    [
        ({"model": "kimi-k3", "input": "hi"}, "responses"),
        (
            {"model": "kimi-k3", "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]},
            "responses",
        ),
        (
            {"model": "kimi-k3", "max_tokens": 8, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]},
            "messages",
        ),
        ({"model": "kimi-k3", "system": "be brief", "messages": [{"role": "user", "content": "hi"}]}, "messages"),
        ({"model": "kimi-k3", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, "chat"),
        ({"model": "kimi-k3", "messages": "not a list"}, "chat"),  # chat's own error says what is wrong
        (  # thinking is a block of both; image_url of chat alone
            {"model": "kimi-k3", "messages": [
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "..."}]},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]},
            ]},
            "chat",
        ),
    ],
)  # fmt: skip
def test_explain_reads_the_api_from_the_body_unless_told(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, body: dict[str, Any], api: str
) -> None:
    """A Responses body without --api is explained as one, not refused for its missing 'messages'."""
    from gateway.server.cli import guess_api

    assert guess_api(body) == api
    status = main(["explain", "--config", ROUTING, write_request(tmp_path, body)])
    out, _ = capsys.readouterr()
    decision = json.loads(out)
    if status == 0:
        assert decision["api"] == api
    else:
        assert "'messages' must be" in decision["error"]["message"] and api == "chat"


def test_explain_says_what_a_request_asks_to_be_answered_with(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from gateway.server.cli import guess_api

    table = tmp_path / "routing.yaml"
    table.write_text(
        "version: 1\nmodels:\n"
        "  - {name: talker, upstreams: ['http://h:1'], accepts: [text], produces: [text, audio],\n"
        "     apis: [chat, speech]}\n"
        "  - {name: texty, upstreams: ['http://h:1'], accepts: [text]}\n"
    )
    speech = {"model": "talker", "input": "hello there", "voice": "alloy"}
    assert guess_api(speech) == "speech"
    said = []
    for body in (speech, {"model": "talker", "modalities": ["audio"], "messages": [{"role": "user", "content": "hi"}]}):
        assert main(["explain", "--config", str(table), write_request(tmp_path, body)]) == 0
        decision = json.loads(capsys.readouterr().out)
        said.append((decision["api"], decision["outputs"]))
    assert said == [("speech", ["audio"]), ("chat", ["audio"])]
    refused = {"model": "texty", "input": "hi", "voice": "alloy"}
    assert main(["explain", "--config", str(table), write_request(tmp_path, refused)]) == 1
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "unsupported_output_modality"


def test_explain_follows_an_output_apis_redirect_and_says_the_fields_it_sets(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    table = tmp_path / "routing.yaml"
    table.write_text(
        "version: 1\nmodels:\n"
        "  - {name: flux, upstreams: ['http://h:1'], accepts: [text], produces: [image], apis: [images],\n"
        "     output_limits: {image: 2}}\n"
        "  - {name: texty, upstreams: ['http://h:1'], accepts: [text], apis: [chat],\n"
        "     on_unsupported_output: {image: {redirect: flux}}}\n"
    )
    asked = {"model": "texty", "prompt": "a cat"}
    assert main(["explain", "--config", str(table), "--api", "images", write_request(tmp_path, asked)]) == 0
    decision = json.loads(capsys.readouterr().out)
    assert (decision["model"], decision["route"], decision["sets"]) == (
        "flux",
        "redirect",
        {"response_format": "b64_json"},
    )
    assert decision["redirects"] == [{"from": "texty", "modality": "image", "to": "flux", "for": "output"}]
    over = {"model": "flux", "prompt": "a cat", "n": 3}
    assert main(["explain", "--config", str(table), "--api", "images", write_request(tmp_path, over)]) == 1
    assert json.loads(capsys.readouterr().out)["error"]["param"] == "n"
