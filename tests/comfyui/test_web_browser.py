"""The block-map widget in the real ComfyUI frontend (the one this ComfyUI pins), in headless Chromium.

A live server serves the frontend; the page loads a saved (API-format) workflow with a
RingSwap Patch whose VRAM budget makes the plan stream blocks. Checked: the widget's block
count and window from GET /ringswap/plan, the plan changing with the latent size, live
block maps during the run (several distinct states, at most 10 a second), the run's
numbers after it, and the cell colours on a screenshot (saved under out/).
"""
import json
import os
import time
import urllib.parse
import urllib.request

import pytest
import torch

from conftest import COMFY, CUDA, DYNAMIC_VRAM, REPO, SERVER_ARGS
from support import browser
from support.comfy_server import ComfyServer
from support.wan_files import write_tiny_wan
from support.workflows import build_workflow

pytestmark = pytest.mark.server

UNET = "tiny_wan_browser.safetensors"
BLOCKS = 24
STEPS = 12
SMALL, LARGE = (64, 64, 5), (96, 96, 5)   # width, height, frames of the latent
COLORS = {"G": (0x2f, 0xb3, 0x44), "R": (0x2f, 0x7f, 0xf5), "H": (0x6b, 0x72, 0x80)}
OUT = os.path.join(REPO, "out", "browser")


def plan(srv, size, budget=0.0):
    w, h, f = size
    query = urllib.parse.urlencode({"model": UNET, "width": w, "height": h, "frames": f, "vram_budget_gb": budget})
    with urllib.request.urlopen(f"{srv.url}/ringswap/plan?{query}", timeout=60) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = browser.frontend_root(COMFY)
    models = tmp_path_factory.mktemp("models")
    write_tiny_wan(os.path.join(models, "diffusion_models", UNET), dim=128, num_layers=BLOCKS, ffn_dim=256,
                   dtype=torch.float32, seed=5)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with ComfyServer(COMFY, str(models), cpu=not CUDA, extra_args=SERVER_ARGS, env=env, front_end_root=root) as srv:
        for key in ("Comfy.TutorialCompleted",):   # no first-run dialog over the canvas
            req = urllib.request.Request(f"{srv.url}/settings/{key}", data=b"true", method="POST",
                                         headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=10).close()
        yield srv


@pytest.fixture(scope="module")
def budget(server):
    """A budget at which the small latent gets a streaming window and the large one a smaller one."""
    small, large = plan(server, SMALL), plan(server, LARGE)
    block = small["block_bytes_on_device"] / BLOCKS
    gb = (small["nonblock_bytes"] + small["activation_bytes"] + 8.5 * block) / 1e9
    windows = plan(server, SMALL, gb)["window"], plan(server, LARGE, gb)["window"]
    assert large["activation_bytes"] > small["activation_bytes"] + block, (small, large)
    assert BLOCKS > windows[0] > windows[1] >= 1, windows
    return gb, windows


def wait_for(page, js: str, timeout: float = 60.0, what: str = ""):
    deadline = time.monotonic() + timeout
    while True:
        value = page.evaluate(js)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or js}; the widget: {view(page)}")
        time.sleep(0.2)


def view(page, node="2"):
    return page.evaluate("n => JSON.parse(JSON.stringify(window.__ringswap.views()[n] ?? null))", node)


def pixel_check(page, shot_path):
    """Screenshot with the RingSwap node on screen; the colour under the first cell of each state."""
    from PIL import Image
    page.evaluate("""(() => { const n = app.graph.getNodeById(2); app.canvas.ds.scale = 1;
                      app.canvas.centerOnNode(n); app.graph.setDirtyCanvas(true, true); })()""")
    draws = view(page)["draws"]
    wait_for(page, f"(app.graph.setDirtyCanvas(true, true), window.__ringswap.views()['2'].draws > {draws})", 10,
             "a redraw")
    time.sleep(0.3)
    where = page.evaluate("""(() => { const c = app.canvas.canvas, r = c.getBoundingClientRect();
        const cells = window.__ringswap.views()['2'].cells, k = r.width / c.width, out = {};
        for (const [code, p] of Object.entries(cells)) out[code] = [r.left + p.x * k, r.top + p.y * k];
        return out; })()""")
    page.screenshot(path=shot_path)
    img = Image.open(shot_path).convert("RGB")
    return {code: img.getpixel((int(x), int(y))) for code, (x, y) in where.items()}


def close(rgb, want, tol=24):
    return all(abs(a - b) <= tol for a, b in zip(rgb, want))


