// The log pane: follows one model's llama-server output (or the router's own log) live.

import {api, keyEntered, readData} from './api.js';
import {el, sleep} from './format.js';

const LOG_LINES = 1000;  // lines kept in the pane
const BACKLOG = 300;     // recent lines shown first

// The longest end of ``backlog`` that ``fresh`` starts with: lines both answers hold.
export function overlap(backlog, fresh) {
  for (let k = Math.min(backlog.length, fresh.length); k > 0; k--) {
    let same = true;
    for (let i = 0; i < k && same; i++) same = backlog[backlog.length - k + i] === fresh[i];
    if (same) return k;
  }
  return 0;
}

export class LogPane {
  constructor(pane, follow) {
    this.pane = pane;      // the element the lines go in
    this.follow = follow;  // checkbox: keep the newest line in view
    this.abort = null;
    this.count = 0;
    this.lastLine = null;
  }

  clear() {
    this.pane.replaceChildren();
    this.count = 0;
  }

  append(lines) {
    if (!lines.length) return;
    const fragment = document.createDocumentFragment();
    for (const line of lines) fragment.append(el('div', '', line));
    this.pane.append(fragment);
    this.lastLine = lines[lines.length - 1];
    this.count += lines.length;
    while (this.count > LOG_LINES) {
      this.pane.firstChild.remove();
      this.count--;
    }
    if (this.follow.checked) this.pane.scrollTop = this.pane.scrollHeight;
  }

  // Shows ``model``'s lines (the router's for null) until another is chosen; reconnects
  // after errors, waits for a key after a 401.
  async show(model) {
    if (this.abort) this.abort.abort();
    const control = this.abort = new AbortController();
    const query = model ? '?model=' + encodeURIComponent(model) : '';
    this.clear();
    let delay = 1000;
    while (!control.signal.aborted) {
      try {
        // Follow first, then read the recent lines: no line falls between the two.
        const stream = await api('logs/stream' + query, {signal: control.signal});
        let early = [];
        let ready = false;
        const reading = readData(stream, (line) => (ready ? this.append([line]) : early.push(line)));
        reading.catch(() => {});  // awaited below; an abort before then is no error
        const text = await (await api('logs' + (query ? query + '&' : '?') + 'lines=' + BACKLOG,
                                      {signal: control.signal})).text();
        const backlog = text.split('\n');
        if (backlog[backlog.length - 1] === '') backlog.pop();
        // After a reconnect, only what came after the last line shown.
        this.append(this.count ? backlog.slice(backlog.lastIndexOf(this.lastLine) + 1) : backlog);
        this.append(early.slice(overlap(backlog, early)));
        early = [];
        ready = true;
        delay = 1000;
        await reading;  // the stream ended: the router is restarting or going away
      } catch (err) {
        if (control.signal.aborted) return;
        if (err.status === 401) { await keyEntered(); continue; }
        if (err.status === 404) { this.append(['(' + err.message + ')']); return; }
      }
      await sleep(delay);
      delay = Math.min(delay * 2, 10000);
    }
  }
}
