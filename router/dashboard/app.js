// llama-router dashboard: plain JavaScript modules, no dependencies, no build step.
//
// What it reads (api.js: relative to the router's root, with the API key):
//   models            the model table, every few seconds and shortly after status events
//   models/sse        live status events
//   props             the budgets (llama_router: memory_budget, memory_total, gpus[])
//   activity          the last requests (?after=ID: only the ones not shown yet)
//   activity/totals   per-model running totals for the charts (?since=SEQ: changed ones only)
//   usage             what each team (its keys' name=) used per model
//   logs, logs/stream the selected model's output, or the router's own log
// and what it does: models/load, models/unload, both for a reload, POST models for a pull.

import {api, getJSON, hasKey, keyEntered, onUnauthorized, post, readData, setKey} from './api.js';
import {ALL, Samples, drawChart, lastValue} from './charts.js';
import {$, el, fmtBytes, fmtClock, fmtRate, fmtSeconds, sleep} from './format.js';
import {LogPane} from './logs.js';
import {ModelTable, holdsProcess, statusKey} from './models.js';

const TICK_MS = 1500;            // activity and chart sampling
const USAGE_EVERY = 4;           // /usage every this many ticks
const MODELS_REFRESH_MS = 4000;  // /models: measured memory, in-flight counts, pids
const EVENT_REFRESH_MS = 250;    // /models again this soon after a status event
const ACTIVITY_ROWS = 200;

const table = new ModelTable($('model-rows'));
const samples = new Samples();
const logs = new LogPane($('log'), $('log-follow'));
let budgets = null;  // /props llama_router
let selected = null;

// ------------------------------------------------------------------ banner, connection, key

let bannerTimer = null;

function notify(message, kind = 'error') {
  $('banner-text').textContent = message;
  $('banner').className = 'banner' + (kind === 'error' ? '' : ' ' + kind);
  $('banner').hidden = false;
  clearTimeout(bannerTimer);
  bannerTimer = setTimeout(() => { $('banner').hidden = true; }, kind === 'error' ? 15000 : 6000);
}

function setConn(state, text) {
  $('conn').dataset.state = state;
  $('conn').textContent = text;
}

function showKeyPanel(message) {
  $('key-message').textContent = message;
  if ($('key-panel').hidden) {
    $('key-panel').hidden = false;
    $('key-input').value = '';
    $('key-input').focus();
  }
}

const askingForKey = () => !$('key-panel').hidden;

onUnauthorized((message) => {
  setConn('auth', 'API key needed');
  showKeyPanel(hasKey()
    ? 'The router refused this key: ' + message
    : 'This router requires an API key. It is kept in this tab only (sessionStorage) and ' +
      'sent as Authorization: Bearer.');
});

function useKey(key) {
  $('key-panel').hidden = true;
  setKey(key);
  refreshModels();
  loadBudgets();
}

// ------------------------------------------------------------------ models

let refreshing = null;
let refreshAgain = false;
let refreshTimer = null;

async function refreshModels() {
  if (refreshing) {
    refreshAgain = true;
    return refreshing;
  }
  refreshing = (async () => {
    try {
      table.apply((await getJSON('models')).data || []);
      if (selected !== null && !table.get(selected)) select(null);
      modelsChanged();
    } catch (err) {
      if (err.status !== 401) notify('Model list: ' + err.message);
    }
  })();
  try {
    await refreshing;
  } finally {
    refreshing = null;
  }
  if (refreshAgain) {
    refreshAgain = false;
    return refreshModels();
  }
}

function scheduleRefresh(delay = EVENT_REFRESH_MS) {
  if (refreshTimer) return;
  refreshTimer = setTimeout(() => {
    refreshTimer = null;
    refreshModels();
  }, delay);
}

function modelsChanged() {
  const {total, loaded} = table.counts();
  $('model-count').textContent = total + ' models, ' + loaded + ' loaded';
  $('models-empty').hidden = total > 0;
  updateBudgets();
}

// Reload waits for a model to leave ``loaded``: resolved by the events.
const statusWaiters = new Set();

