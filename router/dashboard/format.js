// DOM and number formatting helpers. Text always goes in as textContent, never as HTML.

export const $ = (id) => document.getElementById(id);

export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

export function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

export function fmtBytes(n) {
  if (n === null || n === undefined) return '–';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n : n.toFixed(n < 10 ? 2 : n < 100 ? 1 : 0)) + ' ' + units[i];
}

export function fmtSeconds(s) {
  if (s === null || s === undefined) return '–';
  if (s < 1) return (s * 1000).toFixed(s < 0.01 ? 1 : 0) + ' ms';
  if (s < 120) return s.toFixed(s < 10 ? 2 : 1) + ' s';
  return Math.floor(s / 60) + ' min ' + Math.round(s % 60) + ' s';
}

export function fmtRate(x) {
  if (x === null || x === undefined) return '–';
  return x >= 100 ? x.toFixed(0) : x >= 10 ? x.toFixed(1) : x.toFixed(2);
}

// [0, 1, 2, 3, 6] -> "0-3,6"
export function fmtCores(cores) {
  if (!cores || !cores.length) return '';
  const parts = [];
  let start = cores[0];
  let prev = cores[0];
  for (const c of cores.slice(1).concat([null])) {
    if (c === prev + 1) { prev = c; continue; }
    parts.push(start === prev ? String(start) : start + '-' + prev);
    start = prev = c;
  }
  return parts.join(',');
}

const pad2 = (n) => String(n).padStart(2, '0');

export function fmtClock(unix) {
  const d = new Date(unix * 1000);
  return pad2(d.getHours()) + ':' + pad2(d.getMinutes()) + ':' + pad2(d.getSeconds());
}
