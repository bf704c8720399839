"""The scripted server's multimodal messages, images endpoint and several-model scripts, through the real SDK."""

from __future__ import annotations

import base64
import urllib.request

import openai
import pytest

from hermes_batch.formats.records import Usage
from hermes_batch.testing import ImageReply, Reply, RoutedScript
from hermes_batch.testing.images import data_url_bytes, png_for, png_size, solid_png


def _client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="sk-test-canary-3f9c1d", max_retries=0)


def test_solid_png_is_a_png_of_that_size():
    data = solid_png(3, 2, (255, 0, 0))
    assert png_size(data) == (3, 2)
    assert png_size(b"GIF89a....") is None


def test_multimodal_parts_reach_the_script_with_their_images(model_server):
    seen = []

    def script(request):
        seen.append(request.images)
        size = png_size(data_url_bytes(request.images[0]))
        return Reply(content=f"{request.prompt} / a {size[0]}x{size[1]} PNG")

    server = model_server(script)
    image = "data:image/png;base64," + base64.b64encode(solid_png(5, 7, (1, 2, 3))).decode()
    answer = _client(server).chat.completions.create(
        model="vision-model",
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": image}},
        ]}],
    )
    assert answer.choices[0].message.content == "What is this? / a 5x7 PNG"
    assert seen == [(image,)]


def test_a_malformed_image_part_is_a_400(model_server):
    server = model_server(lambda r: Reply(content="never"))
    with pytest.raises(openai.BadRequestError):
        _client(server).chat.completions.create(
            model="m", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 5}}]}]
        )


def test_images_are_served_by_url_or_as_b64_json(model_server):
    server = model_server(lambda r: Reply(content="-"))
    client = _client(server)
    by_url = client.images.generate(model="dall-e-3", prompt="a red fox", size="1024x1024")
    with urllib.request.urlopen(by_url.data[0].url) as response:
        assert response.read() == png_for("a red fox\x000")
    inline = client.images.generate(model="gpt-image-1", prompt="a blue whale")
    assert base64.b64decode(inline.data[0].b64_json) == png_for("a blue whale\x000")
    assert [(r.model, r.prompt, r.size) for r in server.image_requests] == [
        ("dall-e-3", "a red fox", "1024x1024"), ("gpt-image-1", "a blue whale", None)
    ]


def test_the_images_script_decides_bytes_usage_and_errors(model_server):
    def images(request):
        if "forbidden" in request.prompt:
            return ImageReply(status=400, error_message="Your request was rejected by the safety system.")
        return ImageReply(image=solid_png(1, 1, (0, 0, 0)), usage=Usage(prompt_tokens=12, completion_tokens=256))

    server = model_server(lambda r: Reply(content="-"), images=images)
    client = _client(server)
    answer = client.images.generate(model="gpt-image-1", prompt="ok")
    assert png_size(base64.b64decode(answer.data[0].b64_json)) == (1, 1)
    assert answer.usage.input_tokens == 12 and answer.usage.output_tokens == 256
    with pytest.raises(openai.BadRequestError, match="safety system"):
        client.images.generate(model="gpt-image-1", prompt="forbidden thing")


def test_images_need_the_key_and_a_known_model(model_server):
    server = model_server(lambda r: Reply(content="-"), models=["gpt-image-1"])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).images.generate(model="gpt-image-1", prompt="x")
    with pytest.raises(openai.NotFoundError):
        _client(server).images.generate(model="dall-e-9", prompt="x")


def test_one_server_plays_several_models(model_server):
    script = RoutedScript(
        {"ref-a": lambda r: Reply(content="A says 4"), "ref-b": lambda r: Reply(content="B says 4")},
        default=lambda r: Reply(content=f"{r.model} combines"),
        by="model",
    )
    server = model_server(script)
    client = _client(server)
    answers = [
        client.chat.completions.create(model=m, messages=[{"role": "user", "content": "2+2?"}]).choices[0].message.content
        for m in ("ref-a", "ref-b", "aggregator")
    ]
    assert answers == ["A says 4", "B says 4", "aggregator combines"]
