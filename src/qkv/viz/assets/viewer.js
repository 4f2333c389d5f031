// qkv attention viewer. Reads the JSON block #qkv-data written by qkv.viz.viewer.
// Token text is data: every element is built with createElement + textContent, never innerHTML.
// Weights: base64(zlib(uint8)) of shape (layers, heads, T, T), row = query; byte b = b / scale;
// or, for long inputs, each row's top-k weights exactly (float32) with their key indices.
"use strict";
(() => {
  const DATA = JSON.parse(document.getElementById("qkv-data").textContent);
  const NL = DATA.layers, NH = DATA.heads;
  const SVG_NS = "http://www.w3.org/2000/svg";
  const LINE_WIDTH = 280; // px between the two token columns, where the window has room
  const MIN_LINE_WIDTH = 60; // ... and at least this on a narrow screen (a phone: 420 px)
  const PANE_GAP = 32; // #panes' gap in viewer.css
  const THUMB_RES = 128; // thumbnails at most this many pixels a side (max-pooled above that)
  const TOP_K = 5; // how many strongest weights the info line names
  // The overview is rasterized in software at the next paint, at a cost that grows with the
  // number of lines and their length: 4000 lines over a 512-token column (7 000 px) took 0.46 s
  // per head switch, 1000 lines 0.09 s (Chromium, --disable-gpu). Short inputs draw them all.
  const MAX_OVERVIEW_LINES = 4000;
  const MAX_OVERVIEW_LINES_LONG = 1000; // past LONG_INPUT rows
  const LONG_INPUT = 128;
  const LARGEST_EXPONENT = 700; // as qkv.inspect_steps: shift a row whose exp would overflow
  const DIFF_TOP = 8; // how many of the largest differences the difference view lists
  const DIFF_LABELS = 40; // up to this many shared words, each gets its label on both axes
  const ROLE_COLOURS = { // qkv.viz.roles.ROLE_COLOURS
    previous: "#1d4ed8", next: "#0891b2", self: "#7c3aed", cls: "#c2410c",
    sep: "#ca8a04", punctuation: "#15803d", rest: "#9ca3af",
  };
  const ROLE_TEXT = {
    previous: "the previous token", next: "the next token", self: "itself", cls: "[CLS]",
    sep: "[SEP]", punctuation: "punctuation", rest: "the other tokens",
  };

  const start = DATA.start || { layer: 0, head: 0 };
  const state = { layer: start.layer, head: start.head, average: false, words: false, mode: "attention", roles: false };
  const $ = (id) => document.getElementById(id);
  const view = $("head-view");

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function bytesOf(b64) {
    const binary = atob(b64);
    const out = new Uint8Array(binary.length);
    for (let i = 0; i < binary.length; i++) out[i] = binary.charCodeAt(i);
    return out;
  }

  async function inflate(b64) {
    const stream = new Blob([bytesOf(b64)]).stream().pipeThrough(new DecompressionStream("deflate"));
    return new Uint8Array(await new Response(stream).arrayBuffer());
  }

  const headKey = () => (state.mode === "rollout" ? "rollout" : state.average ? "mean" : state.head);

  // ---- one text: its numbers ----------------------------------------------------------------
  class Pane {
    constructor(data, suffix) {
      this.data = data;
      this.suffix = suffix; // "" for the first text, "-b" for the compared one
      this.T = data.tokens.length;
      this.cache = new Map(); // "layer:head:level" -> Float32Array (n, n); kept small
      this.hover = null;
      this.pinned = null;
      this.wordOf = new Int32Array(this.T); // token index -> word index
      data.groups.forEach((group, w) => group.forEach((i) => { this.wordOf[i] = w; }));
      this.projections = null; // decoded on the first steps panel
    }

    async load() {
      const d = this.data, T = this.T;
      if (d.weights !== null) {
        this.bytes = await inflate(d.weights);
        if (this.bytes.length !== NL * NH * T * T) throw new Error(`expected ${NL * NH * T * T} weights, got ${this.bytes.length}`);
      } else {
        const k = d.sparse.k;
        this.topIndices = new Int32Array((await inflate(d.sparse.indices)).buffer);
        this.topValues = new Float32Array((await inflate(d.sparse.values)).buffer);
        if (this.topValues.length !== NL * NH * T * k) throw new Error(`expected ${NL * NH * T * k} top weights, got ${this.topValues.length}`);
      }
      this.rollout = d.rollout === null ? null : await inflate(d.rollout);
      // (layers, T, T) 0 / 1: which keys each query may see (a decoder's triangle, a window)
      this.allowed = d.projections && d.projections.allowed ? await inflate(d.projections.allowed) : null;
    }

    labels() { return state.words ? this.data.words : this.data.tokens; }

    tokenMatrix(layer, head) {
      const T = this.T, out = new Float32Array(T * T);
      if (head === "rollout") {
        const base = layer * T * T;
        for (let i = 0; i < T * T; i++) out[i] = this.rollout[base + i] / this.data.scale;
      } else if (this.bytes) {
        const base = (layer * NH + head) * T * T;
        for (let i = 0; i < T * T; i++) out[i] = this.bytes[base + i] / this.data.scale;
      } else {
        const k = this.data.sparse.k, base = (layer * NH + head) * T * k;
        for (let q = 0; q < T; q++) {
          for (let r = 0; r < k; r++) out[q * T + this.topIndices[base + q * k + r]] = this.topValues[base + q * k + r];
        }
      }
      return out;
    }

    // Word a as a query looks the way its pieces look on average; word b as a key receives the
    // sum of its pieces' weights (Inspection.word_attentions).
    wordMatrix(tok) {
      const groups = this.data.groups, W = groups.length, T = this.T;
      const keysSummed = new Float32Array(T * W); // (T, W): query token i -> key word b
      for (let i = 0; i < T; i++) {
        for (let j = 0; j < T; j++) keysSummed[i * W + this.wordOf[j]] += tok[i * T + j];
      }
      const out = new Float32Array(W * W);
      for (let a = 0; a < W; a++) {
        for (const i of groups[a]) {
          for (let b = 0; b < W; b++) out[a * W + b] += keysSummed[i * W + b] / groups[a].length;
        }
      }
      return out;
    }

    computeMatrix(layer, head, words) {
      if (head === "mean") {
        let out = null;
        for (let h = 0; h < NH; h++) {
          const m = this.computeMatrix(layer, h, words);
          if (out === null) out = new Float32Array(m.length);
          for (let i = 0; i < out.length; i++) out[i] += m[i] / NH;
        }
        return out;
      }
      const tok = this.tokenMatrix(layer, head);
      return words ? this.wordMatrix(tok) : tok;
    }

    matrix(layer, head, words) {
      const key = `${layer}:${head}:${words ? "words" : "tokens"}`;
      if (!this.cache.has(key)) {
        if (this.cache.size >= (this.bytes ? 8 : 2)) this.cache.delete(this.cache.keys().next().value);
        this.cache.set(key, this.computeMatrix(layer, head, words));
      }
      return this.cache.get(key);
    }

    // The four steps of (layer, head) for one query row, in float64 from the stored float32
    // q and k, as Inspection.steps computes them; null when the file holds no projections.
    steps(layer, head, query) {
      const p = this.data.projections;
      if (p === null) return null;
      if (this.projections === null) {
        this.projections = {
          q: new Float32Array(bytesOf(p.q).buffer),
          k: new Float32Array(bytesOf(p.k).buffer),
          vnorm: new Float32Array(bytesOf(p.vnorm).buffer),
        };
      }
      const { q, k, vnorm } = this.projections, T = this.T, E = p.E;
      const qBase = ((layer * NH + head) * T + query) * E, kBase = (layer * NH + head) * T * E;
      const scores = new Float64Array(T), scaled = new Float64Array(T), exps = new Float64Array(T);
      const rowBase = (layer * T + query) * T;
      const visible = (j) => this.allowed === null || this.allowed[rowBase + j] === 1;
      let top = -Infinity;
      for (let j = 0; j < T; j++) {
        let dot = 0;
        for (let e = 0; e < E; e++) dot += q[qBase + e] * k[kBase + j * E + e];
        scores[j] = dot;
        scaled[j] = dot * p.scale;
        if (visible(j)) top = Math.max(top, scaled[j]);
      }
      const shift = top > LARGEST_EXPONENT ? top : 0;
      let total = 0;
      for (let j = 0; j < T; j++) { exps[j] = visible(j) ? Math.exp(scaled[j] - shift) : 0; total += exps[j]; }
      const weights = exps.map((x) => x / total);
      const contributions = weights.map((w, j) => w * vnorm[(layer * NH + head) * T + j]);
      const contributionSum = contributions.reduce((a, b) => a + b, 0);
      return { scores, scaled, exps, total, shift, weights, contributions, contributionSum, E, scale: p.scale, visible };
    }
  }

  const texts = [new Pane(DATA, "")];
  if (DATA.compare) texts.push(new Pane(DATA.compare, "-b"));
  const id = (text, name) => $(name + text.suffix);

  // ---- head view, one pane per text ---------------------------------------------------------
  let rowHeight = 22;
  let lineWidth = LINE_WIDTH;

  // The room between the token columns: LINE_WIDTH, less where the window is too narrow for
  // both columns (two panes share a wide window; on a narrow one they stack, see viewer.css).
  function fitLineWidth(text) {
    const room = $("panes").clientWidth;
    const stacked = getComputedStyle($("panes")).flexWrap === "wrap";
    const perPane = texts.length > 1 && !stacked ? (room - PANE_GAP) / 2 : room;
    const columns = id(text, "queries").offsetWidth + id(text, "keys").offsetWidth;
    return Math.floor(Math.max(MIN_LINE_WIDTH, Math.min(LINE_WIDTH, perPane - columns)));
  }

  function buildPanes() {
    if (texts.length > 1) {
      const second = $("pane-a").cloneNode(true);
      second.id = "pane-b";
      second.querySelectorAll("[id]").forEach((node) => { node.id += "-b"; });
      $("panes").append(second);
      id(texts[0], "pane-title").textContent = `A: ${DATA.text}`;
      id(texts[1], "pane-title").textContent = `B: ${DATA.compare.text}`;
    }
  }

  function buildColumns() {
    const longest = Math.max(...texts.map((t) => t.labels().length));
    rowHeight = longest > LONG_INPUT ? 14 : 22; // long inputs: denser rows so the page stays scrollable
    view.style.setProperty("--row", `${rowHeight}px`);
    view.style.setProperty("--font", longest > LONG_INPUT ? "11px" : "13px");
    for (const text of texts) {
      const names = text.labels(), n = names.length;
      for (const side of ["query", "key"]) {
        const column = id(text, side === "query" ? "queries" : "keys");
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
      lineWidth = fitLineWidth(text);
      const height = n * rowHeight, ratio = window.devicePixelRatio || 1;
      const canvas = id(text, "all-lines"), svg = id(text, "focus-lines");
      id(text, "lines").style.width = `${lineWidth}px`;
      id(text, "lines").style.height = `${height}px`;
      canvas.width = Math.round(lineWidth * ratio);
      canvas.height = Math.round(height * ratio);
      canvas.style.width = `${lineWidth}px`;
      canvas.style.height = `${height}px`;
      svg.setAttribute("width", String(lineWidth));
      svg.setAttribute("height", String(height));
      svg.setAttribute("viewBox", `0 0 ${lineWidth} ${height}`);
    }
  }

  const rowY = (i) => (i + 0.5) * rowHeight;

  // The overview: every (query, key) line on a canvas, grouped by weight level. Only the
  // strongest MAX_OVERVIEW_LINES lines are drawn so that a redraw stays quick on long inputs;
  // hovering a token still shows all of its weights.
  function drawAllLines(text, M, n) {
    const canvas = id(text, "all-lines"), ctx = canvas.getContext("2d");
    const scale = text.data.scale;
    const ratio = canvas.width / lineWidth;
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, lineWidth, n * rowHeight);
    const levels = Array.from({ length: scale + 1 }, () => []);
    for (let q = 0; q < n; q++) {
      for (let k = 0; k < n; k++) {
        const level = Math.round(M[q * n + k] * scale);
        if (level > 0) levels[level].push(q, k);
      }
    }
    let lowest = scale, kept = levels[lowest].length / 2;
    const cap = n > LONG_INPUT ? MAX_OVERVIEW_LINES_LONG : MAX_OVERVIEW_LINES;
    while (lowest > 1 && kept + levels[lowest - 1].length / 2 <= cap) {
      lowest -= 1;
      kept += levels[lowest].length / 2;
    }
    ctx.strokeStyle = getComputedStyle(document.documentElement).getPropertyValue("--query").trim();
    ctx.lineWidth = 1.5;
    for (let level = lowest; level <= scale; level++) {
      const pairs = levels[level];
      ctx.globalAlpha = level / scale;
      // One path per line: a single path of many crossing lines is far slower to rasterize.
      for (let p = 0; p < pairs.length; p += 2) {
        ctx.beginPath();
        ctx.moveTo(0, rowY(pairs[p]));
        ctx.lineTo(lineWidth, rowY(pairs[p + 1]));
        ctx.stroke();
      }
    }
    ctx.globalAlpha = 1;
    canvas.dataset.lines = String(kept);
    canvas.dataset.minWeight = (lowest / scale).toFixed(4);
    if (text.suffix === "") {
      $("overview-note").textContent = lowest > 1
        ? `Overview: the ${kept} strongest lines (weight ≥ ${(lowest / scale).toFixed(3)}); hover a token for all of its weights.`
        : "";
    }
  }

  // The focused token's lines as SVG elements that carry their numbers (data-query, data-key,
  // data-weight); the other column's tokens are shaded by the same weights.
  function drawFocus(text) {
    const focus = text.hover || text.pinned;
    const names = text.labels(), n = names.length;
    const M = text.matrix(state.layer, headKey(), state.words);
    const svg = id(text, "focus-lines");
    svg.replaceChildren();
    id(text, "columns").querySelectorAll(".token").forEach((token) => {
      token.classList.remove("focus", "pinned");
      token.style.backgroundColor = "";
      delete token.dataset.weight;
    });
    id(text, "all-lines").style.opacity = focus ? "0.12" : "1";
    if (text.suffix === "") view.dataset.focus = focus ? `${focus.side}:${focus.index}` : "";
    svg.dataset.side = focus ? focus.side : "";
    if (!focus) {
      id(text, "info").textContent = "";
      return;
    }
    const i = focus.index, asQuery = focus.side === "query";
    const other = id(text, asQuery ? "keys" : "queries").children;
    const weights = [];
    for (let j = 0; j < n; j++) {
      const q = asQuery ? i : j, k = asQuery ? j : i;
      const w = M[q * n + k], shown = w.toFixed(4);
      const line = document.createElementNS(SVG_NS, "line");
      line.setAttribute("x1", "0");
      line.setAttribute("y1", String(rowY(q)));
      line.setAttribute("x2", String(lineWidth));
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
    const self = id(text, asQuery ? "queries" : "keys").children[i];
    self.classList.add("focus");
    if (text.pinned && text.pinned.side === focus.side && text.pinned.index === i) self.classList.add("pinned");
    weights.sort((a, b) => b[0] - a[0]);
    const top = weights.slice(0, TOP_K).map(([w, j]) => `${names[j]} ${w.toFixed(2)}`).join(" · ");
    id(text, "info").textContent = `“${names[i]}” ${asQuery ? "looks at" : "is looked at by"}: ${top}`;
  }

  // ---- the steps panel ----------------------------------------------------------------------
  const fmt = (x, digits = 4) => (Math.abs(x) >= 1e5 || (x !== 0 && Math.abs(x) < 1e-3) ? x.toExponential(3) : x.toFixed(digits));

  const STEPS_HINT = $("steps").textContent;

  // Back to the hint: the numbers shown belong to a selection that just changed.
  function clearSteps() {
    const panel = $("steps");
    for (const name of Object.keys(panel.dataset)) delete panel.dataset[name];
    panel.textContent = STEPS_HINT;
    document.querySelectorAll(".token.chosen").forEach((t) => t.classList.remove("chosen"));
  }

  function showSteps(text, query, key) {
    const panel = $("steps");
    panel.replaceChildren();
    document.querySelectorAll(".token.chosen").forEach((t) => t.classList.remove("chosen"));
    const tokens = text.data.tokens, which = texts.length > 1 ? (text.suffix ? "B: " : "A: ") : "";
    for (const name of ["query", "key", "layer", "head", "score", "scaled", "exp", "total", "weight", "contribution"]) delete panel.dataset[name];
    const refuse = (message) => { panel.append(el("div", "", message)); panel.dataset.state = "refused"; };
    if (state.words || state.mode === "rollout" || state.average) {
      refuse("Steps are per token and per head: switch off words, average and rollout to see them.");
      return;
    }
    const s = text.steps(state.layer, state.head, query);
    if (s === null) {
      refuse("This file holds no per-head q and k (too long, or the model gave none); `qkv inspect TEXT --token WORD --steps` prints them.");
      return;
    }
    const j = key, E = s.E;
    const scaleText = Math.abs(s.scale - 1 / Math.sqrt(E)) < 1e-9 * s.scale ? `/ √${E}` : `× ${s.scale}`;
    Object.assign(panel.dataset, {
      state: "shown", query: String(query), key: String(key), layer: String(state.layer), head: String(state.head),
      score: String(s.scores[j]), scaled: String(s.scaled[j]), exp: String(s.exps[j]), total: String(s.total),
      weight: String(s.weights[j]), contribution: String(s.contributions[j]),
    });
    const shift = s.shift ? ` − ${fmt(s.shift)}` : "";
    const lines = [
      `${which}layer ${state.layer} head ${state.head}: query ${query} “${tokens[query]}” → key ${key} “${tokens[key]}”`,
      `1. score  q·k = ${fmt(s.scores[j])}`,
      `2. scaled ${scaleText}: ${fmt(s.scaled[j])}`,
      s.visible(j)
        ? `3. exp(${fmt(s.scaled[j])}${shift}) = ${fmt(s.exps[j])}   row total Σ exp = ${fmt(s.total)}`
        : `3. the model's mask hides this key from this query: exp = 0   row total Σ exp = ${fmt(s.total)}`,
      `   softmax share = ${fmt(s.exps[j])} / ${fmt(s.total)} = ${fmt(s.weights[j])}`,
      `4. the value's contribution weight × v: length ${fmt(s.contributions[j])} (${(100 * s.contributions[j] / s.contributionSum).toFixed(1)}% of the row's contributions)`,
    ];
    for (const line of lines) panel.append(el("div", "", line));
    const keyToken = id(text, "keys").children[key];
    if (keyToken) keyToken.classList.add("chosen");
  }

  // ---- difference view (compare mode) -------------------------------------------------------
  function buildAlignment() {
    const box = $("alignment"), [a, b] = texts, pairs = DATA.alignment;
    box.replaceChildren();
    let i = 0, j = 0;
    const column = (top, bottom, matched) => {
      box.append(el("span", matched ? "matched" : top === "" ? "" : "only", top));
      box.append(el("span", matched ? "matched" : bottom === "" ? "" : "only", bottom));
    };
    for (const [pi, pj] of [...pairs, [a.data.words.length, b.data.words.length]]) {
      for (; i < pi; i++) column(a.data.words[i], "", false);
      for (; j < pj; j++) column("", b.data.words[j], false);
      if (pi < a.data.words.length) { column(a.data.words[pi], b.data.words[pj], true); i = pi + 1; j = pj + 1; }
    }
  }

  function drawDiff() {
    const [a, b] = texts, pairs = DATA.alignment, P = pairs.length;
    const A = a.matrix(state.layer, headKey(), true), B = b.matrix(state.layer, headKey(), true);
    const WA = a.data.words.length, WB = b.data.words.length;
    const canvas = $("diff-map"), ctx = canvas.getContext("2d");
    canvas.width = Math.max(P, 1);
    canvas.height = Math.max(P, 1);
    const image = ctx.createImageData(canvas.width, canvas.height), found = [];
    let largest = 0;
    for (let r = 0; r < P; r++) {
      for (let c = 0; c < P; c++) {
        const wa = A[pairs[r][0] * WA + pairs[c][0]], wb = B[pairs[r][1] * WB + pairs[c][1]];
        found.push([Math.abs(wa - wb), r, c, wa, wb]);
        largest = Math.max(largest, Math.abs(wa - wb));
      }
    }
    for (const [, r, c, wa, wb] of found) {
      {
        const d = wa - wb; // the colour scale ends at the largest difference shown
        const t = largest > 0 ? Math.abs(d) / largest : 0, p = 4 * (r * P + c); // orange for A > B, blue for B > A
        const [R, G, Bl] = d >= 0 ? [194, 65, 12] : [29, 78, 216];
        image.data[p] = Math.round(255 - t * (255 - R));
        image.data[p + 1] = Math.round(255 - t * (255 - G));
        image.data[p + 2] = Math.round(255 - t * (255 - Bl));
        image.data[p + 3] = 255;
      }
    }
    ctx.putImageData(image, 0, 0);
    canvas.dataset.largest = largest.toFixed(4);
    // the axes: one label per shared word, text A's spelling, in the matrix's order; past
    // DIFF_LABELS words the labels would be too small to read and only the axis title stays
    for (const [axis, name] of [["diff-keys", "key"], ["diff-queries", "query"]]) {
      const box = $(axis);
      box.replaceChildren();
      const labelled = P <= DIFF_LABELS, cells = `repeat(${Math.max(P, 1)}, minmax(0, 1fr))`;
      box.style.gridTemplateColumns = labelled && axis === "diff-keys" ? cells : "";
      box.style.gridTemplateRows = labelled && axis === "diff-queries" ? cells : "";
      if (!labelled) {
        box.append(el("span", "title", `${name} words ${axis === "diff-keys" ? "→" : "↓"} (${P}, text order)`));
        continue;
      }
      for (const [wordA] of pairs) {
        const label = el("span", "", a.data.words[wordA]);
        label.title = a.data.words[wordA];
        box.append(label);
      }
    }
    $("diff-scale").textContent = `Rows: query words, columns: key words, both in text order (${P} shared words). Full colour = a difference of ${largest.toFixed(3)}, the largest here.`;
    found.sort((x, y) => y[0] - x[0]);
    const list = $("diff-top");
    list.replaceChildren();
    for (const [, r, c, wa, wb] of found.slice(0, DIFF_TOP)) {
      const item = el("li", "", `“${a.data.words[pairs[r][0]]}” → “${a.data.words[pairs[c][0]]}”: A ${wa.toFixed(3)}, B ${wb.toFixed(3)} (${wa - wb >= 0 ? "+" : ""}${(wa - wb).toFixed(3)})`);
      Object.assign(item.dataset, { query: String(r), key: String(c), a: wa.toFixed(4), b: wb.toFixed(4) });
      list.append(item);
    }
    $("diff-view").dataset.layer = String(state.layer);
    $("diff-view").dataset.head = String(headKey());
  }

  function renderHead() {
    view.dataset.layer = String(state.layer);
    view.dataset.head = String(headKey());
    view.dataset.level = state.words ? "words" : "tokens";
    for (const text of texts) {
      drawAllLines(text, text.matrix(state.layer, headKey(), state.words), text.labels().length);
      drawFocus(text);
    }
    if (texts.length > 1) drawDiff();
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
    const grid = $("thumbs"), roles = DATA.roles;
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
        thumb.title = h === "mean" ? `layer ${l}, mean over heads`
          : `layer ${l}, head ${h}: ${(100 * roles.share[l][h]).toFixed(0)}% to ${ROLE_TEXT[roles.dominant[l][h]]}`;
        if (h !== "mean") thumb.dataset.role = roles.dominant[l][h];
        grid.append(thumb);
      }
    }
    const legend = $("role-legend");
    legend.replaceChildren(el("span", "", "Border colour: the role that gets most of a head's attention in this text:"));
    for (const name of roles.names) {
      const swatch = el("span", "swatch");
      swatch.style.backgroundColor = ROLE_COLOURS[name];
      legend.append(swatch, el("span", "", ROLE_TEXT[name]));
    }
    legend.style.visibility = "hidden"; // shown with the roles switch, its room kept
  }

  function colourRoles() {
    document.querySelectorAll(".thumb").forEach((thumb) => {
      thumb.style.borderColor = state.roles && thumb.dataset.role ? ROLE_COLOURS[thumb.dataset.role] : "";
    });
    $("role-legend").style.visibility = state.roles ? "visible" : "hidden";
  }

  function drawThumbs() {
    const text = texts[0], n = text.labels().length, thumbs = $("thumbs");
    for (let l = 0; l < NL; l++) {
      const mean = new Float32Array(n * n);
      for (let h = 0; h < NH; h++) {
        const M = text.computeMatrix(l, h, state.words);
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
    $("head").disabled = state.average || state.mode === "rollout";
    $("average").disabled = state.mode === "rollout";
    $("average").checked = state.average;
    $("words").checked = state.words;
    $("mode").value = state.mode;
    $("roles").checked = state.roles;
  }

  function fillSelect(select, count) {
    for (let i = 0; i < count; i++) select.append(el("option", "", String(i)));
  }

  function tokenOf(event) {
    const token = event.target.closest && event.target.closest(".token");
    return token ? { side: token.dataset.side, index: Number(token.dataset.index) } : null;
  }

  function onTokenClick(text, token) {
    const pin = text.pinned;
    if (pin && pin.side !== token.side && !state.words) { // a pinned query and a key: their steps
      const query = pin.side === "query" ? pin.index : token.index, key = pin.side === "query" ? token.index : pin.index;
      showSteps(text, query, key);
      return;
    }
    const same = pin && pin.side === token.side && pin.index === token.index;
    text.pinned = same ? null : token;
    drawFocus(text);
  }

  function bindEvents() {
    const rerender = () => { clearSteps(); syncControls(); renderHead(); };
    $("layer").addEventListener("change", () => { state.layer = Number($("layer").value); rerender(); });
    $("head").addEventListener("change", () => { state.head = Number($("head").value); rerender(); });
    $("average").addEventListener("change", () => { state.average = $("average").checked; rerender(); });
    $("mode").addEventListener("change", () => { state.mode = $("mode").value; rerender(); });
    $("roles").addEventListener("change", () => { state.roles = $("roles").checked; colourRoles(); });
    $("words").addEventListener("change", () => {
      state.words = $("words").checked;
      clearSteps();
      for (const text of texts) text.hover = text.pinned = null; // indices mean something else at the other level
      buildColumns();
      drawThumbs();
      renderHead();
    });
    for (const text of texts) {
      const columns = id(text, "columns");
      columns.addEventListener("mouseover", (event) => {
        const token = tokenOf(event);
        if (token) { text.hover = token; drawFocus(text); }
      });
      // Leaving the columns (not a column) clears the hover: crossing to the lines keeps it, so
      // that a line can be clicked.
      columns.addEventListener("mouseleave", () => { text.hover = null; drawFocus(text); });
      columns.addEventListener("focusin", (event) => { text.hover = tokenOf(event); drawFocus(text); });
      columns.addEventListener("focusout", () => { text.hover = null; drawFocus(text); });
      columns.addEventListener("click", (event) => {
        const token = tokenOf(event);
        if (token) { onTokenClick(text, token); return; }
        const line = event.target.closest && event.target.closest("line");
        if (line && !state.words) showSteps(text, Number(line.dataset.query), Number(line.dataset.key));
      });
    }
    $("thumbs").addEventListener("click", (event) => {
      const thumb = event.target.closest(".thumb");
      if (!thumb) return;
      state.layer = Number(thumb.dataset.layer);
      state.mode = "attention";
      state.average = thumb.dataset.head === "mean";
      if (!state.average) state.head = Number(thumb.dataset.head);
      clearSteps();
      syncControls();
      renderHead();
      const n = texts[0].labels().length, box = thumb.getBoundingClientRect();
      if (!state.average && !state.words && n <= THUMB_RES) { // one pixel per (query, key): that cell's steps
        const border = (thumb.offsetWidth - thumb.clientWidth) / 2;
        const x = (event.clientX - box.left - border) / thumb.clientWidth, y = (event.clientY - box.top - border) / thumb.clientHeight;
        if (x >= 0 && x < 1 && y >= 0 && y < 1) showSteps(texts[0], Math.floor(y * n), Math.floor(x * n));
      }
      view.scrollIntoView({ block: "start" });
    });
  }

  async function main() {
    const status = $("status");
    try {
      for (const text of texts) await text.load();
    } catch (error) {
      status.textContent = `Could not read the attention data: ${error.message}`;
      status.className = "error";
      return;
    }
    const describe = (d) => `${d.tokens.length} tokens, ${d.words.length} words`;
    const model = DATA.model ? `${DATA.model} · ` : "";
    const sizes = texts.map((t) => describe(t.data)).join(" and ");
    $("meta").textContent = `${model}${sizes} · ${NL} layers × ${NH} heads${texts.length > 1 ? " · comparing text A and text B" : ""}`;
    $("text").textContent = texts.length > 1 ? `A: ${DATA.text}\nB: ${DATA.compare.text}` : DATA.text;
    const notes = [];
    for (const text of texts) {
      const d = text.data, name = texts.length > 1 ? (text.suffix ? "Text B" : "Text A") : "This text";
      if (d.sparse) notes.push(`${name} is too long to store every weight: each query keeps its ${d.sparse.k} largest weights, exactly; the rest show as 0.`);
      if (d.rollout === null) notes.push(`${name}: rollout is not stored at this length.`);
      if (d.projections === null) notes.push(`${name}: no per-head q and k stored, so the steps panel cannot show them.`);
    }
    $("storage-note").textContent = notes.join(" ");
    if (!texts.every((t) => t.rollout !== null)) $("mode").disabled = true;
    document.title = `qkv · ${DATA.text.slice(0, 60)}`;
    fillSelect($("layer"), NL);
    fillSelect($("head"), NH);
    buildPanes();
    syncControls();
    buildColumns();
    buildThumbs();
    drawThumbs();
    if (texts.length > 1) { $("diff-view").hidden = false; buildAlignment(); }
    bindEvents();
    renderHead();
    status.textContent = "";
    document.body.dataset.ready = "true";
    document.body.dataset.readyAt = String(performance.now());
  }

  main();
})();
