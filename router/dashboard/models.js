// The model table: one row per model, created in batches, updated in place.
//
// A row's cells are written only when the text they show changes, so a /models refresh or an
// event costs a few string comparisons per model and DOM writes only where something moved:
// hundreds of models stay cheap. Rows carry data-model and data-status for tests and styles.

import {el, fmtBytes, fmtCores, fmtSeconds} from './format.js';

const ROW_BATCH = 100;  // rows created per animation frame
const ACTIONS = [['load', 'Load'], ['unload', 'Unload'], ['reload', 'Reload']];

// What a row shows as its status: llama.cpp's value, refined by the router's extra fields.
export function statusKey(data) {
  const s = data.status || {};
  if (s.stopping) return 'stopping';
  if (s.value === 'unloaded') {
    if (s.crash_loop) return 'crash-loop';
    if (s.failed) return 'failed';
    if (s.queue_position !== undefined) return 'queued';
  }
  return s.value || 'unknown';
}

// A model whose process holds memory (what the scheduler counts against the budgets).
export function holdsProcess(data) {
  const s = data.status || {};
  return s.value === 'loading' || s.value === 'loaded' || !!s.stopping;
}

// Load progress ({stages, current, value}) or download progress, as a fraction and a text.
function progressOf(data) {
  const s = data.status || {};
  if (s.progress && typeof s.progress.value === 'number') {
    const stages = s.progress.stages || [];
    const stage = s.progress.current;
    const index = Math.max(0, stages.indexOf(stage));
    const overall = stages.length ? (index + s.progress.value) / stages.length : s.progress.value;
    return {value: overall,
            text: (stage ? stage + ' ' : '') + Math.round(s.progress.value * 100) + '%'};
  }
  if (s.download && typeof s.download === 'object') {
    let done = 0;
    let total = 0;
    for (const file of Object.values(s.download)) {
      done += file.done || 0;
      total += file.total || 0;
    }
    if (total) return {value: done / total, text: fmtBytes(done) + ' / ' + fmtBytes(total)};
  }
  return null;
}

export class ModelTable {
  constructor(tbody) {
    this.tbody = tbody;
    this.models = new Map();  // id -> {data, row, cells, shown, busy}; row null until made
    this.pending = [];        // ids whose rows are still to be created
    this.selected = null;
    this.filter = '';
    this.memoryBudget = null; // bytes, for the memory bars
  }

  get(id) {
    return this.models.get(id);
  }

  // A /models answer: update rows in place, add new ones in batches, drop gone ones.
  apply(list) {
    const seen = new Set();
    const idle = this.pending.length === 0;
    for (const data of list) {
      seen.add(data.id);
      const m = this.models.get(data.id);
      if (m) {
        m.data = data;
        this.update(m);
      } else {
        this.models.set(data.id, {data, row: null, cells: null, shown: {}, busy: ''});
        this.pending.push(data.id);
      }
    }
    for (const id of [...this.models.keys()]) if (!seen.has(id)) this.remove(id);
    if (this.pending.length && idle) requestAnimationFrame(() => this.createPending());
  }

  createPending() {
    const fragment = document.createDocumentFragment();
    let made = 0;
    while (this.pending.length && made < ROW_BATCH) {
      const m = this.models.get(this.pending.shift());
      if (!m || m.row) continue;  // removed, or made already
      fragment.append(this.createRow(m));
      made++;
    }
    this.tbody.append(fragment);
    if (this.pending.length) requestAnimationFrame(() => this.createPending());
  }

  remove(id) {
    const m = this.models.get(id);
    if (!m) return;
    if (m.row) m.row.remove();
    this.models.delete(id);
  }

  counts() {
    let loaded = 0;
    for (const m of this.models.values()) if (statusKey(m.data) === 'loaded') loaded++;
    return {total: this.models.size, loaded};
  }

  setFilter(text) {
    this.filter = text.trim().toLowerCase();
    for (const m of this.models.values()) if (m.row) m.row.hidden = !this.matches(m.data);
  }

