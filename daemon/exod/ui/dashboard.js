// The exod dashboard: the daemon's own API, read live, and nothing else.
//
// * State: /instances and /nodes are the truth; /events (the transition log, as server-sent events) says
//   when to read them again and is the timeline. A browser's EventSource cannot send an Authorization
//   header, so the stream is read with fetch, and resumed after a reconnect with Last-Event-ID.
// * The diagrams are the daemon's own (/diagrams/<machine>?format=svg, drawn from the machines' code);
//   the page only marks the live states in them.
// * With an API key, nothing is fetched until the person has given it.

const KEEPALIVE_S = 15; // the daemon's keepalive comment period (exod.api.app.KEEPALIVE_S)
const TIMELINE_MAX = 500; // entries kept per instance
const POLL_MS = 2000; // progress and byte counts change without a transition: read them this often
const RETRY_MS = [250, 500, 1000, 2000, 4000];

const $ = (id) => document.getElementById(id);

const page = {
  authRequired: document.querySelector('meta[name="exod-auth"]').content === "key",
  key: sessionStorage.getItem("exod-api-key"),
  instances: [],
  nodes: null,
  selected: null,
  lastSeq: 0,
  timelines: new Map(), // instance id → entries (instance and runner transitions), oldest first
  generations: new Map(), // instance id → generation counted from its log, or null if its start was pruned
  diagrams: new Map(), // machine → SVG element
  connected: false,
  drawn: null, // what the instance list and the diagrams show now (render() skips a redraw of the same)
  stream: null, // the AbortController of the event stream
  session: 0, // which follow() loop is current: asking for the key again ends the one before
  chat: { messages: [], abort: null },
};

// -- the API ---------------------------------------------------------------------------------------

class Unauthorized extends Error {}

function headers(extra = {}) {
  return page.key ? { ...extra, Authorization: `Bearer ${page.key}` } : extra;
}

async function api(path, { method = "GET", body, signal } = {}) {
  const init = { method, headers: headers(body ? { "Content-Type": "application/json" } : {}), signal };
  if (body !== undefined) init.body = JSON.stringify(body);
  const response = await fetch(path, init);
  if (response.status === 401) throw new Unauthorized("the API key was refused");
  if (!response.ok) throw new Error(await errorMessage(response));
  return response;
}

async function errorMessage(response) {
  try {
    const doc = await response.json();
    return doc?.error?.message ?? `${response.status} ${response.statusText}`;
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

// Server-sent events from a fetch body: blocks separated by a blank line, fields "name: value".
async function* serverSentEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replaceAll("\r\n", "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const event = { event: "message", data: [], id: null, comment: false };
      for (const line of block.split("\n")) {
        if (line.startsWith(":")) {
          event.comment = true;
          continue;
        }
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "data") event.data.push(text);
        else if (field === "event") event.event = text;
        else if (field === "id") event.id = text;
      }
      yield { ...event, data: event.data.join("\n") };
    }
  }
}

// -- the live stream -------------------------------------------------------------------------------

async function follow(session) {
  let failures = 0;
  while (session === page.session) {
    const abort = new AbortController();
    page.stream = abort;
    let watchdog = null;
    const feed = () => {
      clearTimeout(watchdog);
      watchdog = setTimeout(() => abort.abort(), KEEPALIVE_S * 2500); // silent for two keepalives: gone
    };
    try {
      const response = await fetch("/events", {
        headers: headers({ "Last-Event-ID": String(page.lastSeq) }),
        signal: abort.signal,
      });
      if (response.status === 401) throw new Unauthorized("the API key was refused");
      if (!response.ok) throw new Error(await errorMessage(response));
      feed();
      await refresh();
      setConnected(true);
      failures = 0;
      for await (const message of serverSentEvents(response)) {
        feed();
        if (message.event === "transition") record(JSON.parse(message.data));
        else if (message.event === "truncated") page.lastSeq = Number(message.id);
      }
      throw new Error("the daemon ended the stream");
    } catch (error) {
      if (session !== page.session) return; // the key was taken back: this loop is over
      if (error instanceof Unauthorized) return askForKey(error.message);
      failures += 1;
      setConnected(false, error);
      await sleep(RETRY_MS[Math.min(failures - 1, RETRY_MS.length - 1)]);
    } finally {
      clearTimeout(watchdog);
    }
  }
}

