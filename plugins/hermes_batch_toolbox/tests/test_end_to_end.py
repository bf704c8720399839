"""hermes-batch run --distribution default with every toolset: 30 prompts whose model calls every new tool.

The model is the scripted server playing the agent, two reference models, an
aggregator and a vision model; the web is the local website with a SearXNG
stand-in; the browser is Debian's Chromium; images come from the server's
images endpoint.  Everything is real HTTP on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from hermes_batch import Usage
from hermes_batch.testing import TEST_API_KEY, Reply, RoutedScript, Runner, data_url_bytes, png_size, write_dataset

pytestmark = pytest.mark.skipif(not os.access("/usr/bin/chromium", os.X_OK), reason="needs Debian's chromium")

TOOLBOX_TOOLS = {
    "web_search", "web_extract", "browser_navigate", "browser_snapshot", "browser_click", "browser_type",
    "browser_scroll", "browser_back", "browser_press", "browser_get_images", "browser_close", "vision_analyze",
    "image_generate", "mixture_of_agents",
}
CORE_TOOLS = {"terminal", "read_file", "write_file", "patch", "search_files"}


def ref_in(result: str, text: str) -> str:
    decoded = json.loads(result)
    assert "snapshot" in decoded, result
    snapshot = decoded["snapshot"]
    line = next(line for line in snapshot.splitlines() if text in line and "[ref=" in line)
    return "@" + re.search(r"\[ref=([^\]]+)\]", line).group(1)


class Agent:
    """The agent model: one of three plans per prompt, each a list of turns of tool calls."""

    def __init__(self, site_url: str):
        self.site = site_url

    def plan(self, request):
        """The turns of this prompt's plan; a turn that depends on earlier results is a function of the request."""
        index = int(request.prompt.split("#")[1])
        site = self.site
        if index % 3 == 0:  # research: search, read, look, draw, consult
            return [
                [("web_search", {"query": f"lighthouse {index}"})],
                [("web_extract", {"urls": [f"{site}/article"]}), ("vision_analyze", {"image_url": f"{site}/images/red.png", "question": "What colour is it?"})],
                [("image_generate", {"prompt": f"A lighthouse, number {index}", "aspect_ratio": "square"}),
                 ("mixture_of_agents", {"user_prompt": f"How tall is lighthouse {index}?"})],
            ]
        if index % 3 == 1:  # the browser
            return [
                [("browser_navigate", {"url": f"{site}/"})],
                [("browser_snapshot", {})],
                lambda r: [("browser_click", {"ref": ref_in(self._results_of(r, 2)[0], "article about a lighthouse")})],
                [("browser_back", {}), ("browser_navigate", {"url": f"{site}/form"}), ("browser_snapshot", {})],
                lambda r: [("browser_type", {"ref": ref_in(self._results_of(r, 4)[-1], 'textbox "Search query"'), "text": f"lamp {index}"}),
                           ("browser_press", {"key": "Enter"})],
                [("browser_navigate", {"url": f"{site}/gallery"}), ("browser_get_images", {}),
                 ("browser_scroll", {"direction": "down"}), ("browser_close", {})],
            ]
        return [  # a generated picture, looked at, and files
            [("image_generate", {"prompt": f"Chart {index}"})],
            lambda r: [("vision_analyze", {"image_url": json.loads(self._results_of(r, 1)[0])["image"], "question": "Is it a chart?"})],
            [("terminal", {"command": "ls generated_images | wc -l"}), ("write_file", {"path": "notes.md", "content": f"chart {index}\n"})],
            [("read_file", {"path": "notes.md"}), ("patch", {"path": "notes.md", "old_string": "chart", "new_string": "graph"}),
             ("search_files", {"pattern": "graph", "path": "."})],
        ]

    @staticmethod
    def _results_of(request, turn: int) -> list:
        """The tool results that answered the ``turn``-th assistant message (1-based)."""
        seen, out = 0, []
        for m in request.messages:
            if m["role"] == "assistant":
                seen += 1
            elif m["role"] == "tool" and seen == turn:
                out.append(m["content"])
        assert out, f"no results of turn {turn}"
        return out

    def __call__(self, request):
        plan = self.plan(request)
        reasoning = f"Step {request.turn}: deciding what to do."
        if request.turn < len(plan):
            turn = plan[request.turn]
            return Reply(reasoning=reasoning, tool_calls=turn(request) if callable(turn) else turn)
        return Reply(reasoning=reasoning, content="Finished. Last result: " + request.tool_results[-1][:300])


def vision(request):
    data = data_url_bytes(request.images[0])
    width, height = png_size(data)
    return Reply(content=f"I see a {width}x{height} picture.", usage=Usage(prompt_tokens=300, completion_tokens=10, cost=0.003))