  matches(data) {
    if (!this.filter) return true;
    if (data.id.toLowerCase().includes(this.filter)) return true;
    return (data.aliases || []).some((a) => a.toLowerCase().includes(this.filter));
  }

  setSelected(id) {
    const old = this.models.get(this.selected);
    if (old && old.row) old.row.classList.remove('selected');
    this.selected = id;
    const m = this.models.get(id);
    if (m && m.row) m.row.classList.add('selected');
  }

  setMemoryBudget(bytes) {
    if (bytes === this.memoryBudget) return;
    this.memoryBudget = bytes;
    for (const m of this.models.values()) this.update(m);
  }

  // Applies a /models/sse event to the model it names. Returns false for a model this table
  // does not know (the caller refreshes the list).
  applyEvent(event) {
    const m = this.models.get(event.model);
    if (!m) return false;
    const data = event.data || {};
    const s = m.data.status = {...(m.data.status || {})};
    switch (event.event) {
      case 'model_status':
      case 'status_change':
        s.value = data.status;
        delete s.stopping;
        if (data.status !== 'loading') delete s.progress;
        if (data.progress) s.progress = data.progress;
        if (data.status !== 'downloading') delete s.download;
        if (data.status === 'loading' || data.status === 'loaded') {
          delete s.failed;
          delete s.queue_position;
        }
        if (data.failed) {
          s.failed = true;
          s.exit_code = data.exit_code;
        }
        if (data.draining) s.draining = true;
        break;
      case 'stopping':
        s.stopping = true;
        break;
      case 'queued':
        s.queue_position = data.position;
        s.expected_wait_s = data.expected_wait_s;
        break;
      case 'download_progress':
        s.value = 'downloading';
        s.download = data.progress || {};
        break;
      default:
        return true;
    }
    this.update(m);
    return true;
  }

  createRow(m) {
    const id = m.data.id;
    const row = el('tr');
    row.dataset.model = id;
    const cell = (className, ...children) => {
      const td = el('td', className);
      td.append(...children);
      return td;
    };
    const c = {
      name: el('span', 'mid'), aliases: el('span', 'sub'),
      badge: el('span', 'badge'), note: el('span', 'sub'), progress: el('span', 'meter'),
      progressFill: el('span'), failure: el('details', 'failure'), failureSummary: el('summary'),
      failureText: el('pre'),
      mem: el('span'), memGpu: el('span', 'sub'), memBar: el('span', 'meter'),
      memMeasured: el('span'), memEstimate: el('span', 'est'),
      proc: el('span'), cpu: el('span', 'sub'),
      load: el('span'), loadNote: el('span', 'sub'),
      buttons: {},
    };
    c.progress.append(c.progressFill);
    c.failure.append(c.failureSummary, c.failureText);
    c.memBar.append(c.memEstimate, c.memMeasured);
    const actions = el('td', 'actions');
    for (const [action, label] of ACTIONS) {
      const b = el('button', '', label);
      b.type = 'button';
      b.dataset.action = action;
      b.setAttribute('aria-label', label + ' ' + id);
      c.buttons[action] = b;
      actions.append(b);
    }
    row.append(cell('', c.name, c.aliases), cell('status', c.badge, c.note, c.progress, c.failure),
               cell('mem', c.mem, c.memGpu, c.memBar), cell('', c.proc, c.cpu),
               cell('', c.load, c.loadNote), actions);
    m.row = row;
    m.cells = c;
    m.shown = {};
    row.hidden = !this.matches(m.data);
    if (id === this.selected) row.classList.add('selected');
    this.update(m);
    return row;
  }

