// RingSwap: a block map on RingSwap nodes. Before a run it shows the plan (GET /ringswap/plan
// for the node's model, latent size and widgets); during sampling it follows the server's
// "ringswap.live" messages (at most 10 a second, sent only to browsers that POST /ringswap/live);
// after a run it shows the "ringswap.run" numbers. window.__ringswap.views holds each node's view.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { drawBlockMap, plannedStates, widgetHeight } from "./lib/block_map.js";

const RINGSWAP_NODES = new Set(["RingSwapPatch", "RingSwapModelLoader"]);
window.__ringswap = {   // for tests and the console: each RingSwap node's view, by node id
  views: () => Object.fromEntries(graphNodes().filter((n) => n.ringswap).map((n) => [String(n.id), n.ringswap])),
};
const GB = 1e9, fmt = (x, d = 2) => (x ?? 0).toFixed(d);

function graphNodes() { return app.graph?.nodes ?? app.graph?._nodes ?? []; }
function widget(node, name) { return node?.widgets?.find((w) => w.name === name)?.value; }
function inputNode(node, name) {
  const slot = node?.inputs?.findIndex((i) => i.name === name) ?? -1;
  return slot >= 0 ? node.getInputNode(slot) : null;
}
function away(node) { return widget(node, "home") === "disk" ? "D" : "H"; }

function modelName(node) {   // the loader's own file, or the one of the loader upstream of a Patch
  for (let n = node, depth = 0; n && depth < 8; n = inputNode(n, "model"), depth++) {
    const name = widget(n, "unet_name");
    if (name) return name;
  }
  return null;
}

function downstream(node, found) {   // the first node fed (within 5 links) by `node` for which found(n) is set
  let frontier = [node];
  for (let depth = 0; depth < 5 && frontier.length; depth++) {
    const next = [];
    for (const n of frontier) {
      for (let slot = 0; slot < (n.outputs?.length ?? 0); slot++) next.push(...(n.getOutputNodes(slot) ?? []));
    }
    for (const n of next) {
      const hit = found(n);
      if (hit) return hit;
    }
    frontier = next;
  }
  return null;
}

function latentNode(node) {   // the latent feeding a sampler downstream, else any latent-size node
  const sized = (n) => n && widget(n, "width") !== undefined && widget(n, "height") !== undefined;
  const fromSampler = (n) => {
    for (let up = inputNode(n, "latent_image"), d = 0; up && d < 4; up = inputNode(up, "samples"), d++) {
      if (sized(up)) return up;
    }
    return null;
  };
  return downstream(node, fromSampler) ?? graphNodes().find(sized) ?? null;
}

function condsPerStep(node) {   // cond + uncond, unless the sampler's cfg is 1 (ComfyUI then skips the uncond)
  const sampler = downstream(node, (n) => (widget(n, "cfg") !== undefined ? n : null));
  return sampler && widget(sampler, "cfg") !== 1 ? 2 : 1;
}

function planQuery(node) {
  const model = modelName(node), latent = latentNode(node);
  if (!model || !latent) return null;
  return { model, width: widget(latent, "width"), height: widget(latent, "height"), frames: widget(latent, "length") ?? 1,
           batch: widget(latent, "batch_size") ?? 1, window: widget(node, "window") ?? 0,
           prefetch: widget(node, "prefetch") ?? 1, vram_budget_gb: widget(node, "vram_budget_gb") ?? 0,
           conds: condsPerStep(node), home: widget(node, "home") ?? "ram",   // Patch has no home widget: its blocks are in RAM
           compress: widget(node, "compress") ?? "auto" };
}

function planLine(p) {
  if (!p) return ["plan: connect a model and a latent", "#999"];
  if (p.error) return [`plan: ${p.error}`, "#f08080"];
  const bound = !p.streamed ? "all resident" : p.bound === "unknown" ? "copy rate not measured yet" : p.bound;
  return [`plan: window ${p.window}/${p.num_blocks} · ${fmt((p.block_bytes_on_device + p.nonblock_bytes) / GB)} GB on GPU`
          + ` · ${fmt((p.streamed_bytes * (p.calls_per_step ?? 1)) / GB)} GB/step`
          + (p.conds_per_step > 1 ? (p.batched ? " · conds batched" : ` · ${p.calls_per_step} calls/step`) : "")
          + ` · ${bound}`, "#c8c8ff"];
}

function runLine(r) {
  if (!r) return null;
  const hidden = r.copy_ms > 0 ? Math.round((100 * r.hidden_ms) / r.copy_ms) : 100;
  return [`run: ${fmt(r.s_per_step, 3)} s/step · ${hidden}% hidden · ${fmt(r.gbps, 1)} GB/s · stall ${Math.round(r.wait_ms)} ms`
          + ` · fold ${fmt(r.fold_ms_per_block)} ms/block`, "#8fd18f"];
}

