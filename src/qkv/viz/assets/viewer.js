// qkv attention viewer. Reads the JSON block #qkv-data written by qkv.viz.viewer.
// Token text is data: every element is built with createElement + textContent, never innerHTML.
// Weights: base64(zlib(uint8)) of shape (layers, heads, T, T), row = query; byte b = b / scale.
"use strict";
(() => {
  const DATA = JSON.parse(document.getElementById("qkv-data").textContent);
  const NL = DATA.layers, NH = DATA.heads, T = DATA.tokens.length;
  const SVG_NS = "http://www.w3.org/2000/svg";
  const LINE_WIDTH = 280; // px between the two token columns
  const THUMB_RES = 128; // thumbnails at most this many pixels a side (max-pooled above that)
  const TOP_K = 5; // how many strongest weights the info line names
  const MAX_OVERVIEW_LINES = 4000; // software-rasterized, 4000 long lines take ~0.3 s

  const state = { layer: 0, head: 0, average: false, words: false, hover: null, pinned: null };
  let bytes = null; // Uint8Array (layers, heads, T, T)
  const cache = new Map(); // "layer:head:level" -> Float32Array (n, n); kept small

  const $ = (id) => document.getElementById(id);
  const view = $("head-view");

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  async function inflate(b64) {
    const binary = atob(b64);
    const packed = new Uint8Array(binary.length);
    for (let i = 0; i < binary.length; i++) packed[i] = binary.charCodeAt(i);
    const stream = new Blob([packed]).stream().pipeThrough(new DecompressionStream("deflate"));
    return new Uint8Array(await new Response(stream).arrayBuffer());
  }

  // ---- the numbers -------------------------------------------------------------------------
  const labels = () => (state.words ? DATA.words : DATA.tokens);
  const headKey = () => (state.average ? "mean" : state.head);

  function tokenMatrix(layer, head) {
    const out = new Float32Array(T * T);
    const base = (layer * NH + head) * T * T;
    for (let i = 0; i < T * T; i++) out[i] = bytes[base + i] / DATA.scale;
    return out;
  }

  // Word a as a query looks the way its pieces look on average; word b as a key receives the
  // sum of its pieces' weights (Inspection.word_attentions).
  const wordOf = new Int32Array(T); // token index -> word index
  DATA.groups.forEach((group, w) => group.forEach((i) => { wordOf[i] = w; }));

  function wordMatrix(tok) {
    const groups = DATA.groups, W = groups.length;
    const keysSummed = new Float32Array(T * W); // (T, W): query token i -> key word b
    for (let i = 0; i < T; i++) {
      for (let j = 0; j < T; j++) keysSummed[i * W + wordOf[j]] += tok[i * T + j];
    }
    const out = new Float32Array(W * W);
    for (let a = 0; a < W; a++) {
      for (const i of groups[a]) {
        for (let b = 0; b < W; b++) out[a * W + b] += keysSummed[i * W + b] / groups[a].length;
      }
    }
    return out;
  }

  function computeMatrix(layer, head, words) {
    if (head === "mean") {
      const maps = [];
      for (let h = 0; h < NH; h++) maps.push(computeMatrix(layer, h, words));
      const out = new Float32Array(maps[0].length);
      for (const m of maps) for (let i = 0; i < out.length; i++) out[i] += m[i] / NH;
      return out;
    }
    const tok = tokenMatrix(layer, head);
    return words ? wordMatrix(tok) : tok;
  }

  function matrix(layer, head, words) {
    const key = `${layer}:${head}:${words ? "words" : "tokens"}`;
    if (!cache.has(key)) {
      if (cache.size >= 8) cache.delete(cache.keys().next().value);
      cache.set(key, computeMatrix(layer, head, words));
    }
    return cache.get(key);
  }

  // ---- head view ---------------------------------------------------------------------------
  let rowHeight = 22;

  function buildColumns() {
    const names = labels(), n = names.length;
    rowHeight = n > 128 ? 14 : 22; // long inputs: denser rows so the page stays scrollable
    view.style.setProperty("--row", `${rowHeight}px`);
    view.style.setProperty("--font", n > 128 ? "11px" : "13px");
    for (const side of ["query", "key"]) {
      const column = $(side === "query" ? "queries" : "keys");
      column.replaceChildren();
      names.forEach((name, index) => {
        const token = el("div", "token", name);
        token.dataset.side = side;
        token.dataset.index = String(index);
        token.title = name;
        token.tabIndex = 0;
        column.append(token);
      });
    }
    const height = n * rowHeight, ratio = window.devicePixelRatio || 1;
    const canvas = $("all-lines"), svg = $("focus-lines");
    $("lines").style.width = `${LINE_WIDTH}px`;
    $("lines").style.height = `${height}px`;
    canvas.width = Math.round(LINE_WIDTH * ratio);
    canvas.height = Math.round(height * ratio);
    canvas.style.width = `${LINE_WIDTH}px`;
    canvas.style.height = `${height}px`;
    svg.setAttribute("width", String(LINE_WIDTH));
    svg.setAttribute("height", String(height));
    svg.setAttribute("viewBox", `0 0 ${LINE_WIDTH} ${height}`);
  }

  const rowY = (i) => (i + 0.5) * rowHeight;

  // The overview: every (query, key) line on a canvas, grouped by weight level. Only the
  // strongest MAX_OVERVIEW_LINES lines are drawn so that a redraw stays quick on long inputs;
  // hovering a token still shows all of its weights.
  function drawAllLines(M, n) {
    const canvas = $("all-lines"), ctx = canvas.getContext("2d");
    const ratio = canvas.width / LINE_WIDTH;
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, LINE_WIDTH, n * rowHeight);
    const levels = Array.from({ length: DATA.scale + 1 }, () => []);
    for (let q = 0; q < n; q++) {
      for (let k = 0; k < n; k++) {
        const level = Math.round(M[q * n + k] * DATA.scale);
        if (level > 0) levels[level].push(q, k);
      }
    }
    let lowest = DATA.scale, kept = levels[lowest].length / 2;
    while (lowest > 1 && kept + levels[lowest - 1].length / 2 <= MAX_OVERVIEW_LINES) {
      lowest -= 1;
      kept += levels[lowest].length / 2;
    }
    ctx.strokeStyle = getComputedStyle(document.documentElement).getPropertyValue("--query").trim();
    ctx.lineWidth = 1.5;
    for (let level = lowest; level <= DATA.scale; level++) {
      const pairs = levels[level];
      ctx.globalAlpha = level / DATA.scale;
      // One path per line: a single path of many crossing lines is far slower to rasterize.
      for (let p = 0; p < pairs.length; p += 2) {
        ctx.beginPath();
        ctx.moveTo(0, rowY(pairs[p]));
        ctx.lineTo(LINE_WIDTH, rowY(pairs[p + 1]));
        ctx.stroke();
      }
    }
    ctx.globalAlpha = 1;
    canvas.dataset.lines = String(kept);
    canvas.dataset.minWeight = (lowest / DATA.scale).toFixed(4);
    $("overview-note").textContent = lowest > 1
      ? `Overview: the ${kept} strongest lines (weight ≥ ${(lowest / DATA.scale).toFixed(3)}); hover a token for all of its weights.`
      : "";
  }

  // The focused token's lines as SVG elements that carry their numbers (data-query, data-key,
  // data-weight); the other column's tokens are shaded by the same weights.
  function drawFocus() {
    const focus = state.hover || state.pinned;
    const names = labels(), n = names.length;
    const M = matrix(state.layer, headKey(), state.words);
    const svg = $("focus-lines");
    svg.replaceChildren();
    document.querySelectorAll(".token").forEach((token) => {
      token.classList.remove("focus", "pinned");
      token.style.backgroundColor = "";
      delete token.dataset.weight;
    });
    $("all-lines").style.opacity = focus ? "0.12" : "1";
    view.dataset.focus = focus ? `${focus.side}:${focus.index}` : "";
    svg.dataset.side = focus ? focus.side : "";
    if (!focus) {
      $("info").textContent = "";
      return;
    }
    const i = focus.index, asQuery = focus.side === "query";
    const other = $(asQuery ? "keys" : "queries").children;
    const weights = [];
    for (let j = 0; j < n; j++) {
      const q = asQuery ? i : j, k = asQuery ? j : i;
      const w = M[q * n + k], shown = w.toFixed(4);
      const line = document.createElementNS(SVG_NS, "line");
      line.setAttribute("x1", "0");
      line.setAttribute("y1", String(rowY(q)));
      line.setAttribute("x2", String(LINE_WIDTH));
      line.setAttribute("y2", String(rowY(k)));
      line.setAttribute("opacity", shown);
      line.dataset.query = String(q);
      line.dataset.key = String(k);
      line.dataset.weight = shown;
      svg.append(line);
      other[j].dataset.weight = shown;
      other[j].style.backgroundColor = `rgba(${asQuery ? "29, 78, 216" : "194, 65, 12"}, ${(0.6 * w).toFixed(3)})`;
      weights.push([w, j]);
    }
    const self = $(asQuery ? "queries" : "keys").children[i];
    self.classList.add("focus");
    if (state.pinned && state.pinned.side === focus.side && state.pinned.index === i) self.classList.add("pinned");
    weights.sort((a, b) => b[0] - a[0]);
    const top = weights.slice(0, TOP_K).map(([w, j]) => `${names[j]} ${w.toFixed(2)}`).join(" · ");
    $("info").textContent = `“${names[i]}” ${asQuery ? "looks at" : "is looked at by"}: ${top}`;
  }

  function renderHead() {
    view.dataset.layer = String(state.layer);
    view.dataset.head = String(headKey());
    view.dataset.level = state.words ? "words" : "tokens";
    const M = matrix(state.layer, headKey(), state.words);
    drawAllLines(M, labels().length);
    drawFocus();
    document.querySelectorAll(".thumb").forEach((thumb) => {
      const selected = Number(thumb.dataset.layer) === state.layer && thumb.dataset.head === String(headKey());
      thumb.classList.toggle("selected", selected);
    });
  }

  // ---- model view --------------------------------------------------------------------------
  function drawThumb(canvas, M, n) {
    const block = Math.ceil(n / THUMB_RES), res = Math.ceil(n / block);
    canvas.width = res;
    canvas.height = res;
    const ctx = canvas.getContext("2d"), image = ctx.createImageData(res, res);
    for (let r = 0; r < res; r++) {
      for (let c = 0; c < res; c++) {
        let w = 0; // max-pool so that one sharp weight stays visible when shrunk
        for (let q = r * block; q < Math.min(n, (r + 1) * block); q++) {
          for (let k = c * block; k < Math.min(n, (c + 1) * block); k++) w = Math.max(w, M[q * n + k]);
        }
        const p = 4 * (r * res + c); // white -> dark blue, linear in the weight
        image.data[p] = Math.round(255 - w * (255 - 8));
        image.data[p + 1] = Math.round(255 - w * (255 - 48));
        image.data[p + 2] = Math.round(255 - w * (255 - 107));
        image.data[p + 3] = 255;
      }
    }
    ctx.putImageData(image, 0, 0);
  }

  function buildThumbs() {
    const grid = $("thumbs");
    grid.replaceChildren();
    grid.style.gridTemplateColumns = `auto repeat(${NH + 1}, auto)`;
    grid.append(el("span", "label", ""));
    for (let h = 0; h < NH; h++) grid.append(el("span", "label", `head ${h}`));
    grid.append(el("span", "label", "mean"));
    for (let l = 0; l < NL; l++) {
      grid.append(el("span", "label", `layer ${l}`));
      for (const h of [...Array(NH).keys(), "mean"]) {
        const thumb = el("canvas", "thumb");
        thumb.dataset.layer = String(l);
        thumb.dataset.head = String(h);
        thumb.title = `layer ${l}, ${h === "mean" ? "mean over heads" : `head ${h}`}`;
        grid.append(thumb);
      }
    }
  }

  function drawThumbs() {
    const n = labels().length, thumbs = $("thumbs");
    for (let l = 0; l < NL; l++) {
      const mean = new Float32Array(n * n);
      for (let h = 0; h < NH; h++) {
        const M = computeMatrix(l, h, state.words);
        for (let i = 0; i < M.length; i++) mean[i] += M[i] / NH;
        drawThumb(thumbs.querySelector(`.thumb[data-layer="${l}"][data-head="${h}"]`), M, n);
      }
      drawThumb(thumbs.querySelector(`.thumb[data-layer="${l}"][data-head="mean"]`), mean, n);
    }
    thumbs.dataset.level = state.words ? "words" : "tokens";
  }

  // ---- controls and events -----------------------------------------------------------------
  function syncControls() {
    $("layer").value = String(state.layer);
    $("head").value = String(state.head);
    $("head").disabled = state.average;
    $("average").checked = state.average;
    $("words").checked = state.words;
  }

  function fillSelect(select, count) {
    for (let i = 0; i < count; i++) select.append(el("option", "", String(i)));
  }

  function tokenOf(event) {
    const token = event.target.closest && event.target.closest(".token");
    return token ? { side: token.dataset.side, index: Number(token.dataset.index) } : null;
  }

  function bindEvents() {
    $("layer").addEventListener("change", () => { state.layer = Number($("layer").value); renderHead(); });
    $("head").addEventListener("change", () => { state.head = Number($("head").value); renderHead(); });
    $("average").addEventListener("change", () => { state.average = $("average").checked; syncControls(); renderHead(); });
    $("words").addEventListener("change", () => {
      state.words = $("words").checked;
      state.hover = state.pinned = null; // indices mean something else at the other level
      buildColumns();
      drawThumbs();
      renderHead();
    });
    for (const column of [$("queries"), $("keys")]) {
      column.addEventListener("mouseover", (event) => {
        const token = tokenOf(event);
        if (token) { state.hover = token; drawFocus(); }
      });
      column.addEventListener("mouseleave", () => { state.hover = null; drawFocus(); });
      column.addEventListener("focusin", (event) => { state.hover = tokenOf(event); drawFocus(); });
      column.addEventListener("focusout", () => { state.hover = null; drawFocus(); });
      column.addEventListener("click", (event) => {
        const token = tokenOf(event);
        if (!token) return;
        const same = state.pinned && state.pinned.side === token.side && state.pinned.index === token.index;
        state.pinned = same ? null : token;
        drawFocus();
      });
    }
    $("thumbs").addEventListener("click", (event) => {
      const thumb = event.target.closest(".thumb");
      if (!thumb) return;
      state.layer = Number(thumb.dataset.layer);
      state.average = thumb.dataset.head === "mean";
      if (!state.average) state.head = Number(thumb.dataset.head);
      syncControls();
      renderHead();
      view.scrollIntoView({ block: "start" });
    });
  }

  async function main() {
    const status = $("status");
    try {
      bytes = await inflate(DATA.weights);
      if (bytes.length !== NL * NH * T * T) throw new Error(`expected ${NL * NH * T * T} weights, got ${bytes.length}`);
    } catch (error) {
      status.textContent = `Could not read the attention data: ${error.message}`;
      status.className = "error";
      return;
    }
    const model = DATA.model ? `${DATA.model} · ` : "";
    $("meta").textContent = `${model}${T} tokens, ${DATA.words.length} words · ${NL} layers × ${NH} heads`;
    $("text").textContent = DATA.text;
    document.title = `qkv · ${DATA.text.slice(0, 60)}`;
    fillSelect($("layer"), NL);
    fillSelect($("head"), NH);
    syncControls();
    buildColumns();
    buildThumbs();
    drawThumbs();
    bindEvents();
    renderHead();
    status.textContent = "";
    document.body.dataset.ready = "true";
  }

  main();
})();
