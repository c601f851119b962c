"""The real coding agents through the gateway: Claude Code and Codex CLI (pinned in clients.txt,
installed by ``make conformance`` from npm into a cache directory outside the repo), each run
non-interactively with a temporary HOME, no vendor login and no traffic off the machine, against
the gateway in front of a stand-in engine that streams as vLLM does and drives the agent to read
an image with its own tool (tools.standin: ``@read PATH``). Each case asserts what the user sees
(the CLI's output) and what the engine got. How each is pointed at the gateway: docs/clients.md.

Outside ``make conformance`` (no ``MODALITY_GATEWAY_CLIENTS``) the module is skipped; under it, a
missing CLI is a failure.
"""

from __future__ import annotations

import asyncio
import base64
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.conftest import Upstream, routing
from tests.images import png

if TYPE_CHECKING:  # the openai-agents SDK is in the conformance venv alone
    ToolOutputImage = Any
else:
    try:  # a tool's annotations are read at run time, in this module's globals
        from agents import ToolOutputImage
    except ImportError:  # pragma: no cover
        ToolOutputImage = Any

pytestmark = pytest.mark.timeout(300)
CLIENTS = os.environ.get("MODALITY_GATEWAY_CLIENTS")
if not CLIENTS:
    pytest.skip("the CLIs are installed by make conformance (MODALITY_GATEWAY_CLIENTS)", allow_module_level=True)
BIN = Path(CLIENTS) / "node_modules" / ".bin"
KEY_ENV = "MODALITY_GATEWAY_TEST_AGENT_KEY"
KEY = "sk-gateway-agent"
HISTORY = "on_unsupported: {image: {history: strip}}"
DESCRIBED = "on_unsupported: {image: {describe: vision}, file: {extract: {max_pages: 4}}}"
NOTE = "[An image was removed here by the gateway: model '{}' does not take image input]"


@dataclass
class Ran:
    rc: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


