// RingSwap: shows the last sampling run's swap summary on RingSwap nodes.
// The backend sends "ringswap.run" ({line, plan: {line, window, ...}, ...}) over ComfyUI's
// websocket after each run.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const RINGSWAP_NODES = new Set(["RingSwapPatch", "RingSwapModelLoader"]);

function summary(detail) {
  const hidden = detail.copy_ms > 0 ? Math.round((100 * detail.hidden_ms) / detail.copy_ms) : 100;
  const plan = detail.plan ? `window ${detail.plan.window}/${detail.plan.num_blocks} · ` : "";
  if (!detail.streamed) return `${plan}all blocks resident`;
  return `${plan}${detail.streamed} streamed · ${detail.gbps.toFixed(1)} GB/s · ${hidden}% hidden · waited ${Math.round(detail.wait_ms)} ms`;
}

app.registerExtension({
  name: "RingSwap.RunStats",
  setup() {
    api.addEventListener("ringswap.run", ({ detail }) => {
      for (const node of app.graph._nodes) {
        if (RINGSWAP_NODES.has(node.comfyClass)) {
          node.ringswapSummary = summary(detail);
          node.ringswapLine = detail.line;
          node.ringswapPlanLine = detail.plan?.line;
        }
      }
      app.graph.setDirtyCanvas(true, false);
    });
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!RINGSWAP_NODES.has(nodeData.name)) return;
    const onDrawForeground = nodeType.prototype.onDrawForeground;
    nodeType.prototype.onDrawForeground = function (ctx) {
      const r = onDrawForeground?.apply(this, arguments);
      if (this.ringswapSummary && !this.flags?.collapsed) {
        ctx.save();
        ctx.font = "11px sans-serif";
        ctx.fillStyle = "#8fd18f";
        ctx.fillText(this.ringswapSummary, 6, this.size[1] + 14);
        ctx.restore();
      }
      return r;
    };
    const getExtraMenuOptions = nodeType.prototype.getExtraMenuOptions;
    nodeType.prototype.getExtraMenuOptions = function (_, options) {
      getExtraMenuOptions?.apply(this, arguments);
      if (this.ringswapLine) {
        options.push({ content: "Copy last RingSwap run line", callback: () => navigator.clipboard?.writeText(this.ringswapLine) });
      }
      if (this.ringswapPlanLine) {
        options.push({ content: "Copy last RingSwap plan line", callback: () => navigator.clipboard?.writeText(this.ringswapPlanLine) });
      }
    };
  },
});