def test_widget_plan_live_run_and_pixels(server, budget):
    gb, (small_window, large_window) = budget
    os.makedirs(OUT, exist_ok=True)
    tag = os.path.basename(COMFY.rstrip("/")).lstrip(".") + ("-dynamic" if DYNAMIC_VRAM else "")
    w, h, f = SMALL
    wf = build_workflow(UNET, use_patch=True, window=0, prefetch=1, width=w, height=h, length=f, steps=STEPS,
                        filename_prefix="browser_run")
    wf["2"]["inputs"]["vram_budget_gb"] = gb
    saved = os.path.join(OUT, "workflow_api.json")
    with open(saved, "w", encoding="utf-8") as fh:
        json.dump(wf, fh, indent=1)
    with browser.sync_playwright() as pw:
        chromium = browser.launch(pw)
        page = chromium.new_page(viewport={"width": 1400, "height": 900})
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: m.type == "error" and m.text.startswith("RingSwap") and errors.append(m.text))
        page.goto(server.url, timeout=60000)
        wait_for(page, "!!(window.app && window.app.graph && window.__ringswap?.ready)", 90, "the frontend and the extension")
        with open(saved, encoding="utf-8") as fh:
            api = json.load(fh)
        # on a busy machine the frontend may still restore its start-up workflow over the loaded one
        # (seen twice: node 2 never appeared): load it again until its nodes are there
        for attempt in range(4):
            page.evaluate("wf => app.loadApiJson(wf, 'workflow_api.json')", api)
            try:
                wait_for(page, "!!app.graph.getNodeById(2)?.widgets", 20, "the loaded workflow's nodes")
                break
            except AssertionError:
                if attempt == 3:
                    raise
        # a budget of a few MB is below the widget's display precision: typed in as a value
        page.evaluate(f"app.graph.getNodeById(2).widgets.find(w => w.name === 'vram_budget_gb').value = {gb}")
        # before running: the plan for the small latent
        wait_for(page, f"window.__ringswap.views()['2']?.plan?.window === {small_window}", 30,
                 f"the plan for the small latent (window {small_window})")
        v = view(page)
        assert v["plan"]["num_blocks"] == BLOCKS and v["plan"]["window"] == small_window, v["plan"]
        assert len(v["states"]) == BLOCKS and v["states"].count("G") == small_window - 1, v["states"]
        assert any(text.startswith(f"plan: window {small_window}/{BLOCKS}") for text, _ in v["lines"]), v["lines"]
        assert any(text.startswith(f"{BLOCKS} blocks · window {small_window}") for text, _ in v["lines"]), v["lines"]
        colours = pixel_check(page, os.path.join(OUT, f"{tag}-plan.png"))
        assert close(colours["G"], COLORS["G"]) and close(colours["H"], COLORS["H"]), colours
        # the latent gets larger: the plan follows
        seq = v["planSeq"]
        page.evaluate(f"""(() => {{ const n = app.graph.getNodeById(5);
            n.widgets.find(w => w.name === 'width').value = {LARGE[0]};
            n.widgets.find(w => w.name === 'height').value = {LARGE[1]};
            n.widgets.find(w => w.name === 'length').value = {LARGE[2]}; }})()""")
        wait_for(page, f"window.__ringswap.views()['2'].planSeq > {seq}", 30, "the plan after the latent changed")
        assert view(page)["plan"]["window"] == large_window
        page.evaluate(f"""(() => {{ const n = app.graph.getNodeById(5);
            n.widgets.find(w => w.name === 'width').value = {w};
            n.widgets.find(w => w.name === 'height').value = {h};
            n.widgets.find(w => w.name === 'length').value = {f}; }})()""")
        wait_for(page, f"window.__ringswap.views()['2'].plan.window === {small_window}", 30, "the small plan again")
        # the run: live maps, then the numbers
        page.evaluate("app.queuePrompt(0, 1)")
        wait_for(page, "!!window.__ringswap.views()['2'].run", 240, "the run's numbers")
        v = view(page)
        log = v["liveLog"]
        assert len({(m["states"], m["current"]) for m in log}) >= 2, log
        assert all(len(m["states"]) == BLOCKS and set(m["states"]) <= set("GRCHD") for m in log)
        span = log[-1]["sent"] - log[0]["sent"]   # the server's clock: a loaded machine delivers them bunched
        assert len(log) <= 10 * span + 3, (len(log), span)   # 10 a second
        run = v["run"]
        assert run["steps"] == STEPS and run["s_per_step"] > 0 and run["streamed"] == BLOCKS - small_window + 1
        assert run["live_messages"] >= len(log) >= 2 and run["window"] == small_window
        texts = [text for text, _ in v["lines"]]
        assert any(t.startswith("run: ") and "s/step" in t and "hidden" in t and "GB/s" in t and "stall" in t
                   and "ms/block" in t for t in texts), texts
        colours = pixel_check(page, os.path.join(OUT, f"{tag}-after-run.png"))
        assert close(colours["G"], COLORS["G"]), colours
        assert any(close(colours[c], COLORS[c]) for c in ("R", "H") if c in colours), colours
        assert not errors, errors
        chromium.close()
    logged = server.log_text()
    assert f"RingSwap steps: {STEPS} in" in logged and "live block maps sent to the browser" in logged