function record(entry) {
  if (entry.seq <= page.lastSeq) return; // already seen (a resume overlaps by design)
  page.lastSeq = entry.seq;
  const instanceId = entry.machine === "instance" ? entry.id : entry.machine === "runner" ? entry.id.split("/")[0] : null;
  if (instanceId !== null) {
    if (entry.machine === "instance") {
      // Counted from the instance's `place`; unknown ("") if the log's start was pruned before this page read it.
      let generation = entry.event === "place" ? 0 : (page.generations.get(instanceId) ?? null);
      if (generation !== null && entry.to === "starting" && (entry.event === "start" || entry.event === "resume")) {
        generation += 1;
      }
      page.generations.set(instanceId, generation);
    }
    const entries = page.timelines.get(instanceId) ?? [];
    const kept = { ...entry, generation: page.generations.get(instanceId) ?? null };
    entries.push(kept);
    if (entries.length > TIMELINE_MAX) entries.splice(0, entries.length - TIMELINE_MAX);
    page.timelines.set(instanceId, entries);
    if (instanceId === page.selected) {
      const list = $("timeline");
      list.prepend(timelineRow(kept)); // newest first; rows already shown stay as they are
      while (list.childElementCount > TIMELINE_MAX) list.lastElementChild.remove();
    }
  }
  refreshSoon();
}

let refreshTimer = null;
function refreshSoon() {
  if (refreshTimer === null) refreshTimer = setTimeout(() => refresh().catch(reportRefresh), 100);
}

async function refresh() {
  clearTimeout(refreshTimer);
  refreshTimer = null;
  const [instances, nodes] = await Promise.all([api("/instances"), api("/nodes")]);
  page.instances = (await instances.json()).instances;
  page.nodes = await nodes.json();
  render();
}

function reportRefresh(error) {
  if (error instanceof Unauthorized) askForKey(error.message);
  // anything else: the stream notices a daemon that is gone, and says so
}

function setConnected(connected, error) {
  page.connected = connected;
  const pill = $("connection");
  pill.dataset.state = connected ? "live" : "reconnecting";
  pill.textContent = connected ? "live" : "reconnecting";
  const banner = $("banner");
  banner.hidden = connected;
  if (!connected) {
    const why = error?.message ? ` (${error.message})` : "";
    banner.textContent = `The daemon is not answering${why}. Reconnecting… what is shown is as of ${clock(Date.now() / 1000)}.`;
  }
}

// -- rendering -------------------------------------------------------------------------------------

function render() {
  // Only what changed is drawn again: a list redrawn under the pointer would swallow clicks.
  const drawn = JSON.stringify([page.instances, page.nodes, page.selected]);
  if (drawn === page.drawn) return;
  page.drawn = drawn;
  renderNodes();
  renderInstances();
  renderDetail();
  renderChatModels();
}

function renderNodes() {
  const doc = page.nodes;
  if (!doc) return;
  const names = doc.nodes.map((n) => `${n.node_id}${n.node_id === doc.controller ? " (controller)" : ""}`);
  $("nodes").textContent = `${doc.cluster ? `cluster ${doc.cluster}: ` : ""}${names.join(", ")}`;
  $("nodes").dataset.count = String(doc.nodes.length);
}

function renderInstances() {
  const container = $("instances");
  if (page.instances.length === 0) {
    container.replaceChildren(el("p", { class: "muted" }, "No instance yet: place a model below."));
    return;
  }
  container.replaceChildren(...page.instances.map(instanceCard));
  const models = new Set(page.instances.map((i) => i.model_id));
  $("known-models").replaceChildren(...[...models].map((m) => el("option", { value: m })));
}