function waitForStatus(id, test, timeoutMs) {
  const m = table.get(id);
  if (m && test(statusKey(m.data))) return Promise.resolve(true);
  return new Promise((resolve) => {
    const waiter = {id, test, resolve};
    statusWaiters.add(waiter);
    setTimeout(() => {
      if (statusWaiters.delete(waiter)) resolve(false);
    }, timeoutMs);
  });
}

function onEvent(event) {
  const data = event.data || {};
  if (event.model !== '*' && !table.applyEvent(event)) {
    scheduleRefresh();  // a model this page has not seen yet
    return;
  }
  const m = table.get(event.model);
  if (m) {
    for (const waiter of statusWaiters) {
      if (waiter.id === event.model && waiter.test(statusKey(m.data))) {
        statusWaiters.delete(waiter);
        waiter.resolve(true);
      }
    }
  }
  switch (event.event) {
    case 'model_status':
    case 'status_change':
      modelsChanged();
      if (!data.progress) scheduleRefresh();  // pid, memory, failure details
      return;
    case 'queued':
    case 'download_progress':
      return;
    case 'slot_states':  // warm swaps: the model's saved slots (status.states)
      scheduleRefresh();
      return;
    case 'download_finished':
      notify('Downloaded ' + event.model, 'info');
      scheduleRefresh();
      return;
    case 'download_failed':
      if (data.error !== 'cancelled') notify('Download of ' + event.model + ' failed: ' + data.error);
      scheduleRefresh();
      return;
    case 'model_remove':
      table.remove(event.model);
      if (selected === event.model) select(null);
      modelsChanged();
      return;
    case 'models_reload':
      loadBudgets();
      scheduleRefresh();
      return;
    case 'models_reload_failed':
      notify('Configuration rejected, the previous one stays in effect:\n' +
             (data.errors || []).join('\n'));
      return;
    default:
      // stopping, replica_restarted, events_dropped, and events newer than this page: the
      // model list says what changed, if anything.
      scheduleRefresh();
  }
}

async function followEvents() {
  let delay = 500;
  for (;;) {
    try {
      const response = await api('models/sse');
      setConn('live', 'live');
      delay = 500;
      refreshModels();  // anything missed while disconnected
      await readData(response, (text) => {
        let event;
        try {
          event = JSON.parse(text);
        } catch (err) {
          console.warn('not an event:', text);
          return;
        }
        onEvent(event);
      });
      setConn('connecting', 'reconnecting…');
    } catch (err) {
      if (err.status === 401) {
        await keyEntered();
        continue;
      }
      setConn('offline', 'offline: ' + err.message);
    }
    await sleep(delay);
    delay = Math.min(delay * 2, 10000);
  }
}

// ------------------------------------------------------------------ actions

const BUSY = {load: 'loading…', unload: 'unloading…', reload: 'reloading…'};

async function act(m, action) {
  const id = m.data.id;
  m.busy = BUSY[action];
  table.update(m);
  try {
    if (action === 'unload' || action === 'reload') await post('models/unload', {model: id});
    if (action === 'reload') {
      await waitForStatus(id, (k) => k !== 'loaded' && k !== 'stopping', 60000);
    }
    if (action === 'load' || action === 'reload') await post('models/load', {model: id});
  } catch (err) {
    notify(action[0].toUpperCase() + action.slice(1) + ' ' + id + ': ' + err.message);
  } finally {
    m.busy = '';
    table.update(m);
    scheduleRefresh(0);
  }
}

async function pull() {
  const name = $('pull-input').value.trim();
  if (!name) {
    notify('Name a Hugging Face model to pull: owner/repo or owner/repo:QUANT');
    return;
  }
  $('pull-button').disabled = true;
  try {
    const answer = await (await post('models', {model: name})).json();
    notify('Downloading ' + (answer.model || name) + ' …', 'info');
    $('pull-input').value = '';
    scheduleRefresh(0);
  } catch (err) {
    notify('Pull ' + name + ': ' + err.message);
  } finally {
    $('pull-button').disabled = false;
  }
}

// ------------------------------------------------------------------ budgets

async function loadBudgets() {
  try {
    budgets = (await getJSON('props')).llama_router || null;
  } catch (err) {
    budgets = null;
  }
  table.setMemoryBudget(budgets ? budgets.memory_budget : null);
  updateBudgets();
}

