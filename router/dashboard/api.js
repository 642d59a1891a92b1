// The router's HTTP API as the dashboard uses it: the API key, error envelopes, event streams.
//
// Paths are relative to the router's root (the page is at <root>/dashboard/), so a path
// prefix added by a reverse proxy is kept. Every failure becomes an ApiError whose message is
// the router's own (the OpenAI-style {"error": {"message"}} envelope) where there is one.

const BASE = new URL('..', location.href);
const KEY_STORE = 'llama-router-api-key';

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;  // 0: the router could not be reached
  }
}

let apiKey = sessionStorage.getItem(KEY_STORE) || '';
let keyWaiters = [];
let unauthorized = () => {};

export const hasKey = () => apiKey !== '';

// ``handler(message)`` is called on every 401 (the page asks for a key).
export function onUnauthorized(handler) {
  unauthorized = handler;
}

// Use ``key`` from now on (kept for this tab only), and wake everything waiting for one.
export function setKey(key) {
  apiKey = key;
  if (key) sessionStorage.setItem(KEY_STORE, key);
  else sessionStorage.removeItem(KEY_STORE);
  const waiters = keyWaiters;
  keyWaiters = [];
  waiters.forEach((resolve) => resolve());
}

// Resolves when a key has been set (after a 401).
export const keyEntered = () => new Promise((resolve) => keyWaiters.push(resolve));

export async function api(path, options = {}) {
  const headers = new Headers(options.headers || {});
  if (apiKey) headers.set('Authorization', 'Bearer ' + apiKey);
  let response;
  try {
    response = await fetch(new URL(path, BASE), {...options, headers, cache: 'no-store'});
  } catch (err) {
    if (err.name === 'AbortError') throw err;
    throw new ApiError(0, 'the router cannot be reached (' + err.message + ')');
  }
  if (!response.ok) {
    let message = response.status + ' ' + response.statusText;
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) message = body.error.message;
    } catch (_) { /* not the JSON envelope */ }
    if (response.status === 401) unauthorized(message);
    throw new ApiError(response.status, message);
  }
  return response;
}

export const getJSON = async (path, signal) => (await api(path, {signal})).json();

export function post(path, body) {
  return api(path, {method: 'POST', body: JSON.stringify(body),
                    headers: {'Content-Type': 'application/json'}});
}

// Calls ``onData`` with each "data:" line of an event stream until it ends (or its fetch is
// aborted, which rejects). fetch + a reader rather than EventSource: it can send the key.
export async function readData(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.indexOf('\n')) >= 0) {
      let line = buffer.slice(0, end);
      buffer = buffer.slice(end + 1);
      if (line.endsWith('\r')) line = line.slice(0, -1);
      if (line.startsWith('data:')) onData(line.slice(line.startsWith('data: ') ? 6 : 5));
    }
  }
}
