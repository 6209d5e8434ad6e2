#!/usr/bin/env node
// bench/load/load.mjs — a bounded loopback load test for `lockstep serve` (issue 7).
//
// N concurrent clients (default 64) each stream completions until a fixed total of requests
// has been sent; every request records its time to first token (TTFT) and the gaps between
// its chunks (ITL), and must end with `data: [DONE]`. Meanwhile a worker thread polls the
// admin /metrics every 200 ms and times each answer (must stay under 100 ms), beside a control
// request to a trivial server in another process that tells a machine stall (every thread
// waiting for a core: not judged, counted, at most a tenth of the ticks) from /metrics waiting
// behind the server's work (judged). Every
// --capture-every'th request asks for a capture (X-Lockstep-Capture) and a few finished ones
// are captured through POST /admin/capture/{id}; each capture must say verified, and so must
// its <id>.live.json sidecar. Prints a JSON summary on stdout; exits 1 if any request was lost
// or any check failed, 2 on the hard timeout. Only Node built-ins; loopback only.
//
//   node bench/load/load.mjs --bin build/cli/lockstep                       # starts its own server
//   node bench/load/load.mjs --bin build/cli/lockstep --server-arg=--no-record --capture-every 0 --admin-captures 0
//   node bench/load/load.mjs --api http://127.0.0.1:8000/v1 --admin http://127.0.0.1:8001 --token-file tok.txt
import http from 'node:http';
import { spawn } from 'node:child_process';
import { mkdtempSync, writeFileSync, readFileSync, existsSync, rmSync } from 'node:fs';
import { tmpdir, cpus } from 'node:os';
import { join } from 'node:path';
import { randomBytes } from 'node:crypto';
import { Worker, isMainThread, parentPort, workerData } from 'node:worker_threads';
import { performance } from 'node:perf_hooks';

// ---- the /metrics poller (a worker thread: its own event loop, not delayed by the streams) ----
// Each tick times /metrics and, at the same moment, a control request to a trivial HTTP server
// in another process (`control`). On a loaded machine every runnable thread can wait for a
// core: a control answer that is itself slow says the machine stalled at that moment, not
// that /metrics waited behind the server's streams (the property under test). Such a tick is
// re-taken rather than judged (main() bounds how many may be).
if (!isMainThread) {
  const { url, control, intervalMs } = workerData;
  const agent = new http.Agent({ keepAlive: true, maxSockets: 2 });
  let stop = false;
  parentPort.on('message', (m) => { if (m === 'stop') stop = true; });
  const once = (u) => new Promise((resolve) => {
    const t0 = performance.now();
    const req = http.get(u, { agent }, (res) => {
      let n = 0;
      res.on('data', (d) => { n += d.length; });
      res.on('end', () => resolve({ ms: performance.now() - t0, status: res.statusCode, bytes: n }));
    });
    req.setTimeout(5000, () => req.destroy(new Error('timeout')));
    req.on('error', (e) => resolve({ ms: performance.now() - t0, status: 0, error: e.message }));
  });
  (async () => {
    while (!stop) {
      const t0 = performance.now();
      const [m, c] = await Promise.all([once(url), control ? once(control) : Promise.resolve(null)]);
      parentPort.postMessage({ ...m, control_ms: c ? c.ms : null });
      const wait = intervalMs - (performance.now() - t0);
      if (wait > 0) await new Promise((r) => setTimeout(r, wait));
    }
    agent.destroy();
    parentPort.postMessage('stopped');
  })();
}

