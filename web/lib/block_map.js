// RingSwap: the block-map widget drawn on RingSwap nodes (cells by state, window, prefetch,
// live step, after-run numbers, plan). Pure drawing: the state lives in node.ringswap (a view).
export const COLORS = { G: "#2fb344", R: "#2f7ff5", C: "#f5a524", H: "#6b7280", D: "#9b59f5" };
export const NAMES = { G: "on GPU", R: "ring", C: "copying", H: "RAM", D: "disk" };
const CELL = 9, GAP = 1, MARGIN = 8, LINE = 14;

// The states the plan implies before a run: its resident blocks (the plan's indices) on the GPU.
export function plannedStates(blocks, resident, away) {
  if (!blocks || !resident) return "";
  const onGpu = new Set(resident);
  let out = "";
  for (let i = 0; i < blocks; i++) out += onGpu.has(i) ? "G" : away;
  return out;
}

function layout(view, width) {
  const n = view.states.length;
  const cols = Math.max(1, Math.min(n, Math.floor((width - 2 * MARGIN + GAP) / (CELL + GAP))));
  return { n, cols, rows: Math.ceil(n / Math.max(cols, 1)) };
}

export function widgetHeight(view, width) {
  return LINE * view.lines.length + layout(view, width).rows * (CELL + GAP) + 10;
}

export function drawBlockMap(ctx, view, width, y) {
  const { n, cols } = layout(view, width);
  const m = ctx.getTransform(), firstOf = {};
  ctx.save();
  for (let i = 0; i < n; i++) {
    const code = view.states[i], x = MARGIN + (i % cols) * (CELL + GAP), cy = y + 4 + Math.floor(i / cols) * (CELL + GAP);
    ctx.fillStyle = COLORS[code] || "#333";
    ctx.fillRect(x, cy, CELL, CELL);
    if (i === view.current) {
      ctx.strokeStyle = "#ffffff";
      ctx.lineWidth = 1.5;
      ctx.strokeRect(x - 0.5, cy - 0.5, CELL + 1, CELL + 1);
    }
    if (!(code in firstOf)) {   // where the first cell of each state is on the canvas (tests read pixels there)
      const p = m.transformPoint(new DOMPoint(x + CELL / 2, cy + CELL / 2));
      firstOf[code] = { index: i, x: p.x, y: p.y };
    }
  }
  let ty = y + 4 + layout(view, width).rows * (CELL + GAP) + LINE - 3;
  ctx.font = "11px sans-serif";
  for (const [text, color] of view.lines) {
    ctx.fillStyle = color;
    ctx.fillText(text, MARGIN, ty, width - 2 * MARGIN);
    ty += LINE;
  }
  ctx.restore();
  view.cells = firstOf;
  view.draws += 1;
}