  // Brings a row up to date with m.data, writing only what changed.
  update(m) {
    if (!m.row) return;
    const d = m.data;
    const s = d.status || {};
    const c = m.cells;
    const key = statusKey(d);
    const busy = m.busy || '';
    const text = (name, node, value) => {
      if (m.shown[name] !== value) {
        m.shown[name] = value;
        node.textContent = value;
      }
    };
    const flag = (name, value, apply) => {
      if (m.shown[name] !== value) {
        m.shown[name] = value;
        apply(value);
      }
    };
    const width = (name, node, fraction) => flag(
      name, Math.max(0, Math.min(100, fraction * 100)).toFixed(1) + '%',
      (w) => { node.style.width = w; });

    text('name', c.name, d.id);
    text('aliases', c.aliases, [(d.aliases || []).join(', '), d.source].filter(Boolean).join(' · '));
    flag('status', key, (v) => { c.badge.dataset.s = v; m.row.dataset.status = v; });
    text('badge', c.badge, busy || (key === 'crash-loop' ? 'crash loop' : key));

    const notes = [];
    const progress = key === 'loading' || key === 'downloading' ? progressOf(d) : null;
    if (progress) notes.push(progress.text);
    if (s.queue_position !== undefined) {
      notes.push('queue #' + (s.queue_position + 1) +
                 (s.expected_wait_s ? ', ~' + fmtSeconds(s.expected_wait_s) : ''));
    }
    if (s.draining) notes.push('draining');
    if (s.downloaded === false && key !== 'downloading') notes.push('not downloaded');
    if (s.uptime_s !== undefined && key === 'loaded') notes.push('up ' + fmtSeconds(s.uptime_s));
    text('note', c.note, notes.join(' · '));
    flag('progress-shown', !!progress, (v) => { c.progress.hidden = !v; });
    if (progress) width('progress', c.progressFill, progress.value);

    flag('failed', !!s.failed, (v) => { c.failure.hidden = !v; });
    if (s.failed) {
      const code = s.exit_code === null || s.exit_code === undefined ? '–' : s.exit_code;
      text('failure-summary', c.failureSummary,
           'exit code ' + code + (s.crash_loop ? ', not restarted' : ''));
      text('failure-text', c.failureText, [s.message || ''].concat(s.last_lines || []).join('\n'));
    }

    const mem = s.memory || {};
    const parts = [];
    if (mem.measured !== undefined) parts.push(fmtBytes(mem.measured));
    parts.push(mem.estimate ? 'est ' + fmtBytes(mem.estimate) : 'est –');
    text('mem', c.mem, parts.join(' / '));
    const gpus = Object.entries(mem.gpus || {}).map(([pool, g]) => pool + ' ' +
      (g.measured !== undefined ? fmtBytes(g.measured) + ' / ' : '') + 'est ' + fmtBytes(g.estimate));
    text('gpu', c.memGpu, gpus.join(' · '));
    const budget = this.memoryBudget;
    const bar = !!budget && (mem.measured !== undefined || !!mem.estimate);
    flag('mem-bar', bar, (v) => { c.memBar.hidden = !v; });
    if (bar) {
      width('mem-m', c.memMeasured, (mem.measured || 0) / budget);
      width('mem-e', c.memEstimate, (mem.estimate || 0) / budget);
    }

    const proc = [];
    if (s.pid !== undefined) proc.push('pid ' + s.pid);
    if (s.port !== undefined) proc.push(':' + s.port);
    if (s.replicas) proc.push(s.replicas.length + ' replicas');
    text('proc', c.proc, proc.join(' '));
    const cpu = s.cpu;
    text('cpu', c.cpu, !cpu ? '' :
      (cpu.threads ? cpu.threads + ' threads' : 'threads: ' + cpu.placed_by) +
      (cpu.cores && cpu.cores.length ? ' on cores ' + fmtCores(cpu.cores) : '') +
      (cpu.paused ? ' · paused' : ''));

    text('load', c.load, (s.in_flight || 0) + ' in flight');
    text('load-note', c.loadNote, s.waiting ? s.waiting + ' waiting' : '');

    const running = ['loading', 'loaded', 'downloading', 'queued'].includes(key);
    flag('b-load', !!busy || running || key === 'stopping',
         (v) => { c.buttons.load.disabled = v; });
    flag('b-unload', !!busy || !running, (v) => { c.buttons.unload.disabled = v; });
    flag('b-reload', !!busy || key !== 'loaded', (v) => { c.buttons.reload.disabled = v; });
  }
}