function budgetView(label, used, budget, total) {
  const box = el('div', 'budget');
  const limit = budget || total;
  box.append(el('span', '', label + ': ' + fmtBytes(used) +
    (budget ? ' of ' + fmtBytes(budget) + ' budget' : ' (no budget)') +
    (total && total !== budget ? ' · ' + fmtBytes(total) + ' total' : '')));
  if (limit) {
    const meter = el('span', 'meter' + (budget && used > budget ? ' over' : ''));
    const fill = el('span');
    fill.style.width = Math.min(100, (100 * used) / limit).toFixed(1) + '%';
    meter.append(fill);
    box.append(meter);
  }
  return box;
}

let budgetsShown = '';

function updateBudgets() {
  if (!budgets) {
    $('budgets').replaceChildren();
    budgetsShown = '';
    return;
  }
  // What the scheduler counts: the larger of estimate and measured, per model holding memory.
  let ram = 0;
  let running = 0;
  const gpu = {};
  for (const m of table.models.values()) {
    if (!holdsProcess(m.data)) continue;
    running++;
    const mem = (m.data.status || {}).memory || {};
    ram += Math.max(mem.estimate || 0, mem.measured || 0);
    for (const [pool, g] of Object.entries(mem.gpus || {})) {
      gpu[pool] = (gpu[pool] || 0) + Math.max(g.estimate || 0, g.measured || 0);
    }
  }
  const shown = JSON.stringify([ram, gpu, running, budgets]);
  if (shown === budgetsShown) return;
  budgetsShown = shown;
  const views = [budgetView('RAM', ram, budgets.memory_budget, budgets.memory_total)];
  for (const g of budgets.gpus || []) {
    views.push(budgetView(g.pool + ' (' + g.name + ')', gpu[g.pool] || 0, g.budget, g.total));
  }
  const count = el('div', 'budget');
  count.append(el('span', '', 'running: ' + running +
    (budgets.models_max > 0 ? ' of ' + budgets.models_max + ' models' : ' models (no limit)')));
  views.push(count);
  $('budgets').replaceChildren(...views);
}

// ------------------------------------------------------------------ activity and charts

let lastActivity = 0;

const activityHidden = (model) => $('activity-only').checked && selected !== null &&
                                  model !== selected;

function addActivity(records) {
  const tbody = $('activity-rows');
  const fragment = document.createDocumentFragment();
  for (const r of records) {  // newest first
    const row = el('tr');
    row.dataset.model = r.model;
    row.append(
      el('td', '', fmtClock(r.time)),
      el('td', '', r.model || '–'),
      el('td', '', r.method + ' ' + r.endpoint),
      el('td', r.status < 400 ? 'st-ok' : 'st-bad', String(r.status)),
      el('td', 'num', fmtSeconds(r.queue_s)),
      el('td', 'num', fmtSeconds(r.ttft_s)),
      el('td', 'num', fmtSeconds(r.total_s)),
      el('td', 'num', r.tokens === null ? '–' : String(r.tokens)));
    row.hidden = activityHidden(r.model);
    fragment.append(row);
  }
  tbody.prepend(fragment);
  while (tbody.rows.length > ACTIVITY_ROWS) tbody.lastElementChild.remove();
  $('activity-empty').hidden = tbody.rows.length > 0;
}

function filterActivity() {
  for (const row of $('activity-rows').rows) row.hidden = activityHidden(row.dataset.model);
}

async function pollActivity() {
  const answer = await getJSON('activity?limit=' + ACTIVITY_ROWS + '&after=' + lastActivity);
  if (answer.last_id < lastActivity) {  // the router restarted
    lastActivity = 0;
    $('activity-rows').replaceChildren();
    return pollActivity();
  }
  if (answer.requests.length) addActivity(answer.requests);
  lastActivity = answer.last_id;
}

async function pollTotals() {
  if (!samples.add(await getJSON('activity/totals?since=' + samples.seq))) {
    return pollTotals();  // the router restarted: start over
  }
  drawCharts();
}

const CHARTS = [
  ['req', fmtRate, '#2f6fdb', '/s'], ['tok', fmtRate, '#1f9d55', '/s'],
  ['ttft', fmtSeconds, '#c98a00', ''], ['queue', fmtSeconds, '#8e44ad', ''],
];