function instanceCard(inst) {
  const card = el("article", {
    class: `instance${inst.instance_id === page.selected ? " selected" : ""}`,
    "data-instance": inst.instance_id,
    "data-state": inst.state,
    tabindex: "0",
  });
  const head = el("div", { class: "instance-head" },
    el("strong", { class: "instance-id" }, inst.instance_id),
    el("span", { class: "muted" }, ` ${inst.model_id} · ${inst.ranks} rank${inst.ranks === 1 ? "" : "s"}`),
    el("span", { class: `state state-${inst.state}` }, inst.state),
  );
  if (inst.residency === "loaded") {
    head.append(el("button", { type: "button", class: "park", "data-park": inst.instance_id, title: "Stop its runners and free their memory; a request brings it back" }, "Park"));
  } else if (inst.residency === "parked") {
    head.append(el("button", { type: "button", class: "park", "data-unpark": inst.instance_id, title: "Load it again now" }, "Unpark"));
  }
  if (inst.state !== "deleted") {
    head.append(el("button", { type: "button", class: "delete", "data-delete": inst.instance_id }, "Delete"));
  }
  const facts = el("dl", { class: "facts" },
    ...fact("generation", String(inst.generation), "generation"),
    ...fact("failed generations", `${inst.attempts} of ${inst.max_failures}${inst.uncharged ? ` (+${inst.uncharged} not charged)` : ""}`, "attempts"),
  );
  if (inst.state !== "deleted" && inst.residency) facts.append(...fact("in memory", residency(inst), "residency"));
  if (inst.next_retry_at !== null) facts.append(...fact("next retry", countdown(inst.next_retry_at), "countdown"));
  if (inst.waiting_for) facts.append(...fact("waiting for", inst.waiting_for, "waiting"));
  if (inst.last_failure) facts.append(...fact("last cause", inst.last_failure, "cause"));
  if (inst.download) {
    const [done, total] = inst.download.bytes;
    const bytes = total ? `${size(done)} of ${size(total)}` : done ? size(done) : "";
    const text = `${inst.download.state}${bytes ? ` · ${bytes}` : ""}${inst.download.last_error ? ` · ${inst.download.last_error}` : ""}`;
    facts.append(...fact("download", text, "download"));
  }
  card.append(head, facts);
  if (inst.state === "deleted") card.append(el("p", { class: "deleted-why" }, whyDeleted(inst)));
  const runners = el("table", { class: "runners" },
    el("thead", {}, el("tr", {}, ...["rank", "node", "state", "loading", "in flight", "failure"].map((h) => el("th", {}, h)))),
    el("tbody", {}, ...inst.runners.map(runnerRow)),
  );
  card.append(runners);
  return card;
}

function runnerRow(r) {
  const [loaded, total] = r.layers ?? [0, 0];
  const progress = total ? el("progress", { max: String(total), value: String(loaded), title: `${loaded}/${total} layers` }) : "";
  return el("tr", { "data-runner": r.runner_id, "data-state": r.state ?? "none" },
    el("td", {}, String(r.rank)),
    el("td", {}, r.node),
    el("td", { class: "runner-state" }, r.state === null ? "not created" : r.phase ? `${r.state} · ${r.phase}` : r.state),
    el("td", {}, progress),
    el("td", {}, String(r.in_flight)),
    el("td", { class: "failure" }, r.failure ?? ""),
  );
}

function whyDeleted(inst) {
  switch (inst.delete_reason) {
    case "requested":
      return "Deleted: a user asked for it.";
    case "retries_exhausted":
      return `Deleted: it gave up after ${inst.attempts} failed generations (the budget is ${inst.max_failures}). Last cause: ${inst.last_failure ?? "unknown"}.`;
    case "non_retryable":
      return `Deleted: a failure that no retry can fix: ${inst.last_failure ?? "unknown"}.`;
    default:
      return `Deleted (${inst.delete_reason ?? "no reason recorded"}).`;
  }
}

function renderDetail() {
  const inst = page.instances.find((i) => i.instance_id === page.selected) ?? null;
  $("detail-title").textContent = inst ? `Instance ${inst.instance_id}` : "Machines";
  $("detail-hint").hidden = inst !== null;
  const why = $("deleted-why");
  why.hidden = !(inst && inst.state === "deleted");
  if (inst && inst.state === "deleted") why.textContent = whyDeleted(inst);
  const live = {
    instance: inst ? [inst.state] : [],
    runner: inst ? inst.runners.filter((r) => r.state !== null).map((r) => r.phase ?? r.state) : [],
    download: inst?.download ? [inst.download.state] : [],
  };
  for (const [machine, svg] of page.diagrams) mark(svg, new Set(live[machine]));
}

function renderTimeline() {
  const entries = page.selected ? (page.timelines.get(page.selected) ?? []) : [];
  $("timeline").replaceChildren(...entries.map(timelineRow).reverse());
}

function timelineRow(entry) {
  const who = entry.machine === "instance" ? "instance" : `rank ${entry.id.split("/").pop()}`;
  return el("li", {
    class: `entry entry-${entry.machine}${entry.to === "failed" || entry.to === "recovering" ? " bad" : ""}`,
    "data-seq": String(entry.seq),
    "data-machine": entry.machine,
    "data-event": entry.event,
    "data-from": entry.from,
    "data-to": entry.to,
    "data-generation": entry.generation === null ? "" : String(entry.generation),
  },
    el("time", {}, clock(entry.time)),
    el("span", { class: "who" }, who),
    el("span", { class: "event" }, entry.event),
    el("span", { class: "move" }, `${entry.from || "·"} → ${entry.to}`),
    el("span", { class: "gen" }, entry.generation === null ? "" : `gen ${entry.generation}`),
    el("span", { class: "cause" }, entry.cause),
  );
}

