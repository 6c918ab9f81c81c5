/* The broker page: reads and acts through the JSON API next to it (/broker/api), with the
 * browser's Airflow session (the _token cookie, sent by fetch on the same origin).
 *
 * Every piece of data goes into the DOM as text (textContent, text nodes, attribute values set
 * with setAttribute): nothing the API answers is ever parsed as HTML. */
"use strict";

(() => {
  const API = new URL("../api/", document.baseURI); // /broker/ui/ -> /broker/api/
  const AIRFLOW_HOME = new URL("../../", document.baseURI); // the Airflow UI (its login)
  const REFRESH_MS = 5000;
  const PAGE_SIZE = 20;
  const HISTORY_MINUTES = 60;
  const SVG_NS = "http://www.w3.org/2000/svg";

  const view = {
    queuePage: { filter: "", offset: 0 }, // the queue list: a page of queues by name
    queueNames: [], // every queue's name (the pickers), read again when the count changes
    queueCount: null,
    conversations: { state: "", queue: "", offset: 0 },
    transmission: { offset: 0 },
    mappings: { offset: 0 },
    events: { offset: 0 },
    messages: { queue: "", conversation: "", offset: 0 }, // the queue whose messages are peeked
    queueEvents: { offset: 0 },
    depthQueue: "",
    instance: null, // this broker's instance id (from the overview)
    queues: [],
    services: [],
    busy: false,
    last: new Map(), // section -> JSON text last rendered (re-render only on change)
    readErrors: new Map(), // section -> ApiError of its last read
  };

  // -- DOM helpers ---------------------------------------------------------------------------

  /** An element with attributes and children; strings become text nodes, never HTML. */
  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key.startsWith("on") && typeof value === "function") {
        el.addEventListener(key.slice(2), value);
      } else if (key === "class") {
        el.className = value;
      } else {
        el.setAttribute(key, value === true ? "" : String(value));
      }
    }
    append(el, children);
    return el;
  }

  function append(el, children) {
    for (const child of children.flat(Infinity)) {
      if (child === null || child === undefined || child === false) continue;
      el.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return el;
  }

  function svg(tag, attrs, text) {
    const el = document.createElementNS(SVG_NS, tag);
    for (const [key, value] of Object.entries(attrs || {})) el.setAttribute(key, String(value));
    if (text !== undefined) el.textContent = String(text);
    return el;
  }

  const $ = (selector) => document.querySelector(selector);

  /**
   * Show these rows. When the table already shows the same keyed rows in the same order (the
   * usual refresh), only the cells that changed are replaced: a button being clicked, or holding
   * the keyboard's focus, is not swapped out from under the person every 5 s. A renderer opts a
   * row in with data-key, promising that its handlers depend on nothing but that key and the
   * cell's own markup.
   */
  function fill(tbody, rows, columns, emptyText) {
    if (rows.length === 0) {
      tbody.replaceChildren(
        h("tr", { class: "empty" }, h("td", { colspan: columns }, emptyText || "None."))
      );
      return;
    }
    const shown = [...tbody.rows];
    const same =
      shown.length === rows.length &&
      rows.every((row, i) => row.dataset.key !== undefined && row.dataset.key === shown[i].dataset.key);
    if (!same) {
      tbody.replaceChildren(...rows);
      return;
    }
    rows.forEach((row, i) => patchRow(shown[i], row));
  }

  function patchRow(row, next) {
    for (const { name } of [...row.attributes]) if (!next.hasAttribute(name)) row.removeAttribute(name);
    for (const { name, value } of [...next.attributes]) if (row.getAttribute(name) !== value) row.setAttribute(name, value);
    const cells = [...next.cells];
    if (cells.length !== row.cells.length) {
      row.replaceChildren(...cells);
      return;
    }
    cells.forEach((cell, i) => {
      if (!cell.isEqualNode(row.cells[i])) row.replaceChild(cell, row.cells[i]);
    });
  }

  // -- formatting ------------------------------------------------------------------------------

  function age(seconds) {
    if (seconds === null || seconds === undefined) return "—";
    const s = Math.max(0, Math.round(seconds));
    if (s < 60) return `${s} s`;
    const m = Math.floor(s / 60);
    if (m < 60) return `${m} min ${s % 60} s`;
    const hrs = Math.floor(m / 60);
    if (hrs < 48) return `${hrs} h ${m % 60} min`;
    return `${Math.floor(hrs / 24)} d ${hrs % 24} h`;
  }

  function when(iso) {
    if (!iso) return h("span", { class: "muted" }, "—");
    const d = new Date(iso);
    return h("time", { datetime: iso, title: iso }, isNaN(d) ? iso : d.toLocaleString());
  }

  function ageSince(iso) {
    return iso ? (Date.now() - new Date(iso).getTime()) / 1000 : null;
  }

  function shortId(uuid) {
    return h("code", { title: uuid }, String(uuid).slice(0, 8));
  }

  function badge(text, kind) {
    return h("span", { class: `badge ${kind || ""}` }, text);
  }

  const STATE_KIND = { CO: "ok", SO: "info", SI: "info", DI: "warn", DO: "warn", ER: "bad", CD: "muted" };

  // -- the API ---------------------------------------------------------------------------------

  class ApiError extends Error {
    constructor(status, detail) {
      super(detail);
      this.status = status;
      this.detail = detail;
    }
    toString() {
      return this.status ? `${this.status}: ${this.detail}` : this.detail;
    }
  }

  function detailOf(data, fallback) {
    if (data && typeof data === "object" && "detail" in data) {
      const d = data.detail;
      if (typeof d === "string") return d;
      if (Array.isArray(d)) {
        return d
          .map((e) => `${(e.loc || []).filter((p) => p !== "body").join(".")}: ${e.msg}`)
          .join("; ");
      }
      return JSON.stringify(d);
    }
    if (typeof data === "string" && data.trim()) return data.trim().slice(0, 300);
    return fallback;
  }

  async function api(path, options) {
    const { method = "GET", body, query } = options || {};
    const url = new URL(path, API);
    for (const [k, v] of Object.entries(query || {})) {
      if (v !== "" && v !== null && v !== undefined) url.searchParams.set(k, v);
    }
    const init = { method, credentials: "same-origin", headers: { Accept: "application/json" } };
    if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    let response;
    try {
      response = await fetch(url, init);
    } catch (exc) {
      throw new ApiError(0, `the API server did not answer (${exc.message})`);
    }
    const text = await response.text();
    let data = null;
    try {
      data = text ? JSON.parse(text) : null;
    } catch {
      data = text;
    }
    if (!response.ok) {
      throw new ApiError(response.status, detailOf(data, response.statusText || "error"));
    }
    return data;
  }

  const enc = encodeURIComponent;

  // -- messages --------------------------------------------------------------------------------

  let flashTimer = null;

  function flash(text, kind) {
    const el = $("#flash");
    el.className = `flash ${kind || "ok"}`;
    el.replaceChildren(text, " ", h("button", { type: "button", class: "link", "aria-label": "dismiss", onclick: () => (el.hidden = true) }, "×"));
    el.hidden = false;
    clearTimeout(flashTimer);
    if (kind !== "bad") flashTimer = setTimeout(() => (el.hidden = true), 8000);
  }

  function actionFailed(what, err) {
    let text = `${what} failed — ${err}`;
    if (err.status === 403) text = `${what} refused (403 Forbidden): ${err.detail}`;
    if (err.status === 401) text = `${what} refused (401): your Airflow session has ended; log in again.`;
    flash(text, "bad");
  }

  /** The banner: why reads fail, if they do (401 and 403 first: they explain everything). */
  function showBanner() {
    const banner = $("#banner");
    const errors = [...view.readErrors.values()];
    if (errors.length === 0) {
      banner.hidden = true;
      return;
    }
    const first =
      errors.find((e) => e.status === 401) ||
      errors.find((e) => e.status === 403) ||
      errors.find((e) => e.status >= 500 || e.status === 0) ||
      errors[0];
    if (first.status === 401) {
      banner.replaceChildren(
        "Not logged in to Airflow (401): ",
        first.detail,
        ". ",
        h("a", { href: AIRFLOW_HOME.href, target: "_top" }, "Log in to Airflow"),
        " and come back."
      );
    } else if (first.status === 403) {
      banner.replaceChildren(`Forbidden (403): ${first.detail}`);
    } else if (first.status === 503) {
      banner.replaceChildren(`The broker is unavailable (503): ${first.detail}`);
    } else {
      banner.replaceChildren(`The API answered ${first}`);
    }
    banner.hidden = false;
  }

  function sectionError(name, err) {
    const el = document.querySelector(`[data-error="${name}"]`);
    if (!el) return;
    if (err) {
      el.textContent = `Could not load: ${err}`;
      el.hidden = false;
    } else {
      el.hidden = true;
    }
  }

  /** Run one read: render its data when it changed; keep its error for the banner. */
  async function load(name, fetcher, render) {
    try {
      const data = await fetcher();
      view.readErrors.delete(name);
      sectionError(name, null);
      const text = JSON.stringify(data);
      if (view.last.get(name) !== text) {
        view.last.set(name, text);
        render(data);
      }
    } catch (err) {
      if (!(err instanceof ApiError)) throw err;
      view.readErrors.set(name, err);
      view.last.delete(name);
      sectionError(name, err);
    }
  }

  // -- a paged list ----------------------------------------------------------------------------

  /** Fetch one page; an offset past the end (the list shrank) falls back to the first page. */
  async function page(path, state, query) {
    try {
      return await api(path, { query: { ...query, limit: PAGE_SIZE, offset: state.offset } });
    } catch (err) {
      if (err.status === 422 && state.offset > 0) {
        state.offset = 0;
        return api(path, { query: { ...query, limit: PAGE_SIZE, offset: 0 } });
      }
      throw err;
    }
  }

  /** A count as shown: "about 1,000,000" when PostgreSQL estimated it (past 10,000 rows). */
  function total(n, estimated) {
    return estimated ? `about ${Number(n).toLocaleString("en-US")}` : `${n}`;
  }

  function pager(name, data, state) {
    const el = document.querySelector(`[data-pager="${name}"]`);
    if (data.total === 0) {
      el.replaceChildren();
      return;
    }
    const first = data.offset + 1;
    const last = data.offset + data.items.length;
    const go = (offset) => () => {
      state.offset = offset;
      view.last.delete(name);
      refresh(true);
    };
    el.replaceChildren(
      h("button", { type: "button", disabled: data.offset === 0, onclick: go(Math.max(0, data.offset - data.limit)) }, "‹ Previous"),
      h("span", { class: "muted page-position" }, ` ${first}–${last} of ${total(data.total, data.total_estimated)} `),
      h("button", { type: "button", disabled: data.next_offset === null, onclick: go(data.next_offset) }, "Next ›")
    );
  }

  // -- actions ---------------------------------------------------------------------------------

  async function act(button, what, path, body, confirmText) {
    if (confirmText && !window.confirm(confirmText)) return;
    button.disabled = true;
    try {
      const result = await api(path, { method: "POST", body });
      flash(`${what}: ${result.detail}`, result.changed === false ? "info" : "ok");
      view.last.clear();
      await refresh(true);
    } catch (err) {
      if (!(err instanceof ApiError)) throw err;
      actionFailed(what, err);
    } finally {
      button.disabled = false;
    }
  }

  // -- sections --------------------------------------------------------------------------------

  function renderOverview(o) {
    view.instance = o.instance_id;
    const identity = $("#identity");
    identity.replaceChildren(
      `instance ${o.instance_id} · ${o.engine} · ${o.database}`,
      o.forwarding ? " · forwarding" : "",
      o.principal ? " · principal" : ""
    );
    const conversations = o.conversations.reduce((n, s) => n + s.count, 0);
    const byState = o.conversations.filter((s) => s.count > 0).map((s) => `${total(s.count, s.estimated)} ${s.state_desc.toLowerCase()}`).join(", ");
    const card = (label, value, note, kind) =>
      h("div", { class: `card ${kind || ""}`, "data-card": label },
        h("div", { class: "card-label" }, label),
        h("div", { class: "card-value" }, value),
        h("div", { class: "card-note" }, note || "\u00a0"));
    $("#overview-cards").replaceChildren(
      card("Queues", o.queues, o.queues_disabled ? `${o.queues_disabled} disabled` : "all enabled", o.queues_disabled ? "bad" : "ok"),
      card(
        "Messages ready",
        o.messages_ready,
        o.messages_held || o.messages_leased
          ? `${o.messages_held || 0} held · ${o.messages_leased || 0} leased`
          : "in all queues"
      ),
      card("Conversations", total(conversations, o.conversations_estimated), byState || "none"),
      card(
        "Transmission queue",
        o.transmission_queue,
        o.transmission_queue
          ? `${o.transmissions_failing} failing · oldest ${age(ageSince(o.transmission_oldest_enqueued_at))}`
          : "nothing waiting",
        o.transmissions_failing ? "bad" : o.transmission_queue ? "warn" : ""
      ),
      card("In transit", o.in_transit === null ? "—" : o.in_transit, "between brokers"),
      card("Poison events", o.poison_events, "queues disabled by poison", o.poison_events ? "warn" : ""),
      card(
        "Consistency check",
        o.last_check_at ? `${age(ageSince(o.last_check_at))} ago` : "never",
        o.last_check_at ? o.last_check : "run airflow-broker check",
        !o.last_check_at ? "" : o.last_check === "no problems" ? "ok" : "bad"
      ),
      certificatesCard(o.certificates_expiring || [], card)
    );
    renderCertificatesExpiring(o.certificates_expiring || []);
    if (view.queueCount !== o.queues) {
      view.queueCount = o.queues; // a queue was created or dropped: the pickers read the names
      loadQueueNames();
    }
  }

  /** Dialog security's certificates that end within 30 days, or have ended. */
  function certificatesCard(certs, card) {
    const expired = certs.filter((c) => c.expired).length;
    const next = certs.find((c) => !c.expired);
    const note = [
      expired ? `${expired} expired` : "",
      next ? `next: ${next.name} on ${new Date(next.expires_at).toLocaleDateString()}` : "",
    ].filter(Boolean).join(" · ");
    return card("Certificates ending", certs.length, note || "none within 30 days",
      expired ? "bad" : certs.length ? "warn" : "");
  }

  function renderCertificatesExpiring(certs) {
    $("#certificates-expiring").hidden = certs.length === 0;
    const rows = certs.map((c) =>
      h("tr", { "data-key": c.name, "data-certificate": c.name, class: c.expired ? "disabled" : "" },
        h("th", { scope: "row", title: `subject ${c.subject} · fingerprint ${c.fingerprint}` }, c.name),
        h("td", null, c.owner),
        h("td", null, when(c.expires_at)),
        h("td", null, c.expired
          ? badge("EXPIRED", "bad")
          : badge(`in ${Math.max(0, Math.floor((new Date(c.expires_at) - Date.now()) / 86400000))} days`, "warn")),
        h("td", null, c.has_private_key ? "yes" : "no"))
    );
    fill($("#certificates-table tbody"), rows, 5, "None.");
  }

  function renderQueues(data) {
    const queues = data.items;
    view.queues = queues;
    const rows = queues.map((q) => {
      const disabled = q.status !== "enabled";
      const last = q.last_poison_event;
      return h("tr", { "data-key": q.name, "data-queue": q.name, class: disabled ? "disabled" : "" },
        h("th", { scope: "row" }, q.name,
          q.retention ? h("span", { class: "tag", title: "RETENTION = ON" }, "retention") : null,
          q.activation ? h("span", { class: "tag", title: JSON.stringify(q.activation) }, "activation") : null),
        h("td", { class: "status" },
          disabled ? badge("DISABLED", "bad") : badge("enabled", "ok"),
          q.poison_message_handling ? null : h("span", { class: "tag", title: "POISON_MESSAGE_HANDLING = OFF" }, "no poison handling")),
        h("td", { class: "num depth", title: "messages a reader could take now" }, q.depth),
        notReady(q),
        h("td", { class: "oldest" }, q.depth ? age(q.oldest_age_seconds) : h("span", { class: "muted" }, "—")),
        h("td", { class: "readers" },
          `${q.readers_running} running`,
          q.readers_starting ? `, ${q.readers_starting} starting` : "",
          q.groups_ready ? h("div", { class: "muted" }, `${q.groups_ready} group(s) ready`) : null),
        h("td", { class: `num ${q.rollback_count ? "warn-text" : ""}` }, q.rollback_count),
        h("td", { class: "poison" },
          q.poison_events ? `${q.poison_events}` : h("span", { class: "muted" }, "0"),
          last ? h("div", { class: "muted small", title: last.detail }, "last: ", when(last.occurred_at)) : null),
        h("td", null, q.services.join(", ") || h("span", { class: "muted" }, "—")),
        h("td", { class: "actions" },
          disabled
            ? h("button", {
                type: "button", class: "primary", "data-action": "enable",
                onclick: (ev) => act(ev.currentTarget, `Re-enable queue ${q.name}`, `queues/${enc(q.name)}/enable`),
              }, "Re-enable")
            : null,
          h("button", {
            type: "button", "data-action": "messages",
            onclick: () => {
              selectMessagesQueue(q.name);
              $("#queue").scrollIntoView({ behavior: "smooth" });
            },
          }, "Messages"),
          h("button", {
            type: "button",
            onclick: () => {
              selectDepthQueue(q.name);
              $("#depth").scrollIntoView({ behavior: "smooth" });
            },
          }, "Depth chart"))
      );
    });
    fill($("#queues-table tbody"), rows, 10, view.queuePage.filter ? "No queue matches." : "No queues.");
    pager("queues", data, view.queuePage);
    // None chosen yet: the deepest queue of the page.
    const deepest = [...queues].sort((a, b) => b.depth - a.depth)[0];
    if (!view.messages.queue && deepest) selectMessagesQueue(deepest.name);
    if (!view.depthQueue && deepest) selectDepthQueue(deepest.name);
  }

  /** Every queue's name, for the pickers (names only: no counts, one index read). */
  function loadQueueNames() {
    return api("queue-names").then(
      (names) => {
        view.queueNames = names;
        syncSelect($("#depth-queue"), names, null);
        syncSelect($("#messages-queue"), names, null);
        syncSelect($("#conversation-queue"), names, "all queues");
        if (view.messages.queue && !names.includes(view.messages.queue)) {
          selectMessagesQueue(""); // the chosen one was dropped
        }
      },
      (err) => {
        if (!(err instanceof ApiError)) throw err;
        view.queueCount = null; // try again on the next round
      }
    );
  }

  /**
   * A queue's messages no reader could take now, apart from its depth: "2 held until 12:04"
   * (their groups wait out a failed attempt's backoff; the time is when the first hold ends)
   * and "1 leased" (a lease holds their group).
   */
  function notReady(q) {
    const held = q.held || 0;
    const leased = q.leased || 0;
    if (!held && !leased) return h("td", { class: "not-ready" }, h("span", { class: "muted" }, "—"));
    return h("td", { class: "not-ready" },
      held
        ? h("div", {
            class: "held",
            title: "their conversation groups wait out the backoff of a failed attempt (retry_delay); " +
              "the first can be taken again at the time shown",
          }, `${held} held`, q.held_until ? [" until ", clock(q.held_until)] : "")
        : null,
      leased
        ? h("div", { class: "leased", title: "a lease holds their conversation group (Broker.lease)" }, `${leased} leased`)
        : null);
  }

  /** A time of day ("12:04"), with the date when it is not within a day; the full time on hover. */
  function clock(iso) {
    const d = new Date(iso);
    if (isNaN(d)) return iso;
    const soon = Math.abs(d.getTime() - Date.now()) < 86400000;
    const text = soon
      ? d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" })
      : d.toLocaleString([], { dateStyle: "short", timeStyle: "short" });
    return h("time", { datetime: iso, title: d.toLocaleString() }, text);
  }

  /** Keep a select's options in step with a list of names, keeping the choice. */
  function syncSelect(select, names, allLabel) {
    const wanted = (allLabel === null ? [] : [""]).concat(names);
    const have = [...select.options].map((o) => o.value);
    if (JSON.stringify(have) === JSON.stringify(wanted)) return;
    const value = select.value;
    select.replaceChildren(
      ...wanted.map((n) => h("option", { value: n }, n === "" ? allLabel : n))
    );
    if (wanted.includes(value)) select.value = value;
  }

  function selectDepthQueue(name) {
    view.depthQueue = name;
    $("#depth-queue").value = name;
    view.last.delete("depth");
    loadDepth();
  }

  function loadDepth() {
    const name = view.depthQueue;
    const chart = $("#depth-chart");
    if (!name) {
      chart.replaceChildren(h("p", { class: "muted" }, "No queue selected."));
      return Promise.resolve();
    }
    return api(`queues/${enc(name)}/depth-history`, { query: { minutes: HISTORY_MINUTES } }).then(
      (data) => {
        if (name !== view.depthQueue) return;
        const text = JSON.stringify(data);
        if (view.last.get("depth") === text) return;
        view.last.set("depth", text);
        drawDepth(chart, name, (data && data.samples) || []);
      },
      (err) => {
        if (!(err instanceof ApiError)) throw err;
        if (name !== view.depthQueue) return;
        view.last.delete("depth");
        chart.replaceChildren(
          err.status === 404
            ? h("p", { class: "muted no-history" }, `No history yet for ${name}.`)
            : h("p", { class: "section-error" }, `Could not load the depth history: ${err}`)
        );
      }
    );
  }

  // -- a queue's waiting messages (peek) and its failure-handling events -------------------------

  const NO_ROWS = { items: [], total: 0, limit: PAGE_SIZE, offset: 0, next_offset: null };

  function selectMessagesQueue(name) {
    const m = view.messages;
    if (m.queue !== name) {
      m.queue = name;
      m.conversation = "";
      m.offset = 0;
      view.queueEvents.offset = 0;
    }
    $("#messages-queue").value = name;
    view.last.delete("messages");
    view.last.delete("queue-events");
    refresh(true);
  }

  function filterConversation(handle) {
    view.messages.conversation = handle;
    view.messages.offset = 0;
    view.last.delete("messages");
    refresh(true);
  }

  function loadMessages() {
    const m = view.messages;
    if (!m.queue) return Promise.resolve({ ...NO_ROWS, queue: "", enabled: true, retention: false, retained: 0 });
    return page(`queues/${enc(m.queue)}/messages`, m, { conversation_handle: m.conversation });
  }

  function loadQueueEvents() {
    const name = view.messages.queue;
    return name ? page(`queues/${enc(name)}/events`, view.queueEvents) : Promise.resolve(NO_ROWS);
  }

  /** A body preview: UTF-8 text, or the base64 of a binary body's first bytes. */
  function bodyPreview(b) {
    if (!b || b.encoding === null) return h("span", { class: "muted" }, "no body");
    const size = `${b.size} byte${b.size === 1 ? "" : "s"}`;
    const more = b.truncated ? h("span", { class: "muted" }, `… (${size})`) : null;
    if (b.encoding === "base64") {
      return [badge("binary", "muted"), " ", h("code", { title: `${size}; base64 of its first bytes` }, b.text), more];
    }
    return [h("code", { title: size }, b.text), more];
  }

  function deadLetterCell(d) {
    if (!d) return h("span", { class: "muted" }, "—");
    return h("span", { title: d.reason }, d.queue,
      h("div", { class: "muted small" }, `after ${d.receive_count} receive(s) · `, shortId(d.conversation_handle)));
  }

  function renderMessages(data) {
    const m = view.messages;
    const notes = [`${data.total} waiting`];
    if (data.retention) notes.push(`retention on: ${data.retained} received or sent message(s) kept, not listed`);
    if (!data.enabled) notes.push("queue DISABLED: RECEIVE refuses it");
    $("#messages-summary").textContent = m.queue ? notes.join(" · ") : "";
    $("#messages-filter").replaceChildren(
      m.conversation
        ? h("button", { type: "button", class: "chip active", title: "show the whole queue", onclick: () => filterConversation("") },
            "conversation ", String(m.conversation).slice(0, 8), " ×")
        : ""
    );
    const rows = data.items.map((w) =>
      h("tr", { "data-message": w.queuing_order },
        h("td", { class: "num" }, w.message_sequence_number),
        h("td", null,
          h("button", {
            type: "button", class: "handle", title: `only conversation ${w.conversation_handle}`,
            onclick: () => filterConversation(w.conversation_handle),
          }, String(w.conversation_handle).slice(0, 8)),
          h("div", { class: "muted small", title: `conversation group ${w.conversation_group_id}` },
            "group ", String(w.conversation_group_id).slice(0, 8))),
        h("td", null, w.message_type_name),
        h("td", { class: "body-preview" }, bodyPreview(w.body_preview)),
        h("td", { title: w.enqueued_at || "" }, age(w.age_seconds)),
        h("td", { class: `num receives ${w.receive_count ? "warn-text" : ""}` }, w.receive_count),
        h("td", { class: "num" }, w.priority),
        h("td", null, deadLetterCell(w.dead_letter)))
    );
    fill($("#messages-table tbody"), rows, 8, m.queue ? `No messages waiting in ${m.queue}.` : "No queue selected.");
    pager("messages", data, m);
  }

  function renderQueueEvents(data) {
    const rows = data.items.map((e) =>
      h("tr", { class: BAD_EVENT.test(e.event) ? "bad-event" : "", "data-event": e.event },
        h("td", null, when(e.occurred_at)),
        h("td", null, badge(e.event, BAD_EVENT.test(e.event) ? "bad" : "info")),
        h("td", { class: "detail" }, e.detail))
    );
    fill($("#queue-events-table tbody"), rows, 3, "No messages dead-lettered from this queue; never disabled.");
    pager("queue-events", data, view.queueEvents);
  }

  /** A round step for about four gridlines up to ``value`` (1, 2 or 5 times a power of ten). */
  function niceStep(value) {
    const raw = Math.max(value, 1) / 4;
    const pow = 10 ** Math.floor(Math.log10(raw));
    for (const step of [1, 2, 5, 10]) if (step * pow >= raw) return Math.max(1, step * pow);
    return 10 * pow;
  }

  function drawDepth(chart, name, samples) {
    const points = samples
      .map((s) => ({ t: new Date(s.at).getTime(), d: Number(s.depth) }))
      .filter((p) => !isNaN(p.t) && !isNaN(p.d))
      .sort((a, b) => a.t - b.t);
    if (points.length === 0) {
      chart.replaceChildren(h("p", { class: "muted no-history" }, `No history yet for ${name}.`));
      return;
    }
    const W = 860, H = 220, L = 48, R = 16, T = 14, B = 28;
    const end = Date.now();
    const start = end - HISTORY_MINUTES * 60 * 1000;
    const step = niceStep(Math.max(...points.map((p) => p.d)));
    const top = Math.max(step, Math.ceil(Math.max(...points.map((p) => p.d)) / step) * step);
    const x = (t) => L + ((Math.max(t, start) - start) / (end - start)) * (W - L - R);
    const y = (d) => T + (1 - d / top) * (H - T - B);
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", class: "depth-svg", preserveAspectRatio: "xMidYMid meet" });
    root.append(svg("title", {}, `Depth of ${name}, last ${HISTORY_MINUTES} minutes`));
    for (let v = 0; v <= top; v += step) {
      root.append(svg("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), class: "grid" }));
      root.append(svg("text", { x: L - 6, y: y(v) + 4, "text-anchor": "end", class: "axis" }, v));
    }
    for (let m = HISTORY_MINUTES; m >= 0; m -= 15) {
      const t = end - m * 60 * 1000;
      root.append(svg("line", { x1: x(t), x2: x(t), y1: T, y2: H - B, class: "grid" }));
      root.append(svg("text", { x: x(t), y: H - 8, "text-anchor": "middle", class: "axis" }, m === 0 ? "now" : `-${m} min`));
    }
    // A step line: the depth holds until the next sample, the last one until now.
    const path = [];
    points.forEach((p, i) => {
      path.push(i === 0 ? `M${x(p.t)},${y(p.d)}` : `H${x(p.t)}V${y(p.d)}`);
    });
    path.push(`H${x(end)}`);
    const line = path.join("");
    const first = points[0];
    root.append(svg("path", { d: `${line}V${y(0)}H${x(first.t)}Z`, class: "area" }));
    root.append(svg("path", { d: line, class: "line" }));
    const lastPoint = points[points.length - 1];
    root.append(svg("circle", { cx: x(lastPoint.t), cy: y(lastPoint.d), r: 3.5, class: "dot" }));
    const peak = Math.max(...points.map((p) => p.d));
    chart.replaceChildren(
      root,
      h("p", { class: "muted small" },
        `${points.length} sample${points.length === 1 ? "" : "s"} · now ${lastPoint.d} · peak ${peak} · since ${new Date(first.t).toLocaleTimeString()}`)
    );
  }

  function renderStates(states) {
    const all = states.reduce((n, s) => n + s.count, 0);
    const chip = (value, label, count) =>
      h("button", {
        type: "button",
        class: `chip ${view.conversations.state === value ? "active" : ""}`,
        "aria-pressed": view.conversations.state === value ? "true" : "false",
        "data-state": value,
        onclick: () => {
          view.conversations.state = value;
          view.conversations.offset = 0;
          view.last.delete("conversations");
          view.last.delete("states");
          refresh(true);
        },
      }, label, " ", h("span", { class: "count" }, count));
    $("#state-chips").replaceChildren(
      chip("", "All", total(all, states.some((s) => s.estimated))),
      ...states.map((s) => chip(s.state, s.state_desc, total(s.count, s.estimated)))
    );
  }

  function renderConversations(data) {
    const rows = data.items.map((c) =>
      h("tr", { "data-key": c.conversation_handle, "data-conversation": c.conversation_handle },
        h("td", null, shortId(c.conversation_handle)),
        h("td", null, c.service_name, h("span", { class: "muted" }, " → "), c.far_service,
          c.far_broker_instance && c.far_broker_instance !== view.instance
            ? h("div", { class: "muted small", title: "far broker instance" }, c.far_broker_instance)
            : null),
        h("td", null, c.contract_name),
        h("td", null, badge(c.state_desc, STATE_KIND[c.state])),
        h("td", null, c.queue),
        h("td", null, c.is_initiator ? "initiator" : "target"),
        h("td", { class: "num" }, c.messages_ready),
        h("td", { class: "num" }, c.transmissions_waiting),
        h("td", null, when(c.created_at)),
        h("td", { class: "actions" },
          h("button", {
            type: "button", class: "danger", "data-action": "end",
            onclick: (ev) => act(
              ev.currentTarget,
              `End conversation ${c.conversation_handle}`,
              `conversations/${enc(c.conversation_handle)}/end`,
              { cleanup: true },
              `END CONVERSATION ${c.conversation_handle} WITH CLEANUP?\n\n` +
                "Its messages are removed and the far side is not told."
            ),
          }, "End (cleanup)"))
      )
    );
    fill($("#conversations-table tbody"), rows, 10, "No conversations match.");
    pager("conversations", data, view.conversations);
  }

  function renderTransmission(data) {
    $("#transmission-summary").replaceChildren(
      ...(data.summary.length
        ? data.summary.map((s) =>
            h("span", { class: "pill" }, h("strong", null, s.count), ` to ${s.to_service_name}: ${s.transmission_status}`,
              s.oldest_enqueued_at ? h("span", { class: "muted" }, ` (oldest ${age(ageSince(s.oldest_enqueued_at))})`) : null))
        : [h("span", { class: "muted" }, "Nothing waiting to leave.")])
    );
    const rows = data.items.map((t) =>
      h("tr", { "data-key": t.id, "data-transmission": t.id },
        h("td", { class: "num" }, t.id),
        h("td", null, shortId(t.conversation_handle)),
        h("td", null, t.from_service_name, h("span", { class: "muted" }, " → "), t.to_service_name,
          t.to_broker_instance && t.to_broker_instance !== view.instance
            ? h("div", { class: "muted small", title: "far broker instance" }, t.to_broker_instance)
            : null),
        h("td", null, t.message_type_name),
        h("td", { class: "num" }, t.message_sequence_number),
        h("td", null, age(t.age_seconds)),
        h("td", { class: "reason" }, t.transmission_status || h("span", { class: "muted" }, "waiting for the next pass")),
        h("td", { class: `num ${t.attempts > 1 ? "warn-text" : ""}` }, t.attempts),
        h("td", null, when(t.next_attempt_at)),
        h("td", { class: "actions" },
          h("button", {
            type: "button", "data-action": "retry",
            onclick: (ev) => act(ev.currentTarget, `Retry conversation ${t.conversation_handle}`,
              `transmission-queue/${enc(t.conversation_handle)}/retry`, { deliver: true }),
          }, "Retry"),
          h("button", {
            type: "button", class: "danger", "data-action": "drop",
            onclick: (ev) => act(ev.currentTarget, `Drop message ${t.id}`,
              `transmission-queue/${enc(t.conversation_handle)}/drop`, { message_id: t.id },
              `Drop message ${t.id} (${t.message_type_name} to ${t.to_service_name})?\n\nIt is deleted and never delivered.`),
          }, "Drop"))
      )
    );
    fill($("#transmission-table tbody"), rows, 10, "The transmission queue is empty.");
    pager("transmission", data, view.transmission);
  }

  function renderServices(services) {
    view.services = services;
    const rows = services.map((s) =>
      h("tr", { "data-key": s.name, "data-service": s.name },
        h("th", { scope: "row" }, s.name, s.routing_service ? h("span", { class: "tag" }, "routing") : null),
        h("td", null, s.queue),
        h("td", null, s.contracts.join(", ") || h("span", { class: "muted" }, "— (initiator only)")),
        h("td", { class: "num", title: s.conversations === null ? "not counted: more than 10,000 conversations (filter the conversation list by service)" : null },
          s.conversations === null ? h("span", { class: "muted" }, "many") : s.conversations))
    );
    fill($("#services-table tbody"), rows, 4, "No services.");
    syncSelect($("#probe-service"), services.map((s) => s.name), null);
  }

  function renderContracts(contracts) {
    const rows = contracts.map((c) =>
      h("tr", null,
        h("th", { scope: "row" }, c.name),
        h("td", null, h("ul", { class: "plain" },
          Object.entries(c.message_types).map(([type, sender]) =>
            h("li", null, type, h("span", { class: "muted" }, ` (${sender}, ${c.validation[type] || "none"})`))))),
        h("td", null, c.services.join(", ") || h("span", { class: "muted" }, "—")))
    );
    fill($("#contracts-table tbody"), rows, 3, "No contracts.");
  }

  function renderRoutes(routes) {
    const rows = routes.map((r) =>
      h("tr", { class: r.expired ? "expired" : "" },
        h("th", { scope: "row" }, r.name),
        h("td", null, r.service_name || h("span", { class: "muted" }, "any")),
        h("td", null, r.broker_instance || h("span", { class: "muted" }, "any")),
        h("td", null, h("code", null, r.address)),
        h("td", null, r.mirror_address ? h("code", null, r.mirror_address) : h("span", { class: "muted" }, "—")),
        h("td", null, r.kind),
        h("td", null, r.expired ? badge("expired", "bad") : when(r.expires_at)))
    );
    fill($("#routes-table tbody"), rows, 7, "No routes.");
  }

  function renderRoutingServices(items) {
    const rows = items.map((r) =>
      h("tr", null,
        h("th", { scope: "row" }, r.name),
        h("td", null, r.queue),
        h("td", null, r.mode),
        h("td", null, h("code", null, r.classifier)),
        h("td", { class: "num" }, r.mappings))
    );
    fill($("#routing-services-table tbody"), rows, 5, "No routing services.");
  }

  function renderMappings(data) {
    const rows = data.items.map((m) =>
      h("tr", null,
        h("td", null, shortId(m.inbound_handle)),
        h("td", null, shortId(m.outbound_handle)),
        h("td", null, m.routing_service, h("span", { class: "muted" }, " → "), m.target_service),
        h("td", null, `${m.inbound_state || "gone"} / ${m.outbound_state || "gone"}`),
        h("td", null, when(m.created_at)))
    );
    fill($("#mappings-table tbody"), rows, 5, "No mappings.");
    pager("mappings", data, view.mappings);
  }

  const BAD_EVENT = /disabled|error|fail|poison|drop|expired|dead/i;

  function renderEvents(data) {
    const rows = data.items.map((e) =>
      h("tr", { class: BAD_EVENT.test(e.event) ? "bad-event" : "", "data-event": e.event },
        h("td", null, when(e.occurred_at)),
        h("td", null, badge(e.event, BAD_EVENT.test(e.event) ? "bad" : "info")),
        h("td", null, e.object_name),
        h("td", { class: "detail" }, e.detail))
    );
    fill($("#events-table tbody"), rows, 4, "No events.");
    pager("events", data, view.events);
  }

  // -- the echo probe --------------------------------------------------------------------------

  async function sendProbe(ev) {
    ev.preventDefault();
    const out = $("#probe-result");
    const service = $("#probe-service").value;
    const timeout = Number($("#probe-timeout").value) || 60;
    const button = ev.target.querySelector("button[type=submit]");
    if (!service) {
      out.replaceChildren(h("p", { class: "section-error" }, "Choose a service."));
      return;
    }
    button.disabled = true;
    out.replaceChildren(h("p", null, `Sending a probe to ${service}…`));
    try {
      let probe = await api("probes", { method: "POST", body: { service, timeout_seconds: timeout } });
      const deadline = Date.now() + (timeout + 10) * 1000;
      while (probe.status === "waiting" && Date.now() < deadline) {
        out.replaceChildren(h("p", null, `${probe.probe_id}: waiting for ${service} to answer… (${age(ageSince(probe.sent_at))})`));
        await new Promise((r) => setTimeout(r, 1000));
        probe = await api(`probes/${enc(probe.probe_id)}`);
      }
      const ok = probe.status === "alive";
      out.replaceChildren(
        h("p", { class: ok ? "probe-ok" : "section-error" },
          badge(probe.status, ok ? "ok" : "bad"), " ",
          ok
            ? `${service} answered: round trip ${Number(probe.round_trip_ms).toFixed(1)} ms`
            : `${service}: ${probe.detail || "no answer"}`,
          h("span", { class: "muted" }, ` (${probe.probe_id})`))
      );
    } catch (err) {
      if (!(err instanceof ApiError)) throw err;
      out.replaceChildren(
        h("p", { class: "section-error" },
          err.status === 403 ? `Probe refused (403 Forbidden): ${err.detail}` : `Probe failed — ${err}`)
      );
    } finally {
      button.disabled = false;
    }
  }

  // -- refreshing ------------------------------------------------------------------------------

  /** Refresh every section. The timer skips a round while one runs; a user's change (a filter,
   * a page, an action) queues one more round after it, so what they asked for shows at once. */
  async function refresh(asked) {
    if (view.busy) {
      if (asked) view.again = true;
      return;
    }
    view.busy = true;
    try {
      do {
        view.again = false;
        await refreshOnce();
      } while (view.again);
    } finally {
      view.busy = false;
      showBanner();
    }
  }

  async function refreshOnce() {
    const c = view.conversations;
    // The overview first, once: the other sections compare with this broker's instance id.
    const overview = load("overview", () => api("overview"), renderOverview);
    if (view.instance === null) await overview;
    await Promise.all([
      overview,
      load("queues", () => page("queues", view.queuePage, { name_contains: view.queuePage.filter || undefined }), renderQueues),
      load("states", () => api("conversations/states", { query: { queue: c.queue } }), renderStates),
      load("conversations", () => page("conversations", c, { state: c.state, queue: c.queue }), renderConversations),
      load("transmission", () => page("transmission-queue", view.transmission), renderTransmission),
      load("services", () => api("services"), renderServices),
      load("contracts", () => api("contracts"), renderContracts),
      load("routing", () => api("routes"), renderRoutes),
      load("routing-services", () => api("routing-services"), renderRoutingServices),
      load("mappings", () => page("routing-mappings", view.mappings), renderMappings),
      load("events", () => page("events", view.events), renderEvents),
      load("messages", loadMessages, renderMessages),
      load("queue-events", loadQueueEvents, renderQueueEvents),
    ]);
    await loadDepth();
    $("#updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  }

  function start() {
    $("#refresh-now").addEventListener("click", () => {
      view.last.clear();
      refresh(true);
    });
    $("#depth-queue").addEventListener("change", (ev) => selectDepthQueue(ev.target.value));
    $("#messages-queue").addEventListener("change", (ev) => selectMessagesQueue(ev.target.value));
    $("#conversation-queue").addEventListener("change", (ev) => {
      view.conversations.queue = ev.target.value;
      view.conversations.offset = 0;
      refresh(true);
    });
    $("#queue-filter").addEventListener("input", (ev) => {
      view.queuePage.filter = ev.target.value.trim();
      view.queuePage.offset = 0;
      view.last.delete("queues");
      refresh(true);
    });
    $("#probe-form").addEventListener("submit", sendProbe);
    setInterval(() => {
      if ($("#auto-refresh").checked && !document.hidden) refresh();
    }, REFRESH_MS);
    refresh();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
