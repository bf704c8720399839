"""vision_analyze, image_generate and mixture_of_agents against the scripted model server (and a FAL stand-in)."""

from __future__ import annotations

import base64
import hashlib

import pytest

import hermes_batch
from hermes_batch import ModelSettings, Usage
from hermes_batch.testing import (
    TEST_API_KEY,
    ErrorRule,
    ImageReply,
    Reply,
    RoutedScript,
    data_url_bytes,
    png_for,
    png_size,
    solid_png,
)
from hermes_batch_toolbox.image_gen import ImageGenerateTool
from hermes_batch_toolbox.moa import MixtureOfAgentsTool
from hermes_batch_toolbox.testing import FalStandIn
from hermes_batch_toolbox.vision import VisionAnalyzeTool

OpenAIClient = hermes_batch.get_plugin_manager(load_entry_points=False).registry().get("model_clients", "openai")


def describe_image(request):
    """A vision model that says what it was shown: the PNG's size and a digest of its bytes."""
    data = data_url_bytes(request.images[0])
    width, height = png_size(data)
    return Reply(content=f"A {width}x{height} image, sha {hashlib.sha256(data).hexdigest()[:8]}. Q: {request.prompt.split(chr(10))[-1]}",
                 usage=Usage(prompt_tokens=100, completion_tokens=20, cost=0.002))


@pytest.fixture
async def endpoint(model_server):
    """(server, settings, client) of the run's endpoint."""
    server = model_server(RoutedScript({"vision-model": describe_image}, by="model",
                                       default=lambda r: Reply(content=f"{r.model}: 42")))
    settings = ModelSettings(model="agent-model", base_url=server.base_url, api_key=TEST_API_KEY, max_retries=2)
    client = OpenAIClient(settings)
    yield server, settings, client
    await client.aclose()


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:8]


async def test_vision_sends_the_image_from_a_url_a_file_or_a_data_url(endpoint, toolsets, sandbox, site):
    server, settings, client = endpoint
    runtime = await toolsets.start("vision", {"model": "vision-model", "allow_private": True}, settings=settings, client=client)
    ctx = toolsets.context(sandbox, vision=runtime)
    from hermes_batch_toolbox.testing import IMAGES

    by_url = await VisionAnalyzeTool().call({"image_url": site.url + "/images/blue.png", "question": "What colour?"}, ctx)
    assert by_url == {"success": True, "analysis": f"A 16x16 image, sha {digest(IMAGES['blue.png'])}. Q: What colour?"}

    await sandbox.write_file("shots/one.png", solid_png(3, 4, (9, 9, 9)))
    by_file = await VisionAnalyzeTool().call({"image_url": "shots/one.png", "question": "Size?"}, ctx)
    assert by_file["analysis"].startswith("A 3x4 image")

    inline = "data:image/png;base64," + base64.b64encode(solid_png(2, 2, (1, 1, 1))).decode()
    assert (await VisionAnalyzeTool().call({"image_url": inline, "question": "?"}, ctx))["analysis"].startswith("A 2x2 image")

    assert [r.model for r in server.requests] == ["vision-model"] * 3
    assert toolsets.usage == Usage(prompt_tokens=300, completion_tokens=60, cost=0.006)
    assert client.limiter.cost == pytest.approx(0.006)  # the run's limiter: counts against --max_cost


@pytest.mark.parametrize("fmt", ["think_tags", "scratchpad", "reasoning", "reasoning_content", "reasoning_details"])
async def test_the_vision_models_reasoning_stays_out_of_the_analysis(model_server, toolsets, sandbox, fmt):
    # however the model sends its reasoning (inline <think> blocks or a field of its own), only the answer is
    # the tool's result; an answer that is reasoning only fails the call rather than passing the thoughts on
    def vision(request):
        if "Only think" in request.prompt:
            return Reply(reasoning="The user wants colours; I think it is red.", reasoning_format=fmt)
        return Reply(reasoning="The user wants colours; I think it is red.", reasoning_format=fmt,
                     content="A red square.")

    server = model_server(vision)
    settings = ModelSettings(model="vision-model", base_url=server.base_url, api_key=TEST_API_KEY, max_retries=0)
    client = OpenAIClient(settings)
    runtime = await toolsets.start("vision", {}, settings=settings, client=client)
    ctx = toolsets.context(sandbox, vision=runtime)
    inline = "data:image/png;base64," + base64.b64encode(solid_png(1, 1, (255, 0, 0))).decode()
    answer = await VisionAnalyzeTool().call({"image_url": inline, "question": "Which colour?"}, ctx)
    assert answer == {"success": True, "analysis": "A red square."}
    thoughts = await VisionAnalyzeTool().call({"image_url": inline, "question": "Only think"}, ctx)
    assert thoughts["success"] is False and "I think it is red" not in thoughts["error"]
    assert thoughts["error"].startswith("The vision model answered with reasoning only")
    await client.aclose()