function renderChatModels() {
  const select = $("chat-model");
  const ready = [...new Set(page.instances.filter((i) => i.state === "ready").map((i) => i.model_id))];
  const chosen = select.value;
  select.replaceChildren(...ready.map((m) => el("option", { value: m }, m)));
  if (ready.includes(chosen)) select.value = chosen;
  $("chat-send").disabled = ready.length === 0 || page.chat.abort !== null;
}

// -- diagrams --------------------------------------------------------------------------------------

async function loadDiagrams() {
  for (const holder of document.querySelectorAll(".diagram")) {
    const machine = holder.dataset.machine;
    try {
      const response = await api(`/diagrams/${machine}?format=svg`);
      const svg = new DOMParser().parseFromString(await response.text(), "image/svg+xml").documentElement;
      svg.removeAttribute("width");
      svg.removeAttribute("height");
      for (const named of svg.querySelectorAll("[id]")) named.id = `${machine}-${named.id}`; // ids repeat across machines
      holder.replaceChildren(document.importNode(svg, true));
      page.diagrams.set(machine, holder.querySelector("svg"));
    } catch (error) {
      if (error instanceof Unauthorized) throw error;
      holder.replaceChildren(el("p", { class: "muted" }, `No drawing: ${error.message}`));
    }
  }
}

// Graphviz writes each node's name (the state's id) as its <title>; only leaves are live.
function mark(svg, leaves) {
  for (const group of svg.querySelectorAll("g.node")) {
    group.classList.toggle("live", leaves.has(group.querySelector("title")?.textContent ?? ""));
  }
}

// -- actions ---------------------------------------------------------------------------------------

async function place(event) {
  event.preventDefault();
  const error = $("place-error");
  error.hidden = true;
  const body = { model: $("place-model").value.trim(), ranks: Number($("place-ranks").value) };
  try {
    const response = await api("/instances", { method: "POST", body });
    const inst = await response.json();
    select(inst.instance_id);
    await refresh();
  } catch (failure) {
    if (failure instanceof Unauthorized) return askForKey(failure.message);
    error.textContent = failure.message;
    error.hidden = false;
  }
}

async function remove(instanceId) {
  try {
    await api(`/instances/${encodeURIComponent(instanceId)}`, { method: "DELETE" });
    await refresh();
  } catch (failure) {
    if (failure instanceof Unauthorized) return askForKey(failure.message);
    $("banner").hidden = false;
    $("banner").textContent = `Could not delete ${instanceId}: ${failure.message}`;
  }
}

async function residencyChange(instanceId, change) {
  try {
    await api(`/instances/${encodeURIComponent(instanceId)}/${change}`, { method: "POST" });
    await refresh();
  } catch (failure) {
    if (failure instanceof Unauthorized) return askForKey(failure.message);
    $("banner").hidden = false;
    $("banner").textContent = `Could not ${change} ${instanceId}: ${failure.message}`;
  }
}

function select(instanceId) {
  page.selected = instanceId;
  render();
  renderTimeline();
}

async function chat(event) {
  event.preventDefault();
  const input = $("chat-input");
  const text = input.value.trim();
  if (!text) return;
  input.value = "";
  $("chat-error").hidden = true;
  page.chat.messages.push({ role: "user", content: text });
  $("chat-log").append(el("p", { class: "user" }, text));
  const answer = el("p", { class: "assistant", "data-chunks": "0", "data-done": "false" });
  $("chat-log").append(answer);
  const abort = new AbortController();
  page.chat.abort = abort;
  $("chat-stop").hidden = false;
  renderChatModels();
  const body = {
    model: $("chat-model").value,
    messages: page.chat.messages,
    stream: true,
    temperature: Number($("chat-temperature").value),
    max_tokens: Number($("chat-max-tokens").value),
  };
  try {
    const response = await api("/v1/chat/completions", { method: "POST", body, signal: abort.signal });
    let chunks = 0;
    for await (const message of serverSentEvents(response)) {
      if (message.comment || !message.data) continue;
      if (message.data === "[DONE]") break;
      const doc = JSON.parse(message.data);
      if (doc.error) throw new Error(doc.error.message);
      const delta = doc.choices?.[0]?.delta?.content ?? "";
      chunks += 1;
      answer.textContent += delta;
      answer.dataset.chunks = String(chunks);
    }
    page.chat.messages.push({ role: "assistant", content: answer.textContent });
  } catch (failure) {
    if (failure instanceof Unauthorized) return askForKey(failure.message);
    page.chat.messages.pop(); // the question had no answer: it is not part of the conversation
    $("chat-error").textContent = failure.name === "AbortError" ? "Stopped." : failure.message;
    $("chat-error").hidden = false;
  } finally {
    answer.dataset.done = "true";
    page.chat.abort = null;
    $("chat-stop").hidden = true;
    renderChatModels();
  }
}

