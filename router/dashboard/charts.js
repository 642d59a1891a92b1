// Per-model charts from /activity/totals samples: requests/s, generated tokens/s, and the
// average time to first byte and queue wait of the requests in each sample interval.
//
// The router keeps running totals per model; the page samples them every tick, asking only
// for the models that changed (?since=SEQ), and turns consecutive samples into rates. Every
// model seen gets one sample per tick, aligned with ``times``, so a model can be charted from
// whenever the page first saw it.

export const HISTORY = 120;  // samples kept per model
export const ALL = '*';      // the sum of every model
const FIELDS = ['requests', 'tokens', 'ttft_sum', 'ttft_count', 'queue_sum', 'queue_count'];

export class Samples {
  constructor() {
    this.reset();
  }

  reset() {
    this.seq = 0;             // the router's seq of the last answer
    this.started = null;      // the router's start time, to notice a restart
    this.totals = new Map();  // model -> latest totals
    this.history = new Map(); // model -> totals per sample
    this.times = [];          // sample times (router clock)
  }

  // Adds one /activity/totals answer; false when the router restarted (reset and ask
  // again with ``since=0``).
  add(answer) {
    if (this.started !== null && (answer.started !== this.started || answer.seq < this.seq)) {
      this.reset();
      return false;
    }
    this.started = answer.started;
    const initial = this.times.length === 0;
    for (const [model, totals] of Object.entries(answer.models)) {
      if (!this.history.has(model)) {
        // New since the last sample: it had nothing before. In the first answer: whatever it
        // had happened before this page looked.
        this.history.set(model, this.times.map(() => (initial ? totals : {})));
      }
      this.totals.set(model, totals);
    }
    this.seq = answer.seq;
    const all = {};
    for (const f of FIELDS) all[f] = 0;
    for (const t of this.totals.values()) for (const f of FIELDS) all[f] += t[f] || 0;
    if (!this.history.has(ALL)) this.history.set(ALL, this.times.map(() => all));
    this.times.push(answer.now);
    for (const [model, samples] of this.history) {
      samples.push(model === ALL ? all : this.totals.get(model));
      if (samples.length > HISTORY + 1) samples.shift();
    }
    if (this.times.length > HISTORY + 1) this.times.shift();
    return true;
  }

  // Per sample interval: rates (per second) and averages (seconds; null: no request).
  series(model) {
    const samples = this.history.get(model) || [];
    const times = this.times;
    const out = {req: [], tok: [], ttft: [], queue: []};
    const offset = times.length - samples.length;
    for (let i = 1; i < times.length; i++) {
      const a = samples[i - 1 - offset] || {};
      const b = samples[i - offset] || {};
      const dt = Math.max(times[i] - times[i - 1], 1e-3);
      const d = (f) => (b[f] || 0) - (a[f] || 0);
      out.req.push(d('requests') / dt);
      out.tok.push(d('tokens') / dt);
      out.ttft.push(d('ttft_count') > 0 ? d('ttft_sum') / d('ttft_count') : null);
      out.queue.push(d('queue_count') > 0 ? d('queue_sum') / d('queue_count') : null);
    }
    return out;
  }
}

// A bar chart on ``canvas``: one bar per value, the newest at the right edge, no bar for null.
export function drawChart(canvas, values, format, color) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  if (!width || !height) return;
  if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const g = canvas.getContext('2d');
  g.setTransform(ratio, 0, 0, ratio, 0, 0);
  g.clearRect(0, 0, width, height);
  const style = getComputedStyle(document.body);
  const top = 12;
  const bottom = height - 2;
  const max = Math.max(...values.filter((v) => v !== null), 0) || 1;
  g.strokeStyle = style.getPropertyValue('--line').trim() || '#ddd';
  g.lineWidth = 1;
  for (const f of [0, 0.5, 1]) {
    const y = Math.round(bottom - f * (bottom - top)) + 0.5;
    g.beginPath();
    g.moveTo(0, y);
    g.lineTo(width, y);
    g.stroke();
  }
  g.fillStyle = style.getPropertyValue('--muted').trim() || '#777';
  g.font = '10px system-ui, sans-serif';
  g.textBaseline = 'top';
  g.fillText(format(max), 2, 0);
  const step = width / HISTORY;
  const x0 = width - values.length * step;
  g.fillStyle = color;
  values.forEach((v, i) => {
    if (v === null) return;
    const h = Math.max((v / max) * (bottom - top), v > 0 ? 1.5 : 0.5);
    g.fillRect(x0 + i * step + 0.5, bottom - h, Math.max(step - 1, 1), h);
  });
}

export function lastValue(values) {
  for (let i = values.length - 1; i >= 0; i--) if (values[i] !== null) return values[i];
  return null;
}