// ---- options ----
function parseArgs(argv) {
  const o = {
    bin: '', api: '', admin: '', tokenFile: '', clients: 64, requests: 512, maxTokens: 32,
    captureEvery: 64, captureMode: 'summary', adminCaptures: 2, metricsIntervalMs: 200, metricsLimitMs: 100,
    timeoutS: 600, serverArgs: [], out: '', temperature: 0.8, label: '',
  };
  const num = (v, k) => { const n = Number(v); if (!Number.isFinite(n) || n < 0) throw new Error(`--${k}: not a number: ${v}`); return n; };
  for (let i = 0; i < argv.length; ++i) {
    let [k, v] = argv[i].startsWith('--') && argv[i].includes('=') ? [argv[i].slice(0, argv[i].indexOf('=')), argv[i].slice(argv[i].indexOf('=') + 1)] : [argv[i], undefined];
    const val = () => (v !== undefined ? v : argv[++i]);
    switch (k) {
      case '--bin': o.bin = val(); break;
      case '--api': o.api = val().replace(/\/$/, ''); break;
      case '--admin': o.admin = val().replace(/\/$/, ''); break;
      case '--token-file': o.tokenFile = val(); break;
      case '--clients': o.clients = num(val(), 'clients'); break;
      case '--requests': o.requests = num(val(), 'requests'); break;
      case '--max-tokens': o.maxTokens = num(val(), 'max-tokens'); break;
      case '--capture-every': o.captureEvery = num(val(), 'capture-every'); break;
      case '--capture-mode': o.captureMode = val(); break;
      case '--admin-captures': o.adminCaptures = num(val(), 'admin-captures'); break;
      case '--metrics-interval-ms': o.metricsIntervalMs = num(val(), 'metrics-interval-ms'); break;
      case '--metrics-limit-ms': o.metricsLimitMs = num(val(), 'metrics-limit-ms'); break;
      case '--timeout-s': o.timeoutS = num(val(), 'timeout-s'); break;
      case '--server-arg': o.serverArgs.push(val()); break;
      case '--temperature': o.temperature = num(val(), 'temperature'); break;
      case '--label': o.label = val(); break;
      case '--out': o.out = val(); break;
      case '-h': case '--help':
        console.log(readFileSync(new URL(import.meta.url), 'utf8').split('\n').filter((l) => l.startsWith('//')).join('\n'));
        process.exit(0);
      default: throw new Error(`unknown option ${k}`);
    }
  }
  if (!o.bin && !(o.api && o.admin)) throw new Error('give --bin (start a server) or --api and --admin');
  if (!['summary', 'full'].includes(o.captureMode)) throw new Error('--capture-mode: summary | full');
  if (o.clients < 1 || o.requests < 1) throw new Error('--clients and --requests must be ≥ 1');
  return o;
}

const LOOPBACK = new Set(['127.0.0.1', 'localhost', '[::1]', '::1']);
function assertLoopback(u) {
  if (!LOOPBACK.has(new URL(u).hostname)) throw new Error(`${u}: not loopback; this load test runs on loopback only`);
}

function pct(xs, p) {
  if (xs.length === 0) return null;
  const s = xs.slice().sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.max(0, Math.ceil((p / 100) * s.length) - 1))];
}
const r3 = (x) => (x === null ? null : Math.round(x * 1000) / 1000);
const stats = (xs) => ({ n: xs.length, p50: r3(pct(xs, 50)), p90: r3(pct(xs, 90)), p99: r3(pct(xs, 99)), max: r3(pct(xs, 100)) });

function startServer(o, work) {
  return new Promise((resolve, reject) => {
    const args = ['serve', '--port', '0', '--admin-port', '0', '--quiet', '--max-concurrent', String(Math.max(64, o.clients)),
                  '--capture-dir', join(work, 'caps'), '--admin-token-file', o.tokenFile, ...o.serverArgs];
    const child = spawn(o.bin, args, { stdio: ['ignore', 'ignore', 'pipe'] });
    let err = '';
    const timer = setTimeout(() => reject(new Error('server did not start in 60 s:\n' + err)), 60_000);
    child.stderr.setEncoding('utf8');
    child.stderr.on('data', (d) => {
      if (err.length < 1 << 20) err += d;
      const m = /API on (http:\/\/[^\s,]+), health\/metrics\/admin on (http:\/\/\S+)\r?\n/.exec(err);
      if (m && !child.ready) {
        child.ready = true;
        clearTimeout(timer);
        resolve({ child, api: m[1], admin: m[2], log: () => err });
      }
    });
    child.on('exit', (code, sig) => { clearTimeout(timer); if (!child.ready) reject(new Error(`server exited (${code ?? sig}):\n${err}`)); });
  });
}

function post(agent, url, body, headers) {
  return new Promise((resolve) => {
    const data = JSON.stringify(body);
    const req = http.request(url, { method: 'POST', agent, headers: { 'content-type': 'application/json', 'content-length': Buffer.byteLength(data), ...headers } }, (res) => {
      let text = '';
      res.setEncoding('utf8');
      res.on('data', (d) => { text += d; });
      res.on('end', () => resolve({ status: res.statusCode, text }));
    });
    req.on('error', (e) => resolve({ status: 0, text: e.message }));
    req.end(data);
  });
}