def test_thirty_prompts_with_every_toolset(tmp_path, model_server, site, searxng):
    script = RoutedScript({
        "agent-model": Agent(site.url),
        "ref-a": lambda r: Reply(content="About 30 metres.", usage=Usage(prompt_tokens=20, completion_tokens=5, cost=0.001)),
        "ref-b": lambda r: Reply(content="Roughly 31 m.", usage=Usage(prompt_tokens=20, completion_tokens=5, cost=0.001)),
        "judge": lambda r: Reply(content="Combined: about 30 metres.", usage=Usage(prompt_tokens=60, completion_tokens=8, cost=0.002)),
        "vision-model": vision,
    }, by="model")
    server = model_server(script)
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": f"Task #{i}"} for i in range(30)])
    out = tmp_path / "out"
    args = [
        "run", "--dataset_file", str(dataset), "--batch_size", "10", "--run_name", "toolbox", "--output_dir", str(out),
        "--model", "agent-model", "--base_url", server.base_url, "--api_key", TEST_API_KEY, "--no-progress",
        "--distribution", "default", "--num_workers", "8",
        "-T", "web.provider=searxng", "-T", f"web.url={searxng.url}", "-T", "web.allow_private=true",
        "-T", "browser.allow_private=true", "-T", "browser.max_contexts=4",
        "-T", "vision.model=vision-model", "-T", "vision.allow_private=true",
        "-T", "image_gen.model=gpt-image-1",
        "-T", "moa.models=ref-a,ref-b", "-T", "moa.aggregator=judge",
    ]
    result = Runner(tmp_path).cli(*args)
    assert result.exit_code == 0, result.output
    assert server.script_errors == []
    folder = out / "toolbox"
    trajectories = [json.loads(line) for line in (folder / "trajectories.jsonl").read_text().splitlines()]
    assert len(trajectories) == 30 and all(t["completed"] for t in trajectories)
    assert {tuple(sorted(t["toolsets_used"])) for t in trajectories} == {
        ("browser", "file", "image_gen", "moa", "terminal", "vision", "web")
    }

    stats = json.loads((folder / "statistics.json").read_text())
    usage = stats["kept"]["tool_usage"]
    failures = [t["value"] for traj in trajectories for t in traj["conversations"]
                if t["from"] == "tool" and '"success": false' in t["value"]]
    assert failures == [], "\n".join(f[:2000] for f in failures)
    for tool in TOOLBOX_TOOLS | CORE_TOOLS:
        assert usage[tool]["count"] >= 10 and usage[tool]["failure"] == 0, (tool, usage[tool])

    def tool_text(traj) -> str:
        return "\n".join(t["value"] for t in traj["conversations"] if t["from"] == "tool")

    by_index = {t["prompt_index"]: t for t in trajectories}
    research, browsing, drawing = by_index[0], by_index[1], by_index[2]
    assert "The Quiet Lighthouse" in tool_text(research) and "Fresnel lens" in tool_text(research)
    assert "I see a 8x8 picture." in tool_text(research) and "Combined: about 30 metres." in tool_text(research)
    assert server.base_url + "/files/" not in tool_text(research)  # gpt-image answers bytes: saved in the sandbox
    assert "generated_images/a-lighthouse-number-0-" in tool_text(research)
    assert "Results for lamp 1" in tool_text(browsing) and "A blue square" in tool_text(browsing)
    assert "I see a 16x16 picture." in tool_text(drawing) and "graph 2" in tool_text(drawing)

    # the tools' model calls count in each prompt's usage: 2 references + aggregator + vision on research prompts
    assert research["metadata"]["usage"]["cost"] == pytest.approx(0.001 + 0.001 + 0.002 + 0.003)
    assert stats["tokens"]["prompt"] > 0 and stats["cost"] == pytest.approx(10 * 0.007 + 10 * 0.003)
    models = {r.model for r in server.requests}
    assert models == {"agent-model", "ref-a", "ref-b", "judge", "vision-model"}
    assert len(server.image_requests) == 20
    run_json = json.loads((folder / "run.json").read_text())
    assert all(v["left_out"] is None for v in run_json["toolsets"].values())
    assert TEST_API_KEY not in (folder / "run.json").read_text()


def _run(tmp_path, server, *extra):
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": f"Task #{i}"} for i in range(3)])
    args = ["run", "--dataset_file", str(dataset), "--batch_size", "10", "--run_name", "r", "--output_dir",
            str(tmp_path / "out"), "--model", "agent-model", "--base_url", server.base_url, "--api_key", TEST_API_KEY,
            "--no-progress", *extra]
    return Runner(tmp_path).cli(*args)


def test_without_options_web_and_image_gen_are_left_out_once(tmp_path, model_server):
    server = model_server(lambda r: Reply(reasoning="thinking", content="done"))
    result = _run(tmp_path, server, "--distribution", "creative")
    assert result.exit_code == 0, result.output
    assert result.output.count("Toolset image_gen is left out of sampling: no image model is configured") == 1
    assert result.output.count("Toolset web is left out of sampling: no search provider is configured") == 1
    trajectories = [json.loads(line) for line in (tmp_path / "out" / "r" / "trajectories.jsonl").read_text().splitlines()]
    assert {tuple(t["toolsets_used"]) for t in trajectories} == {("vision",)}


def test_a_distribution_with_nothing_configured_stops_before_any_request(tmp_path, model_server):
    server = model_server(lambda r: Reply(content="never"))
    result = _run(tmp_path, server, "--distribution", "minimal")
    assert result.exit_code == 2
    assert "No toolset of distribution 'minimal' can run. web: no search provider is configured" in result.output
    assert server.request_count == 0 and not (tmp_path / "out" / "r").exists()