@dataclass
class Agent:
    """One CLI, its HOME and working directory of its own, pointed at a gateway."""

    name: str  # claude or codex
    env: dict[str, str]
    cwd: Path

    async def run(self, *args: str) -> Ran:
        process = await asyncio.create_subprocess_exec(
            str(BIN / self.name),
            *args,
            cwd=self.cwd,
            env=self.env,
            stdin=asyncio.subprocess.DEVNULL,  # codex exec reads stdin otherwise
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(process.communicate(), timeout=240)
        except TimeoutError:
            process.kill()
            raise
        assert process.returncode is not None
        return Ran(process.returncode, out.decode(errors="replace"), err.decode(errors="replace"))

    async def ask(self, prompt: str, *, again: bool = False) -> Ran:
        """A prompt, non-interactively; ``again``: in the same session as the last one."""
        if self.name == "claude":
            return await self.run(
                "-p", *(["--continue"] if again else []), "--permission-mode", "bypassPermissions", prompt
            )
        if again:
            return await self.run("exec", "--skip-git-repo-check", "resume", "--last", prompt)
        return await self.run("exec", "--skip-git-repo-check", prompt)


def _environment(home: Path, url: str, model: str, key: str, headers: dict[str, str], retries: int) -> dict[str, str]:
    """Each CLI offline, at the gateway alone: its own HOME, every vendor call switched off, and
    a dead proxy for anything else (nothing may leave the machine); Codex retries a broken
    stream ``retries`` times (docs/clients.md: 0, one attempt, what it is told in the docs)."""
    env = {
        "PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "HTTP_PROXY": "http://127.0.0.1:9",
        "NO_PROXY": "127.0.0.1,localhost",
        "TERM": "dumb",
        # Claude Code (docs/clients.md)
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_API_KEY": key,
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_NON_ESSENTIAL_MODEL_CALLS": "1",
        "IS_SANDBOX": "1",  # bypassPermissions as root
        "ANTHROPIC_CUSTOM_HEADERS": "\n".join(f"{k}: {v}" for k, v in headers.items()),
        # Codex: its config.toml below reads the key from here
        "CODEX_HOME": str(home / ".codex"),
        "GATEWAY_API_KEY": key,
    }
    (home / ".claude").mkdir(parents=True)
    (home / ".codex").mkdir(parents=True)
    extra = "".join(f'"{k}" = "{v}"\n' for k, v in headers.items())
    (home / ".codex" / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "gateway"\napproval_policy = "never"\nsandbox_mode = "read-only"\n'
        "check_for_update_on_startup = false\n"
        "[features]\nplugins = false\n[analytics]\nenabled = false\n[feedback]\nenabled = false\n"
        '[otel]\nexporter = "none"\n'
        f'[model_providers.gateway]\nname = "gateway"\nbase_url = "{url}/v1"\nwire_api = "responses"\n'
        f'env_key = "GATEWAY_API_KEY"\nrequest_max_retries = 0\nstream_max_retries = {retries}\n'
        f"[model_providers.gateway.http_headers]\n{extra}"
    )
    return env


@pytest.fixture
def agents(tmp_path: Path):
    """``make(name, url, model, key=KEY, headers={}, retries=0)``: an Agent in a fresh HOME and
    directory, with a PNG at ``cwd/x.png``."""
    made = 0

    def make(
        name: str, url: str, model: str, key: str = KEY, headers: dict[str, str] | None = None, retries: int = 0
    ) -> Agent:
        nonlocal made
        made += 1
        root = tmp_path / f"{name}{made}"
        cwd = root / "work"
        cwd.mkdir(parents=True)
        (cwd / "x.png").write_bytes(png(size=(16, 16)))
        assert (BIN / name).exists(), f"{BIN / name} is not installed (make conformance installs it)"
        return Agent(name, _environment(root / "home", url, model, key, headers or {}, retries), cwd)

    return make


def _table(engine: Upstream, *, auth: bool = False) -> str:
    keys = f"auth:\n  keys:\n    - {{name: team, key_env: {KEY_ENV}}}\n" if auth else ""
    return routing(
        f"  - {{name: vision, upstreams: [{engine.url}], accepts: [text, image]}}",
        f"  - {{name: texty, upstreams: [{engine.url}], accepts: [text]}}",
        f"  - {{name: agent, upstreams: [{engine.url}], accepts: [text], {HISTORY}}}",
        f"  - {{name: stripper, upstreams: [{engine.url}], accepts: [text], on_unsupported: {{image: strip}}}}",
        f"  - {{name: described, upstreams: [{engine.url}], accepts: [text], {DESCRIBED}}}",
        extra=keys,
    )


def _read(agent: Agent) -> str:
    return f"@read {agent.cwd / 'x.png'}"


@pytest.fixture
async def engine(vllm) -> Upstream:
    """The stand-in engine, every body it gets held to vLLM's own request models and parsers (a
    body vLLM refuses is its 400): what the real clients send through the gateway, vLLM takes."""
    checked = await vllm()
    upstream: Upstream = checked.upstream
    upstream.standin.name = "engine"
    return upstream


AGENTS = ["claude", "codex"]
IMAGE_PART = {"claude": "image=1", "codex": "input_image=1"}
API = {"claude": "/v1/messages", "codex": "/v1/responses"}


@pytest.mark.parametrize("name", AGENTS)
async def test_text_and_an_image_its_tool_read_reach_an_image_model(gateway_factory, engine, agents, name) -> None:
    gw = await gateway_factory(_table(engine))
    agent = agents(name, gw.url, "vision")
    said = await agent.ask("say hi")
    assert said.rc == 0, said.output
    assert "[engine] model=vision" in said.stdout
    read = await agent.ask(_read(agent))
    assert read.rc == 0, read.output
    assert IMAGE_PART[name] in read.stdout  # the engine's reply counts the image it got
    last = engine.received[-1]
    assert last.path.startswith(API[name])
    assert b"data:image/png;base64," in last.body or b'"media_type":"image/png"' in last.body


@pytest.mark.parametrize("name", AGENTS)
async def test_strip_and_describe_serve_the_image_its_tool_read_to_a_text_model(
    gateway_factory, engine, agents, name
) -> None:
    gw = await gateway_factory(_table(engine))
    stripper = agents(name, gw.url, "stripper")
    ran = await stripper.ask(_read(stripper))
    assert ran.rc == 0, ran.output
    assert NOTE.format("stripper") in engine.received[-1].body.decode()
    described = agents(name, gw.url, "described")
    ran = await described.ask(_read(described))
    assert ran.rc == 0, ran.output
    asked, served = engine.received[-2:]
    assert asked.path == "/v1/chat/completions" and asked.json()["model"] == "vision"  # the describer
    assert "[Description of an image] [engine] model=vision" in served.body.decode()
    assert "data:image/png" not in served.body.decode() and "iVBOR" not in served.body.decode()


async def test_a_pdf_claude_code_reads_reaches_a_text_model_as_its_text(gateway_factory, engine, agents) -> None:
    from tools import pdfs

    gw = await gateway_factory(_table(engine))
    agent = agents("claude", gw.url, "described")
    (agent.cwd / "notes.pdf").write_bytes(pdfs.text_pdf(["the quarterly numbers"]))
    ran = await agent.ask(f"@read {agent.cwd / 'notes.pdf'}")
    assert ran.rc == 0, ran.output
    sent = engine.received[-1].body.decode()
    assert "the quarterly numbers" in sent and "JVBER" not in sent  # its text, not the PDF


@pytest.mark.parametrize("name", AGENTS)
async def test_a_wrong_key_fails_at_once_with_the_gateways_message(gateway_factory, engine, agents, monkeypatch, name):
    monkeypatch.setenv(KEY_ENV, KEY)
    gw = await gateway_factory(_table(engine, auth=True))
    ran = await agents(name, gw.url, "vision", key="sk-wrong").ask("say hi")
    assert ran.rc != 0 and "Invalid API key" in ran.output
    assert engine.received == []
    # Claude Code honours x-should-retry: false; Codex's stream retries (0 here) do not read it
    assert gw.sample("gateway_auth_failures_total", reason="invalid") == 1


@pytest.mark.parametrize("name", AGENTS)
async def test_reject_shows_the_refusal_and_history_strip_lets_the_session_go_on(
    gateway_factory, engine, agents, name
) -> None:
    gw = await gateway_factory(_table(engine))
    texty = agents(name, gw.url, "texty")
    refused = await texty.ask(_read(texty))
    assert refused.rc != 0
    assert "Model 'texty' does not accept image input" in refused.output
    agent = agents(name, gw.url, "agent")
    first = await agent.ask(_read(agent))
    assert first.rc == 0, first.output
    sent = engine.received[-1].body.decode()
    assert NOTE.format("agent") in sent and "data:image/png" not in sent and "iVBOR" not in sent
    again = await agent.ask("and what was in it?", again=True)
    assert again.rc == 0, again.output
    assert NOTE.format("agent") in engine.received[-1].body.decode()  # the image resent, stripped again


async def test_a_stream_broken_midway_shows_codex_the_gateways_message(gateway_factory, engine, agents) -> None:
    """Codex reads the response.failed event the gateway ends the stream with (it ignores the
    error event) and shows its message; told one attempt (stream_max_retries = 0, docs/clients.md),
    the engine gets one request."""
    gw = await gateway_factory(_table(engine))
    ran = await agents("codex", gw.url, "vision", headers={"X-Standin-Break-After": "2"}).ask("say hi")
    assert ran.rc != 0
    assert "stream disconnected before completion: Upstream of model 'vision' broke off the stream" in ran.stderr
    assert len(engine.received) == 1


async def test_codexs_retry_of_a_broken_stream_is_served_by_another_replica(gateway_factory, vllm, agents) -> None:
    """With its retries on (Codex's default), a stream one replica broke is asked again, and the
    gateway, which counted the break against that replica, serves it from the other: the user
    gets the answer. Why the gateway's code for a broken stream stays one Codex retries."""
    broken, sound = (await vllm()).upstream, (await vllm()).upstream
    broken.standin.break_after = 2
    table = routing(
        f"  - {{name: vision, upstreams: [{broken.url}, {sound.url}], accepts: [text, image], "
        "balance: round_robin, breaker: {failures: 1, open_s: 60}}"
    )
    gw = await gateway_factory(table)
    ran = await agents("codex", gw.url, "vision", retries=1).ask("say hi")
    assert ran.rc == 0, ran.output
    assert "model=vision" in ran.stdout
    assert (len(broken.received), len(sound.received)) == (1, 1)


async def test_a_stream_broken_midway_is_claude_codes_to_retry_without_streaming(
    gateway_factory, engine, agents
) -> None:
    """Claude Code reads the Anthropic error event the gateway ends the stream with, and asks
    again without streaming: the user gets the whole answer."""
    gw = await gateway_factory(_table(engine))
    ran = await agents("claude", gw.url, "vision", headers={"X-Standin-Break-After": "2"}).ask("say hi")
    assert ran.rc == 0 and ran.stdout.startswith("[engine] model=vision"), ran.output
    streamed, whole = (r.json().get("stream") for r in engine.received)
    assert (streamed, whole) == (True, None) or (streamed, whole) == (True, False)


# --- the openai-agents SDK: an agent with a tool that returns an image ------------------------------


def _sdk_agent(client: Any, model: str) -> tuple[Any, Any]:
    """An openai-agents Agent on the Responses API at the gateway, with a ``view_image`` tool
    that returns the file as an image (``ToolOutputImage``), as Codex's does; tracing off (it
    would export to OpenAI)."""
    import agents as sdk  # type: ignore[import-not-found]

    sdk.set_tracing_disabled(True)

    @sdk.function_tool  # type: ignore[untyped-decorator]
    def view_image(path: str) -> ToolOutputImage:
        """Look at an image file."""
        data = base64.b64encode(Path(path).read_bytes()).decode()
        return sdk.ToolOutputImage(image_url=f"data:image/png;base64,{data}")

    model_ = sdk.OpenAIResponsesModel(model=model, openai_client=client)
    return sdk.Agent(name="reader", instructions="be brief", model=model_, tools=[view_image]), sdk.Runner


async def test_an_openai_agents_tool_image_reaches_an_image_model_and_is_stripped_with_a_note_elsewhere(
    gateway_factory, engine, tmp_path: Path
) -> None:
    import openai

    (tmp_path / "x.png").write_bytes(png(size=(16, 16)))
    ask = f"@read {tmp_path / 'x.png'}"
    gw = await gateway_factory(_table(engine))
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=KEY, max_retries=0) as client:
        agent, runner = _sdk_agent(client, "vision")
        result = await runner.run(agent, ask)
        assert "input_image=1" in result.final_output
        agent, runner = _sdk_agent(client, "texty")
        with pytest.raises(openai.BadRequestError, match=r"Model 'texty' does not accept image input: input\[2\]"):
            await runner.run(agent, ask)
        agent, runner = _sdk_agent(client, "agent")
        first = await runner.run(agent, ask)
        assert NOTE.format("agent") in engine.received[-1].body.decode()
        again = await runner.run(agent, [*first.to_input_list(), {"role": "user", "content": "and now?"}])
    assert again.final_output.startswith("[engine] model=agent")
    assert NOTE.format("agent") in engine.received[-1].body.decode()


