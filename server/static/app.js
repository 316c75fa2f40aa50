// pagedserve playground: a chat with the served model beside a live map of its paged KV cache.
// Plain browser JavaScript, no build step and no network beyond this server: /v1/* for the
// chat, /kv/stream (server-sent events, server/kv_api.py documents the format) for the map.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const RGB = {
    free: [229, 231, 235],
    cached: [147, 197, 253],
    held: [22, 163, 74],
    shared: [245, 158, 11],
    selected: [17, 24, 39], // an outline (or, in cells too small for one, a darker shade)
    hit: [124, 58, 237],
    evicted: [220, 38, 38],
    windowFreed: [13, 148, 136],
    forked: [194, 65, 12], // shared through a fork (n > 1 or beams), not just a prefix hit
    cow: [219, 39, 119], // outline: made by a copy-on-write
    tier: [8, 145, 178], // outline: loaded back from the KV tier
    image: [79, 70, 229], // corner: holds image placeholder tokens
  };
  const MAX_CELL_PX = 28;
  const MAX_MAP_PX = 300;
  const FLASH_MS = 2000;
  const MAX_EVENTS = 200;

  // ---- KV map state (window.pagedserveKV: what the map shows, for tests and the curious) -----
  const kv = {
    numBlocks: 0,
    blockSize: 0,
    codes: new Uint8Array(0), // min(ref_cnt, 127) | 128 if the block holds a prefix hash
    requests: [], // each with block_table (group 0) and groups[g].block_table (-1: slid out)
    groups: [], // kv_cache_groups: kind, window and block counts per KV cache group
    waiting: [],
    counters: null,
    seq: 0,
    numUpdates: 0,
    selected: null, // request id whose block table is shown
    follow: null, // X-Request-Id of the page's own newest request: selected when it appears
    flashes: new Map(), // block id -> {color, until}
    marks: { cow: new Set(), tier: new Set(), image: new Set(), forked: new Set() },
    tierLoading: [], // requests waiting for their prefix to load from the KV tier
    events: [],
  };
  window.pagedserveKV = kv;
  kv.zoom = true; // false: the whole pool at one scale, however small its cells
  kv.heldIds = (r) => heldIds(r);
  kv.drawNow = () => draw(); // for tests: the map as of this moment's state, not the last frame's

  const refOf = (code) => code & 127;
  const isHashed = (code) => (code & 128) !== 0;
  // a request's tables, one per KV cache group (older servers send only block_table)
  const tablesOf = (r) => (r.groups ? r.groups.map((g) => g.block_table) : [r.block_table]);
  const heldIds = (r) => tablesOf(r).flat().filter((b) => b >= 0);
  const groupName = (g) => (g.kind === "sliding" ? `sliding, window ${g.window}` : "full attention");

  function decodeBase64(text) {
    const bin = atob(text);
    const out = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }

  function applyKV(body) {
    if (body.blocks !== undefined) {
      kv.codes = decodeBase64(body.blocks);
    } else if (body.changes) {
      for (let i = 0; i < body.changes.length; i += 2) kv.codes[body.changes[i]] = body.changes[i + 1];
    }
    kv.numBlocks = body.num_blocks;
    kv.blockSize = body.block_size;
    kv.requests = body.requests;
    kv.groups = body.kv_cache_groups || [];
    kv.waiting = body.waiting;
    kv.counters = body.counters;
    applyMarks(body);
    kv.seq = body.seq;
    kv.numUpdates++;
    if (kv.follow) {
      const mine = kv.requests.find((r) => r.request_id.includes(kv.follow));
      if (mine) {
        kv.selected = mine.request_id;
        kv.follow = null;
      }
    }
    for (const e of body.events || []) onEvent(e);
    $("kv-geometry").textContent =
      `${kv.numBlocks.toLocaleString()} blocks × ${kv.blockSize} tokens`;
    renderCounters();
    renderGroups();
    renderRequests();
    renderBlockTable();
    requestDraw();
  }

  function applyMarks(body) {
    // block_marks: ids (server/kv_api.py); forked: blocks held by a forked request
    const m = body.block_marks || {};
    const forked = new Set();
    for (const r of kv.requests) if (r.forked) for (const b of heldIds(r)) forked.add(b);
    kv.marks = { cow: new Set(m.cow || []), tier: new Set(m.tier || []),
      image: new Set(m.image || []), forked };
    kv.tierLoading = body.tier_loading || [];
    const c = body.counters || {};
    $("legend-tier").hidden = !(c.kv_tier_queries_total >= 0);
  }

  function connectKV() {
    const status = $("kv-status");
    const source = new EventSource("/kv/stream");
    source.addEventListener("snapshot", (m) => {
      status.textContent = "KV stream: live";
      status.className = "pill live";
      applyKV(JSON.parse(m.data));
    });
    source.addEventListener("update", (m) => applyKV(JSON.parse(m.data)));
    source.onerror = () => {
      status.textContent = "KV stream: reconnecting";
      status.className = "pill down";
    };
  }

  // ---- events, counters, requests, block table --------------------------------------------
  function onEvent(e) {
    const now = performance.now();
    let text;
    if (e.type === "prefix_hit") {
      text = `prefix-cache hit: ${e.request_id} reused ${e.num_blocks} block(s) [${e.block_ids.join(", ")}]`;
      for (const b of e.block_ids) kv.flashes.set(b, { color: RGB.hit, until: now + FLASH_MS });
    } else if (e.type === "eviction") {
      text = `evicted ${e.num_blocks} cached block(s)` +
        (e.block_ids.length ? ` [${e.block_ids.join(", ")}]` : "");
      for (const b of e.block_ids) kv.flashes.set(b, { color: RGB.evicted, until: now + FLASH_MS });
    } else if (e.type === "fork") {
      text = `forked ${e.count} request(s): children share their parent's blocks`;
    } else if (e.type === "cow") {
      text = `copy-on-write: ${e.num_blocks} shared block(s) copied before a write` +
        (e.block_ids.length ? ` [${e.block_ids.join(", ")}]` : "");
      for (const b of e.block_ids) kv.flashes.set(b, { color: RGB.cow, until: now + FLASH_MS });
    } else if (e.type === "tier_hit") {
      text = `KV tier hit: ${e.num_tokens} token(s) loaded back` +
        (e.block_ids.length ? ` [${e.block_ids.join(", ")}]` : "");
      for (const b of e.block_ids) kv.flashes.set(b, { color: RGB.tier, until: now + FLASH_MS });
    } else if (e.type === "window_free") {
      text = `window slid: ${e.num_blocks} block(s) returned to the pool` +
        (e.block_ids.length ? ` [${e.block_ids.join(", ")}]` : "");
      for (const b of e.block_ids) kv.flashes.set(b, { color: RGB.windowFreed, until: now + FLASH_MS });
    } else if (e.type === "preemption") {
      text = e.request_id
        ? `preempted ${e.request_id}: its blocks were freed, it will recompute`
        : `${e.count} preemption(s) between two updates`;
    } else {
      text = JSON.stringify(e);
    }
    kv.events.push({ type: e.type, text });
    const li = document.createElement("li");
    li.className = e.type;
    li.textContent = `${new Date().toLocaleTimeString()} ${text}`;
    const list = $("events");
    list.prepend(li);
    while (list.children.length > MAX_EVENTS) list.lastChild.remove();
  }

  const pct = (x) => `${(100 * x).toFixed(x > 0 && x < 0.01 ? 2 : 1)}%`;

  function renderCounters() {
    const c = kv.counters;
    if (!c) return;
    $("c-usage").textContent = pct(c.kv_cache_usage);
    $("c-blocks").textContent = `${c.num_used_blocks} / ${c.num_cached_blocks} / ${c.num_free_blocks}`;
    $("c-shared").textContent = String(c.num_shared_blocks);
    $("c-hit-rate").textContent = c.prefix_cache_queries_total
      ? `${pct(c.prefix_cache_hit_rate)} (${c.prefix_cache_hits_total} / ${c.prefix_cache_queries_total} tokens)`
      : "–";
    $("c-preemptions").textContent = String(c.num_preemptions_total);
    $("c-evictions").textContent = String(c.num_evictions_total);
    $("c-window-freed").textContent = String(c.num_window_freed_blocks_total || 0);
    $("c-queue").textContent = `${c.num_running} / ${c.num_waiting}`;
    $("c-forks").textContent = `${c.num_forks_total || 0} / ${c.num_cow_copies_total || 0}`;
    $("c-tier").textContent = c.kv_tier_queries_total >= 0
      ? `${c.kv_tier_hit_tokens_total} / ${c.kv_tier_queries_total} tokens` +
        (kv.tierLoading.length ? ` · ${kv.tierLoading.length} loading` : "") +
        (c.kv_swap_preemptions_total ? ` · ${c.kv_swap_preemptions_total} swapped (${c.num_swapped_out} out now)` : "")
      : "off";
  }

  function renderGroups() {
    // one row per KV cache group; a model with one full-attention group shows none
    const box = $("groups");
    const windowed = kv.groups.some((g) => g.kind === "sliding");
    $("legend-window").hidden = !windowed; // only a windowed model frees blocks that way
    box.hidden = kv.groups.length < 2 && !windowed;
    const rows = $("groups-rows");
    rows.replaceChildren();
    if (box.hidden) return;
    for (const g of kv.groups) {
      const tr = document.createElement("tr");
      tr.dataset.group = String(g.group);
      tr.dataset.kind = g.kind;
      const cells = [g.group, groupName(g), g.num_held_blocks, g.num_skipped_blocks,
        `${g.num_hashed_blocks} / ${g.num_cached_blocks}`, g.num_window_freed_blocks_total];
      for (const v of cells) {
        const td = document.createElement("td");
        td.textContent = String(v);
        tr.append(td);
      }
      rows.append(tr);
    }
  }

  function renderRequests() {
    const list = $("requests");
    list.replaceChildren();
    for (const r of kv.requests) {
      const li = document.createElement("li");
      li.dataset.requestId = r.request_id;
      li.textContent = `${r.request_id} · ${heldIds(r).length} blocks held · ` +
        `${r.num_computed_tokens}/${r.num_tokens} tokens computed` +
        (r.num_cached_tokens ? ` · ${r.num_cached_tokens} from the prefix cache` : "") +
        (r.num_preemptions ? ` · preempted ${r.num_preemptions}×` : "") +
        (r.forked ? " · forked" : "") +
        (r.num_image_tokens ? ` · ${r.num_image_tokens} image tokens` : "");
      if (r.forked) li.dataset.forked = "1";
      if (r.request_id === kv.selected) li.className = "selected";
      li.addEventListener("click", () => {
        kv.selected = r.request_id;
        kv.follow = null;
        renderRequests();
        renderBlockTable();
        requestDraw();
      });
      list.append(li);
    }
    if (!kv.requests.length) {
      const li = document.createElement("li");
      li.className = "muted";
      li.textContent = `none running (${kv.counters ? kv.counters.num_waiting : 0} waiting)`;
      list.append(li);
    }
  }

  function renderBlockTable() {
    const box = $("block-table");
    const r = kv.requests.find((x) => x.request_id === kv.selected);
    box.replaceChildren();
    if (!r) {
      $("table-title").textContent = kv.selected ? `(${kv.selected}: not running)` : "(select a request)";
      return;
    }
    $("table-title").textContent = `${r.request_id}: logical → physical`;
    const numHit = Math.floor(r.num_cached_tokens / kv.blockSize);
    const groups = r.groups || [{ group: 0, block_table: r.block_table }];
    const several = groups.length > 1 || (kv.groups[0] && kv.groups[0].kind === "sliding");
    for (const g of groups) {
      const info = kv.groups[g.group];
      const section = document.createElement("div");
      section.className = "group-table";
      section.dataset.group = String(g.group);
      const table = g.block_table;
      const numSkipped = table.filter((b) => b < 0).length;
      section.dataset.held = String(table.length - numSkipped);
      section.dataset.skipped = String(numSkipped);
      if (several) {
        const title = document.createElement("div");
        title.className = "group-title";
        title.textContent = `group ${g.group} (${info ? groupName(info) : "?"}): ` +
          `${table.length - numSkipped} held` +
          (numSkipped ? `, ${numSkipped} slid out of the window and freed` : "");
        section.append(title);
      }
      if (numSkipped) { // a leading run: one chip for all of it
        const chip = document.createElement("span");
        chip.className = "bt skipped";
        chip.textContent = numSkipped > 1 ? `0–${numSkipped - 1}: freed` : "0: freed";
        section.append(chip);
      }
      table.forEach((phys, logical) => {
        if (phys < 0) return;
        const chip = document.createElement("span");
        const ref = refOf(kv.codes[phys] || 0);
        chip.className = "bt held" + (ref > 1 ? " shared" : "") + (logical < numHit ? " hit" : "");
        chip.textContent = `${logical}→${phys}` + (ref > 1 ? ` (ref ${ref})` : "");
        section.append(chip);
      });
      box.append(section);
    }
  }

  // ---- the map: one cell per block, or one pixel per group of blocks in huge pools --------
  const canvas = $("kv-canvas");
  const ctx = canvas.getContext("2d");
  let drawPending = false;
  let geometry = null;

  function requestDraw() {
    if (drawPending) return;
    drawPending = true;
    requestAnimationFrame(() => {
      drawPending = false;
      draw();
    });
  }

  function layout(width, n) {
    // the largest square cell (capped) for which n cells fit in width x MAX_MAP_PX
    let s = Math.min(MAX_CELL_PX, Math.floor(Math.sqrt((width * MAX_MAP_PX) / Math.max(n, 1))));
    while (s > 1 && Math.floor(width / s) * Math.floor(MAX_MAP_PX / s) < n) s--;
    if (s >= 1 && Math.floor(width / s) * Math.floor(MAX_MAP_PX / s) >= n) {
      const cols = Math.floor(width / s);
      return { cell: s, cols, perCell: 1, height: Math.ceil(n / cols) * s };
    }
    // more blocks than pixels: each pixel stands for perCell consecutive blocks
    const perCell = Math.ceil(n / (width * MAX_MAP_PX));
    return { cell: 1, cols: width, perCell, height: Math.ceil(n / perCell / width) };
  }

  // the selected request's blocks keep their state colour: darker where no outline fits
  const shade = (c) => [c[0] * 0.55, c[1] * 0.55, c[2] * 0.55];

  const MIN_SHOWN = 1024;
  // A large pool drawn whole is a grey slab with a thin line of used blocks: the map's scale
  // follows the highest block in use (with room to grow), at least MIN_SHOWN blocks.
  function shownBlocks(width) {
    const n = kv.numBlocks;
    if (!kv.zoom || n <= MIN_SHOWN || layout(width, n).cell >= 8) return n;
    let top = n - 1;
    while (top >= 0 && kv.codes[top] === 0) top--;
    const wanted = Math.ceil(((top + 1) * 1.25) / 256) * 256;
    return Math.min(n, Math.max(MIN_SHOWN, wanted));
  }

  function blockColor(code, selectedSet, b) {
    // one colour a block (pixels): a mark wins over the state
    const m = kv.marks;
    const c = m.cow.has(b) ? RGB.cow : m.tier.has(b) ? RGB.tier : m.image.has(b) ? RGB.image
      : stateColor(code, b);
    return selectedSet.has(b) ? shade(c) : c;
  }

  function stateColor(code, b) {
    const ref = refOf(code);
    if (ref > 1) return kv.marks.forked.has(b) ? RGB.forked : RGB.shared;
    if (ref === 1) return RGB.held;
    return isHashed(code) ? RGB.cached : RGB.free;
  }

  function groupColor(start, end) {
    // the blocks' colours mixed by count, so usage shows as a gradient
    let r = 0, g = 0, bl = 0;
    for (let b = start; b < end; b++) {
      const c = blockColor(kv.codes[b], EMPTY_SET, b);
      r += c[0]; g += c[1]; bl += c[2];
    }
    const n = Math.max(end - start, 1);
    return [r / n, g / n, bl / n];
  }
  const EMPTY_SET = new Set();

  function draw() {
    const width = Math.max(Math.floor(canvas.clientWidth), 50);
    if (!kv.numBlocks) return;
    const n = shownBlocks(width);
    geometry = layout(width, n);
    geometry.shown = n;
    $("map-scale").textContent = n < kv.numBlocks
      ? `map: blocks 0–${(n - 1).toLocaleString()} (past the highest one in use; the rest are free)`
      : "";
    kv.geometry = geometry; // for tests: where block b is drawn
    const height = Math.max(geometry.height, 1);
    canvas.style.height = `${height}px`;
    if (canvas.width !== width || canvas.height !== height) {
      canvas.width = width;
      canvas.height = height;
    }
    const sel = kv.requests.find((r) => r.request_id === kv.selected);
    const selectedSet = new Set(sel ? heldIds(sel) : []);
    const now = performance.now();
    const { cell, cols, perCell } = geometry;
    if (cell <= 3) {
      drawPixels(width, height, cell, cols, perCell, selectedSet, now);
    } else {
      drawCells(width, height, cell, cols, selectedSet, now);
    }
    canvas.dataset.seq = String(kv.seq);
    canvas.dataset.perCell = String(perCell);
    let active = false;
    for (const [b, f] of kv.flashes) {
      if (f.until <= now) kv.flashes.delete(b);
      else active = true;
    }
    if (active) requestDraw();
  }

  function drawPixels(width, height, cell, cols, perCell, selectedSet, now) {
    const img = ctx.createImageData(width, height);
    const px = img.data;
    const numCells = Math.ceil(geometry.shown / perCell);
    for (let i = 0; i < numCells; i++) {
      const start = i * perCell;
      let c;
      if (perCell === 1) {
        const f = kv.flashes.get(start);
        c = f && f.until > now ? f.color : blockColor(kv.codes[start], selectedSet, start);
      } else {
        c = groupColor(start, Math.min(start + perCell, geometry.shown));
      }
      const x0 = (i % cols) * cell, y0 = Math.floor(i / cols) * cell;
      for (let dy = 0; dy < cell; dy++) {
        for (let dx = 0; dx < cell; dx++) {
          const o = ((y0 + dy) * width + x0 + dx) * 4;
          px[o] = c[0]; px[o + 1] = c[1]; px[o + 2] = c[2]; px[o + 3] = 255;
        }
      }
    }
    ctx.putImageData(img, 0, 0);
  }

  function drawCells(width, height, cell, cols, selectedSet, now) {
    ctx.clearRect(0, 0, width, height);
    const gap = cell >= 6 ? 1 : 0;
    const labels = cell >= 14;
    ctx.font = `${Math.floor(cell * 0.55)}px system-ui, sans-serif`;
    ctx.textAlign = "center";
    ctx.textBaseline = "middle";
    for (let b = 0; b < geometry.shown; b++) {
      const code = kv.codes[b];
      const x = (b % cols) * cell, y = Math.floor(b / cols) * cell;
      const roomy = cell >= 10; // room for an outline around a visible fill
      const selected = selectedSet.has(b);
      const state = stateColor(code, b);
      const c = selected && !roomy ? shade(state) : state;
      ctx.fillStyle = `rgb(${c[0]},${c[1]},${c[2]})`;
      ctx.fillRect(x, y, cell - gap, cell - gap);
      if (roomy) drawMarks(b, x, y, cell - gap);
      else if (kv.marks.cow.has(b) || kv.marks.tier.has(b) || kv.marks.image.has(b)) {
        const mc = blockColor(code, selectedSet, b); // too small for outlines: the mark's colour
        ctx.fillStyle = `rgb(${mc[0]},${mc[1]},${mc[2]})`;
        ctx.fillRect(x, y, cell - gap, cell - gap);
      }
      const f = kv.flashes.get(b);
      const flash = f && f.until > now ? f.color : null;
      const outline = flash || (selected && roomy ? RGB.selected : null);
      if (outline) {
        const w = cell >= 16 ? 2 : 1;
        ctx.strokeStyle = `rgb(${outline[0]},${outline[1]},${outline[2]})`;
        ctx.lineWidth = w;
        ctx.strokeRect(x + w / 2, y + w / 2, cell - gap - w, cell - gap - w);
      }
      const ref = refOf(code);
      if (labels && ref > 1) {
        ctx.fillStyle = "#111827";
        ctx.fillText(String(ref), x + (cell - gap) / 2, y + (cell - gap) / 2 + 1);
      }
    }
  }

  function drawMarks(b, x, y, size) {
    // copy-on-write / tier: an inner outline (inside the selection's); image: a corner
    const m = kv.marks;
    const line = m.cow.has(b) ? RGB.cow : m.tier.has(b) ? RGB.tier : null;
    if (line) {
      ctx.strokeStyle = `rgb(${line[0]},${line[1]},${line[2]})`;
      ctx.lineWidth = 2;
      ctx.strokeRect(x + 4, y + 4, size - 8, size - 8);
    }
    if (m.image.has(b)) {
      const t = Math.max(Math.floor(size / 2.5), 3);
      ctx.fillStyle = `rgb(${RGB.image[0]},${RGB.image[1]},${RGB.image[2]})`;
      ctx.beginPath();
      ctx.moveTo(x, y);
      ctx.lineTo(x + t, y);
      ctx.lineTo(x, y + t);
      ctx.closePath();
      ctx.fill();
    }
  }

  function blockAt(event) {
    if (!geometry) return -1;
    const rect = canvas.getBoundingClientRect();
    const x = Math.floor(event.clientX - rect.left), y = Math.floor(event.clientY - rect.top);
    const i = Math.floor(y / geometry.cell) * geometry.cols + Math.floor(x / geometry.cell);
    const b = i * geometry.perCell;
    return b >= 0 && b < geometry.shown ? b : -1;
  }

  canvas.addEventListener("mousemove", (event) => {
    const tip = $("kv-tooltip");
    const b = blockAt(event);
    if (b < 0) {
      tip.hidden = true;
      return;
    }
    const code = kv.codes[b];
    const holders = [];
    for (const r of kv.requests) {
      tablesOf(r).forEach((t, g) => {
        const i = t.indexOf(b);
        if (i >= 0) holders.push(`${r.request_id}[${kv.groups.length > 1 ? `g${g}:` : ""}${i}]`);
      });
    }
    const what = geometry.perCell > 1 ? `blocks ${b}–${b + geometry.perCell - 1}` : `block ${b}`;
    const m = kv.marks;
    const marks = [m.forked.has(b) && refOf(code) > 1 ? "forked" : "",
      m.cow.has(b) ? "copy-on-write copy" : "", m.tier.has(b) ? "loaded from the KV tier" : "",
      m.image.has(b) ? "image tokens" : ""].filter(Boolean);
    tip.textContent = `${what}: ref ${refOf(code)}` + (isHashed(code) ? ", prefix-cached" : "") +
      (marks.length ? `, ${marks.join(", ")}` : "") +
      (holders.length ? ` · ${holders.join(", ")}` : "");
    tip.style.left = `${event.offsetX + 12}px`;
    tip.style.top = `${event.offsetY + 12}px`;
    tip.hidden = false;
  });
  canvas.addEventListener("mouseleave", () => { $("kv-tooltip").hidden = true; });
  window.addEventListener("resize", requestDraw);

  // ---- chat ---------------------------------------------------------------------------------
  const conversation = []; // chat turns after the system prompt
  let modelName = null;
  let controller = null;
  let numSent = 0;

  async function loadModel() {
    try {
      const resp = await fetch("/v1/models");
      const body = await resp.json();
      modelName = body.data[0].id;
      $("model-name").textContent = `${modelName} · max_model_len ${body.data[0].max_model_len}`;
      fillModelPicker(body.data);
      setImageSupport(body.data[0]);
    } catch (e) {
      $("model-name").textContent = `no model: ${e.message}`;
    }
    try {
      // a model without a chat template (Gemma 3 270M's GGUF) would answer chat with a 400
      const info = await (await fetch("/tokenizer_info")).json();
      if (!info.chat_template) setMode("completion", "this model has no chat template: raw completion");
    } catch (e) {
      // no tokenizer info: keep chat, the first reply says what is wrong
    }
  }

  // the base model and its LoRA adapters (cards with a parent); a request goes with the pick
  function fillModelPicker(cards) {
    const picker = $("model");
    picker.replaceChildren();
    for (const card of cards) {
      const label = card.parent ? `${card.id} (LoRA adapter of ${card.parent})` : card.id;
      picker.append(new Option(label, card.id));
    }
    picker.value = modelName;
    $("model-label").hidden = cards.length < 2;
  }
  $("model").addEventListener("change", () => { modelName = $("model").value; });

  function setMode(mode, note) {
    $("mode").value = mode;
    $("system-label").hidden = mode !== "chat";
    $("mode-note").textContent = note || "";
    renderAttachments();
  }

  // ---- images: pasted, picked or dropped; sent as image_url parts with data: URLs -----------
  // Offered only when /v1/models lists "image" in the model's input_modalities, and only in
  // chat mode (a raw completion prompt is text). The server decodes and checks each image.
  const pendingImages = []; // data: URLs for the next message
  let takesImages = false;
  const isImage = (f) => f && f.type && f.type.startsWith("image/");

  function setImageSupport(card) {
    takesImages = Boolean(card && (card.input_modalities || []).includes("image"));
    renderAttachments();
  }

  function addImageFiles(files) {
    const images = Array.from(files || []).filter(isImage);
    if (!images.length) return false;
    if (!takesImages || $("mode").value !== "chat") {
      $("attach-note").textContent = "this model takes no images (text only)";
      return true;
    }
    for (const file of images) {
      const reader = new FileReader();
      reader.onload = () => {
        pendingImages.push(reader.result);
        renderAttachments();
      };
      reader.onerror = () => { $("attach-note").textContent = `could not read ${file.name}`; };
      reader.readAsDataURL(file);
    }
    return true;
  }

  function renderAttachments() {
    const on = takesImages && $("mode").value === "chat";
    $("attach").hidden = !on;
    const box = $("attachments");
    box.replaceChildren();
    box.hidden = !on || !pendingImages.length;
    $("attach-note").textContent = on && pendingImages.length
      ? `${pendingImages.length} image(s) go with the next message` : "";
    pendingImages.forEach((url, i) => {
      const thumb = document.createElement("div");
      thumb.className = "thumb";
      const img = document.createElement("img");
      img.src = url;
      img.alt = `image ${i + 1} to send`;
      const remove = document.createElement("button");
      remove.type = "button";
      remove.className = "remove";
      remove.textContent = "×";
      remove.title = remove.ariaLabel = `remove image ${i + 1}`;
      remove.addEventListener("click", () => {
        pendingImages.splice(i, 1);
        renderAttachments();
      });
      thumb.append(img, remove);
      box.append(thumb);
    });
  }

  $("image-input").addEventListener("change", (e) => {
    addImageFiles(e.target.files);
    e.target.value = ""; // the same file can be picked again
  });
  $("composer").addEventListener("paste", (e) => {
    // an image on the clipboard becomes an attachment; pasted text stays ordinary
    if (e.clipboardData && addImageFiles(e.clipboardData.files)) e.preventDefault();
  });
  $("composer").addEventListener("dragover", (e) => {
    if (!takesImages || !e.dataTransfer || !e.dataTransfer.types.includes("Files")) return;
    e.preventDefault();
    $("composer").classList.add("drop-target");
  });
  $("composer").addEventListener("dragleave", () => $("composer").classList.remove("drop-target"));
  $("composer").addEventListener("drop", (e) => {
    $("composer").classList.remove("drop-target");
    if (e.dataTransfer && addImageFiles(e.dataTransfer.files)) e.preventDefault();
  });

  function chatContent(text, images) {
    // plain text, or OpenAI content parts: the images first, then the text
    if (!images.length) return text;
    const parts = images.map((url) => ({ type: "image_url", image_url: { url } }));
    return text.trim() ? parts.concat([{ type: "text", text }]) : parts;
  }

  function addMessage(role, text, images) {
    const el = document.createElement("div");
    el.className = `msg ${role}`;
    const label = document.createElement("div");
    label.className = "role";
    label.textContent = role;
    const body = document.createElement("div");
    body.className = "text";
    body.textContent = text;
    const stats = document.createElement("div");
    stats.className = "stats";
    el.append(label);
    if (images && images.length) {
      const row = document.createElement("div");
      row.className = "images";
      for (const url of images) {
        const img = document.createElement("img");
        img.src = url;
        img.alt = "an image sent with this message";
        row.append(img);
      }
      el.append(row);
    }
    el.append(body, stats);
    $("messages").append(el);
    el.scrollIntoView({ block: "end" });
    return { el, body, stats };
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
  }

  function numberField(id, parse) {
    const v = parse($(id).value);
    return Number.isFinite(v) ? v : undefined;
  }

  async function* sseData(resp) {
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (line.startsWith("data: ")) yield line.slice(6);
        }
      }
    }
  }

  async function send() {
    const text = $("input").value;
    const mode = $("mode").value;
    const images = mode === "chat" ? pendingImages.slice() : [];
    if ((!text.trim() && !images.length) || controller) return;
    const params = {
      model: modelName,
      temperature: numberField("temperature", parseFloat),
      top_p: numberField("top-p", parseFloat),
      max_tokens: numberField("max-tokens", (v) => parseInt(v, 10)),
      stream: true,
      stream_options: { include_usage: true },
    };
    let url, body;
    if (mode === "chat") {
      conversation.push({ role: "user", content: chatContent(text, images) });
      addMessage("user", text, images);
      pendingImages.length = 0;
      renderAttachments();
      const system = $("system").value.trim();
      const messages = system ? [{ role: "system", content: system }] : [];
      url = "/v1/chat/completions";
      body = { ...params, messages: messages.concat(conversation) };
    } else {
      addMessage("prompt", text);
      url = "/v1/completions";
      body = { ...params, prompt: text };
    }
    $("input").value = "";
    const out = addMessage(mode === "chat" ? "assistant" : "completion", "");
    out.el.dataset.state = "waiting";
    const requestId = `pg${++numSent}-${Math.random().toString(36).slice(2, 8)}`;
    kv.follow = requestId;
    controller = new AbortController();
    setBusy(true);
    const t0 = performance.now();
    let tFirst = null, tLast = null, numPieces = 0, usage = null, finish = null, answer = "";
    try {
      const resp = await fetch(url, {
        method: "POST",
        headers: { "content-type": "application/json", "x-request-id": requestId },
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!resp.ok) {
        const err = await resp.json().catch(() => null);
        throw new Error(err && err.error ? err.error.message : `HTTP ${resp.status}`);
      }
      for await (const data of sseData(resp)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const piece = mode === "chat" ? (choice.delta && choice.delta.content) || "" : choice.text || "";
          if (piece) {
            tLast = performance.now();
            if (tFirst === null) tFirst = tLast;
            numPieces++;
            answer += piece;
            out.body.textContent = answer;
            out.el.dataset.state = "streaming";
            out.el.scrollIntoView({ block: "end" });
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
      out.el.dataset.state = "done";
    } catch (e) {
      if (e.name === "AbortError") {
        finish = "stopped";
        out.el.dataset.state = "stopped";
      } else {
        out.el.classList.add("error");
        out.el.dataset.state = "error";
        out.body.textContent = answer + (answer ? "\n" : "") + `error: ${e.message}`;
        if (images.length && !answer) dropRefusedTurn(out);
      }
    } finally {
      controller = null;
      setBusy(false);
    }
    if (mode === "chat" && answer) conversation.push({ role: "assistant", content: answer });
    out.stats.textContent = answerStats(t0, tFirst, tLast, usage, numPieces, finish);
  }

  function dropRefusedTurn(out) {
    // a refused image would be resent, and refused, with every later message: forget the turn
    conversation.pop();
    out.body.textContent += "\n(this message and its images are left out of the conversation)";
  }

  function answerStats(t0, tFirst, tLast, usage, numPieces, finish) {
    const parts = [];
    if (tFirst !== null) parts.push(`TTFT ${(tFirst - t0).toFixed(0)} ms`);
    const tokens = usage ? usage.completion_tokens : numPieces;
    parts.push(`${tokens} tokens`);
    if (tFirst !== null && tokens > 1 && tLast > tFirst) {
      parts.push(`${((tokens - 1) / ((tLast - tFirst) / 1000)).toFixed(1)} tokens/s`);
    }
    if (usage && usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) {
      parts.push(`${usage.prompt_tokens_details.cached_tokens} prompt tokens from the prefix cache`);
    }
    if (finish) parts.push(finish);
    return parts.join(" · ");
  }

  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", () => {
    if (controller) controller.abort();
  });
  $("new-chat").addEventListener("click", () => {
    if (controller) controller.abort();
    conversation.length = 0;
    $("messages").replaceChildren();
  });
  $("mode").addEventListener("change", () => setMode($("mode").value));

  loadModel();
  connectKV();
})();