async def test_vision_refuses_what_is_not_an_image(endpoint, toolsets, sandbox, site):
    server, settings, client = endpoint
    runtime = await toolsets.start("vision", {"allow_private": True, "max_image_bytes": 1000}, settings=settings, client=client)
    ctx = toolsets.context(sandbox, vision=runtime)
    await sandbox.write_file("notes.txt", b"hello")

    async def error(image_url):
        result = await VisionAnalyzeTool().call({"image_url": image_url, "question": "?"}, ctx)
        assert result["success"] is False
        return result["error"]

    assert await error("notes.txt") == "That is not a PNG, JPEG, GIF, WebP or BMP image."
    assert await error("missing.png") == "There is no file missing.png in your sandbox."
    assert await error(site.url + "/article") == "That is not a PNG, JPEG, GIF, WebP or BMP image."
    assert await error(site.url + "/huge") == "The image is larger than 1000 bytes."
    assert await error("ftp://x/y.png") == "image_url must be an http(s) URL, a data: URL or a file path in your sandbox."
    assert await error("data:image/png;base64,!!!") == "The data: URL is not valid base64."
    assert server.requests == []  # nothing was sent to the model


async def test_a_refusing_vision_endpoint_fails_the_call_not_the_prompt(model_server, toolsets, sandbox):
    server = model_server(lambda r: Reply(content="x"), errors=[ErrorRule(status=503, rate=1.0)])
    settings = ModelSettings(model="m", base_url=server.base_url, api_key=TEST_API_KEY, max_retries=1)
    client = OpenAIClient(settings)
    runtime = await toolsets.start("vision", {}, settings=settings, client=client)
    inline = "data:image/png;base64," + base64.b64encode(solid_png(1, 1, (0, 0, 0))).decode()
    result = await VisionAnalyzeTool().call({"image_url": inline, "question": "?"}, toolsets.context(sandbox, vision=runtime))
    await client.aclose()
    assert result["success"] is False and "answered 503" in result["error"] and "gave up after 2 attempts" in result["error"]


async def test_vision_on_another_endpoint_uses_its_own_key(model_server, toolsets, sandbox, monkeypatch):
    other = model_server(describe_image, api_key="vision-secret")
    monkeypatch.setenv("HB_TEST_VISION_KEY", "vision-secret")
    settings = ModelSettings(model="agent-model", base_url="http://127.0.0.1:9/v1", api_key=TEST_API_KEY)
    runtime = await toolsets.start("vision", {"base_url": other.base_url, "api_key_env": "HB_TEST_VISION_KEY", "model": "v"},
                                   settings=settings, client=OpenAIClient(settings))
    inline = "data:image/png;base64," + base64.b64encode(solid_png(6, 6, (0, 0, 0))).decode()
    result = await VisionAnalyzeTool().call({"image_url": inline, "question": "?"}, toolsets.context(sandbox, vision=runtime))
    assert result["analysis"].startswith("A 6x6 image") and other.requests[0].headers["authorization"] == "Bearer vision-secret"


async def test_image_generate_returns_a_url_or_saves_the_bytes_in_the_sandbox(endpoint, toolsets, sandbox):
    server, settings, client = endpoint
    runtime = await toolsets.start("image_gen", {"model": "dall-e-3"}, settings=settings, client=client)
    ctx = toolsets.context(sandbox, image_gen=runtime)
    result = await ImageGenerateTool().call({"prompt": "A lighthouse at dusk", "aspect_ratio": "portrait"}, ctx)
    assert result["success"] is True and result["image"].startswith(server.base_url + "/files/")
    assert (server.image_requests[-1].model, server.image_requests[-1].size) == ("dall-e-3", "1024x1792")

    runtime = await toolsets.start("image_gen", {"model": "gpt-image-1"}, settings=settings, client=client)
    ctx = toolsets.context(sandbox, image_gen=runtime)
    result = await ImageGenerateTool().call({"prompt": "A lighthouse at dusk"}, ctx)
    assert result["success"] is True and result["image"].startswith("generated_images/a-lighthouse-at-dusk-")
    assert await sandbox.read_file(result["image"]) == png_for("A lighthouse at dusk\x000")
    assert server.image_requests[-1].size == "1536x1024"  # landscape, in gpt-image sizes


async def test_image_generate_counts_usage_and_reports_refusals(model_server, toolsets, sandbox):
    def images(request):
        if "forbidden" in request.prompt:
            return ImageReply(status=400, error_message="Rejected by the safety system.")
        return ImageReply(usage=Usage(prompt_tokens=10, completion_tokens=1000, cost=0.04))

    server = model_server(lambda r: Reply(content="-"), images=images)
    settings = ModelSettings(model="agent-model", base_url=server.base_url, api_key=TEST_API_KEY)
    runtime = await toolsets.start("image_gen", {"model": "gpt-image-1", "download": True}, settings=settings,
                                   client=OpenAIClient(settings))
    ctx = toolsets.context(sandbox, image_gen=runtime)
    assert (await ImageGenerateTool().call({"prompt": "fine"}, ctx))["success"] is True
    assert toolsets.usage == Usage(prompt_tokens=10, completion_tokens=1000, cost=0.04)
    refused = await ImageGenerateTool().call({"prompt": "forbidden"}, ctx)
    assert refused["success"] is False and "Rejected by the safety system." in refused["error"]