// -- the key ---------------------------------------------------------------------------------------

function askForKey(message) {
  page.session += 1;
  page.stream?.abort();
  page.connected = false; // nothing is read until the key is given; and the daemon is not lost: no banner
  $("banner").hidden = true;
  $("connection").dataset.state = "locked";
  $("connection").textContent = "key needed";
  page.key = null;
  sessionStorage.removeItem("exod-api-key");
  page.instances = [];
  page.drawn = null;
  page.selected = null;
  page.chat.abort?.abort();
  page.chat.messages = [];
  for (const shown of ["instances", "timeline", "chat-log", "nodes", "known-models", "chat-model"]) $(shown).replaceChildren();
  page.timelines.clear();
  page.generations.clear();
  page.lastSeq = 0;
  $("main").hidden = true;
  $("main").inert = true;
  $("forget-key").hidden = true;
  $("key-prompt").hidden = false;
  $("key-error").hidden = !message;
  $("key-error").textContent = message ?? "";
  $("key-input").value = "";
  $("key-input").focus();
}

async function submitKey(event) {
  event.preventDefault();
  page.key = $("key-input").value;
  try {
    await api("/instances");
  } catch (failure) {
    return askForKey(failure instanceof Unauthorized ? "That key was refused: check it and try again." : failure.message);
  }
  sessionStorage.setItem("exod-api-key", page.key);
  $("key-input").value = "";
  start();
}

async function start() {
  $("key-prompt").hidden = true;
  $("main").hidden = false;
  $("main").inert = false;
  $("forget-key").hidden = !page.authRequired;
  try {
    await loadDiagrams();
  } catch (failure) {
    return askForKey(failure.message);
  }
  follow(page.session);
}

// -- helpers ---------------------------------------------------------------------------------------

function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  node.append(...children);
  return node;
}

function fact(label, value, key) {
  return [el("dt", {}, label), el("dd", { "data-fact": key }, value)];
}

// "loaded · last used 12 s ago · parked in 288 s": what is in memory, and for how long
function residency(inst) {
  const now = Date.now() / 1000;
  const said = [inst.residency];
  if (inst.last_used !== null) said.push(`last used ${Math.max(0, now - inst.last_used).toFixed(0)} s ago`);
  if (inst.park_at !== null) said.push(`parked ${countdown(inst.park_at)}`);
  else if (inst.residency === "loaded" && inst.keep_alive === null) said.push("kept loaded");
  return said.join(" · ");
}

function countdown(at) {
  const left = at - Date.now() / 1000;
  return left > 0 ? `in ${left.toFixed(1)} s` : "due";
}

function clock(seconds) {
  const d = new Date(seconds * 1000);
  return `${d.toLocaleTimeString([], { hour12: false })}.${String(d.getMilliseconds()).padStart(3, "0")}`;
}

function size(bytes) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${value.toFixed(unit ? 1 : 0)} ${units[unit]}`;
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// -- wiring ----------------------------------------------------------------------------------------

$("key-form").addEventListener("submit", submitKey);
$("forget-key").addEventListener("click", () => askForKey(null));
$("place-form").addEventListener("submit", place);
$("chat-form").addEventListener("submit", chat);
$("chat-stop").addEventListener("click", () => page.chat.abort?.abort());
$("chat-clear").addEventListener("click", () => {
  page.chat.messages = [];
  $("chat-log").replaceChildren();
});
$("instances").addEventListener("click", (event) => {
  const del = event.target.closest("[data-delete]");
  if (del) return remove(del.dataset.delete);
  const park = event.target.closest("[data-park], [data-unpark]");
  if (park) return residencyChange(park.dataset.park ?? park.dataset.unpark, park.dataset.park ? "park" : "unpark");
  const card = event.target.closest("[data-instance]");
  if (card) select(card.dataset.instance);
});
$("instances").addEventListener("keydown", (event) => {
  const card = event.target.closest("article[data-instance]");
  if (card && event.target === card && (event.key === "Enter" || event.key === " ")) {
    event.preventDefault();
    select(card.dataset.instance);
  }
});
setInterval(() => {
  if (page.connected) refresh().catch(reportRefresh);
}, POLL_MS);
setInterval(() => {
  for (const node of document.querySelectorAll('[data-fact="countdown"]')) {
    const inst = page.instances.find((i) => i.instance_id === node.closest("[data-instance]").dataset.instance);
    if (inst?.next_retry_at != null) node.textContent = countdown(inst.next_retry_at);
  }
}, 200);

if (page.authRequired && !page.key) askForKey(null);
else start();