# --- the anthropic SDK: a tool loop of its own, as an agent built on it runs one -------------------

READ_TOOL = {"name": "Read", "description": "read a file", "input_schema": {"type": "object", "properties": {}}}


async def _read_loop(client: Any, model: str, messages: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """One turn of an agent on the anthropic SDK: the model's Read calls answered with the file as
    an image block in a tool_result, until it answers; the reply and the conversation so far."""
    while True:
        reply = await client.messages.create(model=model, max_tokens=64, messages=messages, tools=[READ_TOOL])
        messages = [*messages, {"role": "assistant", "content": [b.model_dump() for b in reply.content]}]
        calls = [b for b in reply.content if b.type == "tool_use"]
        if not calls:
            return reply.content[0].text, messages
        results = []
        for call in calls:
            data = base64.b64encode(Path(call.input["file_path"]).read_bytes()).decode()
            image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
            results.append({"type": "tool_result", "tool_use_id": call.id, "content": [image]})
        messages = [*messages, {"role": "user", "content": results}]


async def test_an_anthropic_sdk_agents_tool_image_to_an_image_model_refused_and_under_history_strip(
    gateway_factory, engine, tmp_path: Path
) -> None:
    import anthropic

    (tmp_path / "x.png").write_bytes(png(size=(16, 16)))
    ask = [{"role": "user", "content": f"@read {tmp_path / 'x.png'}"}]
    gw = await gateway_factory(_table(engine))
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=KEY, max_retries=2) as client:
        said, _ = await _read_loop(client, "vision", ask)
        assert "image=1" in said and "tool_result=1" in said
        with pytest.raises(anthropic.BadRequestError, match=r"Model 'texty' does not accept image input") as refused:
            await _read_loop(client, "texty", ask)
        assert refused.value.request_id == refused.value.response.headers["X-Request-Id"]
        said, conversation = await _read_loop(client, "agent", ask)
        assert said.startswith("[engine] model=agent") and NOTE.format("agent") in engine.received[-1].body.decode()
        said, _ = await _read_loop(client, "agent", [*conversation, {"role": "user", "content": "and now?"}])
    assert said.startswith("[engine] model=agent messages=5")
    assert NOTE.format("agent") in engine.received[-1].body.decode()