async def test_image_generate_through_fal(toolsets, sandbox, monkeypatch):
    monkeypatch.setenv("FAL_KEY", "fal-secret")
    with FalStandIn(key="fal-secret") as fal:
        runtime = await toolsets.start("image_gen", {"provider": "fal", "base_url": fal.url, "download": True})
        ctx = toolsets.context(sandbox, image_gen=runtime)
        result = await ImageGenerateTool().call({"prompt": "a red kite", "aspect_ratio": "square"}, ctx)
    assert fal.requests == [{"model": "fal-ai/flux/schnell", "prompt": "a red kite", "image_size": "square_hd", "num_images": 1}]
    assert result["success"] is True and result["url"].startswith(fal.url)
    assert await sandbox.read_file(result["image"]) == png_for("a red kite")


async def test_moa_asks_the_references_in_parallel_then_the_aggregator(model_server, toolsets, sandbox):
    def aggregator(request):
        system = request.messages[0]["content"]
        return Reply(content="Combined: " + " | ".join(line for line in system.splitlines() if line[:2] in ("1.", "2.")),
                     usage=Usage(prompt_tokens=50, completion_tokens=10, cost=0.01))

    script = RoutedScript({
        "ref-a": lambda r: Reply(content="four", usage=Usage(prompt_tokens=5, completion_tokens=1, cost=0.001)),
        "ref-b": lambda r: Reply(content="4", usage=Usage(prompt_tokens=5, completion_tokens=1, cost=0.001)),
        "judge": aggregator,
    }, by="model")
    server = model_server(script)
    settings = ModelSettings(model="agent-model", base_url=server.base_url, api_key=TEST_API_KEY)
    client = OpenAIClient(settings)
    runtime = await toolsets.start("moa", {"models": "ref-a,ref-b", "aggregator": "judge"}, settings=settings, client=client)
    result = await MixtureOfAgentsTool().call({"user_prompt": "What is 2+2?"}, toolsets.context(sandbox, moa=runtime))
    await client.aclose()
    assert result == {"success": True, "response": "Combined: 1. four | 2. 4",
                      "models_used": {"reference_models": ["ref-a", "ref-b"], "aggregator_model": "judge"}}
    assert sorted(r.model for r in server.requests[:2]) == ["ref-a", "ref-b"] and server.requests[2].model == "judge"
    assert server.requests[2].messages[-1] == {"role": "user", "content": "What is 2+2?"}
    assert toolsets.usage == Usage(prompt_tokens=60, completion_tokens=12, cost=0.012)
    assert client.limiter.cost == pytest.approx(0.012)


async def test_moa_goes_on_without_a_failing_reference_and_defaults_to_the_run_model(model_server, toolsets, sandbox):
    server = model_server(lambda r: Reply(content=f"{r.model} answer"), models=["agent-model", "ref-a"])
    settings = ModelSettings(model="agent-model", base_url=server.base_url, api_key=TEST_API_KEY)
    client = OpenAIClient(settings)
    runtime = await toolsets.start("moa", {"models": ["ref-a", "no-such-model"]}, settings=settings, client=client)
    result = await MixtureOfAgentsTool().call({"user_prompt": "Hard problem"}, toolsets.context(sandbox, moa=runtime))
    assert result["success"] is True and result["response"] == "agent-model answer"
    assert [f["model"] for f in result["failed_models"]] == ["no-such-model"]

    strict = await toolsets.start("moa", {"models": ["no-such-model"]}, settings=settings, client=client)
    failed = await MixtureOfAgentsTool().call({"user_prompt": "Hard"}, toolsets.context(sandbox, moa=strict))
    assert failed["success"] is False and failed["error"] == "Only 0 reference model(s) answered."

    default = await toolsets.start("moa", {}, settings=settings, client=client)
    assert default.references == ("agent-model",) * 3 and default.aggregator == "agent-model"
    await client.aclose()


async def test_moa_passes_on_answers_never_reasoning(model_server, toolsets, sandbox):
    # a reference model that only reasons did not answer: its thoughts do not reach the aggregator or the result
    script = RoutedScript({
        "ref-a": lambda r: Reply(content="four", reasoning="<private> two and two"),
        "ref-b": lambda r: Reply(reasoning="<private> I keep thinking and never answer"),
        "judge": lambda r: Reply(content="Combined: " + r.messages[0]["content"].split("answers:")[-1].strip(),
                                 reasoning="<private> judging"),
    }, by="model")
    server = model_server(script)
    settings = ModelSettings(model="agent-model", base_url=server.base_url, api_key=TEST_API_KEY)
    client = OpenAIClient(settings)
    runtime = await toolsets.start("moa", {"models": "ref-a,ref-b", "aggregator": "judge"}, settings=settings, client=client)
    result = await MixtureOfAgentsTool().call({"user_prompt": "What is 2+2?"}, toolsets.context(sandbox, moa=runtime))
    await client.aclose()
    assert result["success"] is True and "<private>" not in str(result)
    assert result["response"] == "Combined: 1. four"
    assert result["failed_models"] == [{"model": "ref-b", "error": "ref-b answered with no text (reasoning only)"}]