function drawCharts() {
  const series = samples.series(selected === null ? ALL : selected);
  for (const [name, format, color, unit] of CHARTS) {
    const values = series[name];
    drawChart($('c-' + name), values, format, color);
    // Rates: the last interval; averages: the last interval that had a request.
    const last = unit ? values[values.length - 1] : lastValue(values);
    $('v-' + name).textContent = last === undefined || last === null ? '–' : format(last) + unit;
  }
}

// ------------------------------------------------------------------ who uses what

function showUsage(rows) {
  $('usage-rows').replaceChildren(...rows.map((r) => {
    const row = el('tr');
    row.append(
      el('td', '', r.name), el('td', '', r.model), el('td', 'num', String(r.requests)),
      el('td', 'num', String(r.prompt_tokens)), el('td', 'num', String(r.completion_tokens)),
      el('td', 'num', fmtSeconds(r.queue_seconds)),
      el('td', r.refusals ? 'num st-bad' : 'num', String(r.refusals)));
    return row;
  }));
  $('usage-empty').hidden = rows.length > 0;
}

let ticks = 0;

async function pollUsage() {
  if (ticks++ % USAGE_EVERY) return;
  try {
    showUsage((await getJSON('usage')).usage);
  } catch (err) {
    if (err.status === 403) $('usage-section').hidden = true;  // a key without role=admin
    else throw err;
  }
}

async function downloadUsage() {  // with the key: a plain link would send none
  const blob = await (await api('usage?format=csv')).blob();
  const link = el('a');
  link.href = URL.createObjectURL(blob);
  link.download = 'usage.csv';
  link.click();
  URL.revokeObjectURL(link.href);
}

async function tick() {
  if (!document.hidden && !askingForKey()) {
    await Promise.all([
      pollActivity().catch((err) => {
        if (err.status !== 401) setConn('offline', 'offline: ' + err.message);
      }),
      pollTotals().catch(() => {}),
      pollUsage().catch(() => {}),
    ]);
  }
  setTimeout(tick, TICK_MS);
}

// ------------------------------------------------------------------ selection and wiring

function select(id) {
  selected = id;
  table.setSelected(id);
  $('detail-title').textContent = id === null ? 'All models' : id;
  $('show-all').hidden = id === null;
  $('detail-hint').textContent = 'last 3 minutes' + (id === null ? ' · click a model for its own' : '');
  $('log-source').textContent = id || 'router';
  logs.show(id);
  drawCharts();
  filterActivity();
}

function wire() {
  $('model-rows').addEventListener('click', (event) => {
    const row = event.target.closest('tr');
    const m = row && table.get(row.dataset.model);
    if (!m) return;
    const button = event.target.closest('button');
    if (button && button.dataset.action) {
      act(m, button.dataset.action);
    } else if (!event.target.closest('details') && selected !== m.data.id) {
      select(m.data.id);
    }
  });
  let filterTimer = null;
  $('filter').addEventListener('input', () => {
    clearTimeout(filterTimer);
    filterTimer = setTimeout(() => table.setFilter($('filter').value), 80);
  });
  $('pull-button').addEventListener('click', pull);
  $('pull-input').addEventListener('keydown', (e) => { if (e.key === 'Enter') pull(); });
  $('show-all').addEventListener('click', () => select(null));
  $('activity-only').addEventListener('change', filterActivity);
  $('usage-csv').addEventListener('click', () => downloadUsage().catch(() => {}));
  $('log-clear').addEventListener('click', () => logs.clear());
  $('banner-close').addEventListener('click', () => { $('banner').hidden = true; });
  $('key-button').addEventListener('click', () => {
    showKeyPanel('The API key for this router (kept in this tab only).');
  });
  $('key-form').addEventListener('submit', (event) => {
    event.preventDefault();  // nothing is submitted anywhere: the key stays in this tab
    const key = $('key-input').value.trim();
    if (key) useKey(key);
  });
  $('key-forget').addEventListener('click', () => useKey(''));
  $('key-cancel').addEventListener('click', () => { $('key-panel').hidden = true; });
  window.addEventListener('resize', drawCharts);
  setInterval(() => { if (!document.hidden && !askingForKey()) refreshModels(); },
              MODELS_REFRESH_MS);
}

wire();
loadBudgets();
refreshModels();
followEvents();
select(null);
tick();