const PROMPTS = ['The quick brown fox', '<!DOCTYPE html>', 'def fibonacci(n):', 'Once upon a time, in a land far away,',
                 'SELECT name FROM users WHERE', 'The capital of France is', '1, 2, 3, 5, 8,', 'Dear Sir or Madam,'];

async function main() {
  const o = parseArgs(process.argv.slice(2));
  const work = mkdtempSync(join(tmpdir(), 'lockstep-load-'));
  let server = null;
  const failures = [];
  const fail = (m) => { if (failures.length < 50) failures.push(m); };
  const cleanup = () => { if (server && server.child.exitCode === null) server.child.kill('SIGKILL'); rmSync(work, { recursive: true, force: true }); };
  process.on('exit', cleanup);
  const hard = setTimeout(() => {
    console.error(`load: hard timeout (${o.timeoutS} s) reached`);
    console.log(JSON.stringify({ ok: false, error: `timed out after ${o.timeoutS} s`, failures }, null, 2));
    process.exit(2);
  }, o.timeoutS * 1000);

  let token = '';
  if (o.bin) {
    if (!o.tokenFile) {
      o.tokenFile = join(work, 'token.txt');
      writeFileSync(o.tokenFile, randomBytes(16).toString('hex') + '\n', { mode: 0o600 });
    }
    server = await startServer(o, work);
    o.api = server.api.replace(/\/$/, '');
    o.admin = server.admin.replace(/\/$/, '');
  }
  if (o.tokenFile) token = readFileSync(o.tokenFile, 'utf8').split('\n')[0];
  assertLoopback(o.api);
  assertLoopback(o.admin);

  // The control server: a separate process answering "ok", as cheap as an HTTP answer gets.
  const control = spawn(process.execPath, ['-e',
    "const s=require('http').createServer((q,r)=>r.end('ok'));s.listen(0,'127.0.0.1',()=>console.log(s.address().port))"],
    { stdio: ['ignore', 'pipe', 'inherit'] });
  process.on('exit', () => control.kill('SIGKILL'));
  const controlPort = await new Promise((resolve, reject) => {
    control.stdout.once('data', (d) => resolve(Number(String(d).trim())));
    control.once('exit', () => reject(new Error('control server exited')));
  });
  const poller = new Worker(new URL(import.meta.url), {
    workerData: { url: o.admin + '/metrics', control: `http://127.0.0.1:${controlPort}/`, intervalMs: o.metricsIntervalMs } });
  const metricsMs = [], judgedMs = [], controlMs = [];
  let metricsErrors = 0, stalls = 0;
  const pollerDone = new Promise((resolve) => poller.on('message', (m) => {
    if (m === 'stopped') return resolve();
    metricsMs.push(m.ms);
    controlMs.push(m.control_ms);
    if (m.status !== 200) { ++metricsErrors; fail(`/metrics answered ${m.status} ${m.error ?? ''}`); }
    // A tick whose control waited half the limit is a machine stall: not judged.
    if (m.control_ms >= o.metricsLimitMs / 2) ++stalls;
    else judgedMs.push(m.ms);
  }));

  const agent = new http.Agent({ keepAlive: true, maxSockets: o.clients });
  const runId = randomBytes(3).toString('hex');
  const ttft = [], itl = [], e2e = [];
  let next = 0, ok = 0, lost = 0, doneSeen = 0, tokens = 0, chunksSeen = 0;
  const cap = { asked: 0, verified: 0, failed: 0, sidecars_verified: 0, admin_asked: 0, admin_verified: 0 };
  const adminAt = new Set();
  for (let k = 0; k < o.adminCaptures; ++k) adminAt.add(Math.floor(((k + 1) * o.requests) / (o.adminCaptures + 1)));

  const checkCapture = (c, where) => {
    if (c.error || !c.verified) { ++cap.failed; fail(`${where}: capture ${c.request_id ?? ''} did not verify: ${c.error ?? c.detail}`); return false; }
    if (c.live_record && existsSync(c.live_record)) {
      const live = JSON.parse(readFileSync(c.live_record, 'utf8'));
      if (live.verified === true) ++cap.sidecars_verified;
      else { ++cap.failed; fail(`${where}: ${c.live_record} says verified=${live.verified}`); return false; }
    }
    return true;
  };

  const one = (i) => new Promise((resolve) => {
    const id = `load-${runId}-${i}`;
    const capture = o.captureEvery > 0 && i % o.captureEvery === o.captureEvery - 1;
    const body = { model: 'x', prompt: PROMPTS[i % PROMPTS.length], max_tokens: o.maxTokens, temperature: o.temperature,
                   seed: i, ignore_eos: true, stream: true, stream_options: { include_usage: true } };
    const headers = { 'x-request-id': id };
    if (capture) { headers['X-Lockstep-Capture'] = o.captureMode; headers['X-Lockstep-Token'] = token; ++cap.asked; }
    const data = JSON.stringify(body);
    const t0 = performance.now();
    let last = 0, gotDone = false, usage = null, captures = null, buf = '', failed = false;
    const req = http.request(o.api + '/completions', {
      method: 'POST', agent,
      headers: { 'content-type': 'application/json', 'content-length': Buffer.byteLength(data), ...headers },
    }, (res) => {
      if (res.statusCode !== 200) {
        let t = '';
        res.on('data', (d) => { t += d; });
        res.on('end', () => { ++lost; fail(`${id}: HTTP ${res.statusCode} ${t.slice(0, 200)}`); resolve(); });
        return;
      }
      res.setEncoding('utf8');
      res.on('data', (d) => {
        const now = performance.now();
        buf += d;
        let at;
        while ((at = buf.indexOf('\n\n')) >= 0) {
          const ev = buf.slice(0, at);
          buf = buf.slice(at + 2);
          if (!ev.startsWith('data: ')) continue;
          const payload = ev.slice(6);
          if (payload === '[DONE]') { gotDone = true; continue; }
          let j;
          try { j = JSON.parse(payload); } catch { failed = true; fail(`${id}: bad event ${payload.slice(0, 100)}`); continue; }
          if (j.error) { failed = true; fail(`${id}: error event ${JSON.stringify(j.error)}`); continue; }
          if (j.usage) usage = j.usage;
          if (j.lockstep) captures = j.lockstep.captures;
          if (j.choices && j.choices.length > 0 && j.choices[0].text) {
            ++chunksSeen;
            if (last === 0) ttft.push(now - t0); else itl.push(now - last);
            last = now;
          }
        }
      });
      res.on('end', () => {
        e2e.push(performance.now() - t0);
        if (gotDone) ++doneSeen;
        if (!gotDone) { failed = true; fail(`${id}: stream ended without [DONE]`); }
        if (!usage || usage.completion_tokens !== o.maxTokens) { failed = true; fail(`${id}: usage ${JSON.stringify(usage)}`); }
        else tokens += usage.completion_tokens;
        if (capture) {
          if (!captures || captures.length !== 1) { failed = true; ++cap.failed; fail(`${id}: no capture chunk`); }
          else if (checkCapture(captures[0], id)) ++cap.verified;
        }
        if (failed) ++lost; else ++ok;
        resolve();
      });
      res.on('error', (e) => { ++lost; fail(`${id}: ${e.message}`); resolve(); });
    });
    req.on('error', (e) => { ++lost; fail(`${id}: ${e.message}`); resolve(); });
    req.end(data);
  });

  const adminCapture = async (i) => {
    const id = `load-${runId}-${i}`;
    ++cap.admin_asked;
    const r = await post(undefined, `${o.admin}/admin/capture/${id}?mode=${o.captureMode}`, {}, { authorization: `Bearer ${token}` });
    if (r.status !== 200) { ++cap.failed; return fail(`admin capture ${id}: HTTP ${r.status} ${r.text.slice(0, 200)}`); }
    if (checkCapture(JSON.parse(r.text), `admin ${id}`)) ++cap.admin_verified;
  };

  const t0 = performance.now();
  const client = async () => {
    while (next < o.requests) {
      const i = next++;
      await one(i);
      if (adminAt.has(i)) await adminCapture(i);
    }
  };
  await Promise.all(Array.from({ length: o.clients }, client));
  const wall = (performance.now() - t0) / 1000;
  agent.destroy();
  poller.postMessage('stop');
  await pollerDone;
  await poller.terminate();
  control.kill('SIGTERM');

  // The server's own view.
  const m = await new Promise((resolve) => http.get(o.admin + '/metrics', (res) => {
    let t = ''; res.on('data', (d) => { t += d; }); res.on('end', () => resolve(t));
  }).on('error', () => resolve('')));
  const sum = (re) => [...m.matchAll(re)].reduce((a, x) => a + Number(x[1]), 0);
  const server_metrics = {
    captures_total: sum(/^lockstep_captures_total\{[^}]*\} (\S+)$/gm),
    capture_verify_failures_total: sum(/^lockstep_capture_verify_failures_total (\S+)$/gm),
    requests_rejected_total: sum(/^lockstep_requests_rejected_total (\S+)$/gm),
    request_success_total: sum(/^lockstep_request_success_total\{[^}]*\} (\S+)$/gm),
    generation_tokens_total: sum(/^lockstep_generation_tokens_total (\S+)$/gm),
  };

  if (ok + lost !== o.requests) fail(`accounted ${ok + lost} of ${o.requests} requests`);
  if (doneSeen !== o.requests) fail(`[DONE] received ${doneSeen} of ${o.requests}`);
  // Every judged tick must answer under the limit; ticks lost to machine stalls are reported,
  // and more than a tenth of them means the run could not judge the bound at all.
  const mMax = judgedMs.length ? Math.max(...judgedMs) : Infinity;
  const polls = metricsMs.length;
  if (polls < Math.max(1, Math.floor((wall * 1000) / o.metricsIntervalMs) - 2)) fail(`only ${polls} /metrics polls in ${wall.toFixed(1)} s`);
  if (mMax >= o.metricsLimitMs) fail(`/metrics took ${mMax.toFixed(1)} ms (limit ${o.metricsLimitMs} ms) while a control answered in time`);
  if (stalls > polls / 10) fail(`the machine stalled in ${stalls} of ${polls} /metrics ticks (control ≥ ${o.metricsLimitMs / 2} ms): too loaded to judge the bound`);
  if (cap.verified !== cap.asked || cap.admin_verified !== cap.admin_asked) fail(`captures: ${JSON.stringify(cap)}`);
  if (server_metrics.capture_verify_failures_total !== 0) fail(`server counts ${server_metrics.capture_verify_failures_total} verify failures`);
  if (server_metrics.requests_rejected_total !== 0) fail(`server rejected ${server_metrics.requests_rejected_total} requests`);

  const summary = {
    ok: failures.length === 0 && lost === 0,
    label: o.label,
    date: new Date().toISOString(),
    config: { clients: o.clients, requests: o.requests, max_tokens: o.maxTokens, capture_every: o.captureEvery,
              capture_mode: o.captureMode, admin_captures: o.adminCaptures, server_args: o.serverArgs, cpus: cpus().length },
    wall_s: r3(wall),
    requests: { ok, lost, done_received: doneSeen },
    tokens,
    tokens_per_s: r3(tokens / wall),
    requests_per_s: r3(o.requests / wall),
    ttft_ms: stats(ttft),
    itl_ms: stats(itl),
    e2e_ms: stats(e2e),
    metrics_latency_ms: { ...stats(metricsMs), judged_max: judgedMs.length ? r3(Math.max(...judgedMs)) : null,
                          machine_stalls: stalls, control: stats(controlMs), errors: metricsErrors, limit: o.metricsLimitMs },
    captures: cap,
    server_metrics,
    failures,
  };
  clearTimeout(hard);
  if (server) {
    server.child.kill('SIGTERM');
    await new Promise((r) => { const k = setTimeout(() => { server.child.kill('SIGKILL'); r(); }, 10_000); server.child.once('exit', () => { clearTimeout(k); r(); }); });
    if (/DID NOT VERIFY/.test(server.log())) { summary.ok = false; summary.failures.push('server log: CAPTURE DID NOT VERIFY'); }
  }
  const text = JSON.stringify(summary, null, 2);
  console.log(text);
  if (o.out) writeFileSync(o.out, text + '\n');
  console.error(`load: ${summary.ok ? 'PASS' : 'FAIL'} ${ok}/${o.requests} ok, ${summary.tokens_per_s} tok/s, TTFT p50 ${summary.ttft_ms.p50} ms p99 ${summary.ttft_ms.p99} ms, ` +
                `ITL p50 ${summary.itl_ms.p50} ms p99 ${summary.itl_ms.p99} ms, /metrics max ${summary.metrics_latency_ms.max} ms (judged ${summary.metrics_latency_ms.judged_max} ms, ${stalls} stalls), ` +
                `captures ${cap.verified + cap.admin_verified}/${cap.asked + cap.admin_asked} verified`);
  process.exitCode = summary.ok ? 0 : 1;
}

if (isMainThread) {
  main().catch((e) => { console.error(`load: ${e.stack ?? e}`); process.exit(1); });
}