function mapLine(v) {
  const l = v.live, p = v.plan && !v.plan.error ? v.plan : null;
  const blocks = l?.blocks ?? p?.num_blocks, windowSize = l?.window ?? p?.window, prefetch = l?.prefetch ?? p?.prefetch;
  if (!blocks) return ["RingSwap: no plan yet", "#999"];
  const step = l && l.steps ? ` · step ${l.step + 1}/${l.steps}` : "";
  return [`${blocks} blocks · window ${windowSize} · prefetch ${prefetch}${step}${l ? ` · ${l.calls} calls · ${l.copies} copies` : ""}`, "#ddd"];
}

function refresh(node) {
  const v = node.ringswap;
  if (!v.live && v.plan && !v.plan.error) v.states = plannedStates(v.plan.num_blocks, v.plan.resident_blocks, away(node));
  v.lines = [mapLine(v), runLine(v.run), planLine(v.plan)].filter(Boolean);
  const want = node.computeSize?.()[1];
  if (want && node.size[1] < want) node.setSize([node.size[0], want]);
  app.graph?.setDirtyCanvas(true, true);
}

async function updatePlan(node) {
  const q = planQuery(node), key = JSON.stringify(q), v = node.ringswap;
  if (key === v.planKey) return;
  v.planKey = key;
  if (!q) { v.plan = null; refresh(node); return; }
  try {
    const r = await api.fetchApi("/ringswap/plan?" + new URLSearchParams(q));
    const plan = await r.json();
    if (v.planKey !== key) return;
    v.plan = plan;
  } catch (e) {
    v.plan = { error: String(e) };
  }
  v.planSeq += 1;
  refresh(node);
}

let subscribed = null;
function subscribe() {   // ask for live maps for this page's websocket client id
  const id = api.clientId ?? sessionStorage.getItem("clientId");
  if (!id || id === subscribed) return;
  subscribed = id;
  api.fetchApi("/ringswap/live", { method: "POST", headers: { "Content-Type": "application/json" },
                                   body: JSON.stringify({ client_id: id }) }).catch(() => { subscribed = null; });
}

function targets(detail) {
  return graphNodes().filter((n) => n.ringswap && (detail.node == null || String(n.id) === String(detail.node)));
}

app.registerExtension({
  name: "RingSwap.BlockMap",
  setup() {
    window.__ringswap.ready = true;
    api.addEventListener("status", subscribe);
    api.addEventListener("reconnected", () => { subscribed = null; subscribe(); });
    api.addEventListener("ringswap.live", ({ detail }) => {
      for (const node of targets(detail)) {
        const v = node.ringswap;
        v.live = detail;
        v.states = detail.states;
        v.current = detail.current;
        v.liveLog.push({ t: Date.now(), sent: detail.elapsed_s, states: detail.states, current: detail.current, step: detail.step, calls: detail.calls });
        if (v.liveLog.length > 1000) v.liveLog.shift();
        refresh(node);
      }
    });
    api.addEventListener("ringswap.run", ({ detail }) => {
      for (const node of targets(detail)) {
        Object.assign(node.ringswap, { run: detail, current: -1, runLine: detail.line, planLine: detail.plan?.line });
        refresh(node);
      }
    });
    setInterval(() => {
      subscribe();
      for (const node of graphNodes()) {
        if (node.ringswap) updatePlan(node).catch((e) => console.error("RingSwap plan:", e));
      }
    }, 1000);
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!RINGSWAP_NODES.has(nodeData.name)) return;
    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const r = onNodeCreated?.apply(this, arguments);
      const node = this;
      node.ringswap = { states: "", current: -1, lines: [], plan: null, planKey: null, planSeq: 0, live: null,
                        liveLog: [], run: null, cells: {}, draws: 0 };
      node.addCustomWidget({
        name: "ringswap_map", type: "ringswap_map", value: "", serialize: false, options: { serialize: false },
        draw(ctx, n, width, y) { drawBlockMap(ctx, node.ringswap, width, y); },
        computeSize(width) { return [width, widgetHeight(node.ringswap, width ?? node.size[0])]; },
      });
      refresh(node);
      return r;
    };
    const getExtraMenuOptions = nodeType.prototype.getExtraMenuOptions;
    nodeType.prototype.getExtraMenuOptions = function (_, options) {
      getExtraMenuOptions?.apply(this, arguments);
      const v = this.ringswap;
      if (v?.runLine) options.push({ content: "Copy last RingSwap run line", callback: () => navigator.clipboard?.writeText(v.runLine) });
      if (v?.planLine) options.push({ content: "Copy last RingSwap plan line", callback: () => navigator.clipboard?.writeText(v.planLine) });
    };
  },
});
