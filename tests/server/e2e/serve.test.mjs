// tests/server/e2e/serve.test.mjs — `lockstep serve` end to end with the real `openai` npm
// client (pinned in package.json): completions and chat, streaming and not, seed
// reproducibility, and a capture whose trace replays exactly. Run by run.sh (CTest
// server_e2e_openai), or by hand:
//   cd tests/server/e2e && npm ci && LOCKSTEP_BIN=../../../build/cli/lockstep node --test
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, execFile } from 'node:child_process';
import { mkdtempSync, writeFileSync, existsSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { randomBytes } from 'node:crypto';
import OpenAI from 'openai';

const BIN = process.env.LOCKSTEP_BIN;
if (!BIN) throw new Error('set LOCKSTEP_BIN to the lockstep binary');

const work = mkdtempSync(join(tmpdir(), 'lockstep-e2e-'));
const capDir = join(work, 'caps');
const token = randomBytes(16).toString('hex');
writeFileSync(join(work, 'token.txt'), token + '\n', { mode: 0o600 });

let server;   // the child process
let stderr = '';
let client, api, admin;

// Starts `lockstep serve` on free ports and reads them from its start-up line:
//   lockstep serve: API on http://127.0.0.1:P/v1, health/metrics/admin on http://127.0.0.1:Q
function startServer() {
  return new Promise((resolve, reject) => {
    const args = ['serve', '--port', '0', '--admin-port', '0', '--capture-dir', capDir,
                  '--admin-token-file', join(work, 'token.txt')];
    if (process.env.LOCKSTEP_MODEL) args.push('--model', process.env.LOCKSTEP_MODEL);
    server = spawn(BIN, args, { stdio: ['ignore', 'ignore', 'pipe'] });
    const timer = setTimeout(() => reject(new Error('server did not start in 60 s:\n' + stderr)), 60_000);
    server.stderr.setEncoding('utf8');
    server.stderr.on('data', (d) => {
      stderr += d;
      const m = /API on (http:\/\/[^\s,]+), health\/metrics\/admin on (http:\/\/\S+)\r?\n/.exec(stderr);
      if (m) {
        clearTimeout(timer);
        resolve({ api: m[1], admin: m[2] });
      }
    });
    server.on('exit', (code, sig) => {
      clearTimeout(timer);
      reject(new Error(`server exited (${code ?? sig}) before listening:\n${stderr}`));
    });
  });
}

function stopServer() {
  if (!server || server.exitCode !== null || server.signalCode !== null) return Promise.resolve();
  return new Promise((resolve) => {
    const kill = setTimeout(() => server.kill('SIGKILL'), 10_000);
    server.once('exit', () => { clearTimeout(kill); resolve(); });
    server.kill('SIGTERM');
  });
}
// A failed assertion or a crash must not leave the server behind.
process.on('exit', () => { if (server && server.exitCode === null) server.kill('SIGKILL'); });

before(async () => {
  ({ api, admin } = await startServer());
  client = new OpenAI({ baseURL: api, apiKey: 'unused', maxRetries: 0, timeout: 120_000 });
});

after(async () => {
  await stopServer();
  if (!process.env.LOCKSTEP_E2E_KEEP) rmSync(work, { recursive: true, force: true });
});

const PROMPT = 'The quick brown fox';
const sampled = { temperature: 0.9, top_p: 0.95, max_tokens: 24, seed: 1234 };

async function collect(stream) {
  const chunks = [];
  for await (const c of stream) chunks.push(c);
  return chunks;
}

test('models lists the embedded model', async () => {
  const page = await client.models.list();
  assert.equal(page.data.length, 1);
  assert.equal(page.data[0].object, 'model');
});

test('completions: non-streaming, seed reproducibility', async () => {
  const a = await client.completions.create({ model: 'x', prompt: PROMPT, ...sampled });
  const b = await client.completions.create({ model: 'x', prompt: PROMPT, ...sampled });
  assert.equal(a.object, 'text_completion');
  assert.equal(a.choices.length, 1);
  assert.ok(a.choices[0].text.length > 0, 'empty completion');
  assert.ok(['stop', 'length'].includes(a.choices[0].finish_reason));
  assert.ok(a.usage.completion_tokens > 0 && a.usage.completion_tokens <= 24);
  assert.equal(b.choices[0].text, a.choices[0].text, 'same seed, different text');
  assert.deepEqual(b.usage, a.usage);
  // Other seeds sample other texts (at least one of four differs from seed 1234's).
  const others = await Promise.all([1, 2, 3, 4].map((s) =>
    client.completions.create({ model: 'x', prompt: PROMPT, ...sampled, seed: s })));
  assert.ok(others.some((o) => o.choices[0].text !== a.choices[0].text), 'the seed changes nothing');
});

test('completions: streaming deltas join to the non-streaming text', async () => {
  const ref = await client.completions.create({ model: 'x', prompt: PROMPT, ...sampled, ignore_eos: true });
  const chunks = await collect(await client.completions.create({
    model: 'x', prompt: PROMPT, ...sampled, ignore_eos: true, stream: true,
    stream_options: { include_usage: true },
  }));
  const text = chunks.flatMap((c) => c.choices.map((ch) => ch.text)).join('');
  assert.equal(text, ref.choices[0].text);
  const finals = chunks.flatMap((c) => c.choices).filter((ch) => ch.finish_reason);
  assert.equal(finals.length, 1);
  assert.equal(finals[0].finish_reason, 'length');
  const usage = chunks.find((c) => c.usage)?.usage;
  assert.ok(usage, 'no usage chunk');
  assert.equal(usage.completion_tokens, 24);
  assert.deepEqual(usage, ref.usage);
});

test('chat: non-streaming and streaming agree, seed reproducibility', async () => {
  const req = { model: 'x', messages: [{ role: 'system', content: 'Be brief.' }, { role: 'user', content: 'Name a colour.' }],
                temperature: 0.9, max_completion_tokens: 20, seed: 77 };
  const a = await client.chat.completions.create(req);
  const b = await client.chat.completions.create(req);
  assert.equal(a.object, 'chat.completion');
  assert.equal(a.choices[0].message.role, 'assistant');
  assert.equal(typeof a.choices[0].message.content, 'string');
  assert.equal(b.choices[0].message.content, a.choices[0].message.content);
  const chunks = await collect(await client.chat.completions.create({ ...req, stream: true }));
  assert.equal(chunks[0].object, 'chat.completion.chunk');
  assert.equal(chunks[0].choices[0].delta.role, 'assistant');
  const text = chunks.flatMap((c) => c.choices.map((ch) => ch.delta.content ?? '')).join('');
  assert.equal(text, a.choices[0].message.content);
  const last = chunks.flatMap((c) => c.choices).filter((ch) => ch.finish_reason);
  assert.equal(last.length, 1);
  assert.equal(last[0].finish_reason, a.choices[0].finish_reason);
});

// Streaming chunks carry the logprobs of the tokens they bring, in OpenAI's shapes; joined,
// they are the non-streaming response's (same seed, same tokens).
test('completions: streaming logprobs join to the non-streaming ones', async () => {
  const req = { model: 'x', prompt: PROMPT, ...sampled, ignore_eos: true, logprobs: 3 };
  const ref = (await client.completions.create(req)).choices[0].logprobs;
  assert.equal(ref.tokens.length, 24);
  const chunks = await collect(await client.completions.create({ ...req, stream: true }));
  const lps = chunks.flatMap((c) => c.choices).map((ch) => ch.logprobs).filter(Boolean);
  assert.ok(lps.length > 1, 'logprobs came in one chunk or none');
  const joined = { tokens: [], token_logprobs: [], top_logprobs: [], text_offset: [] };
  for (const lp of lps) for (const k of Object.keys(joined)) joined[k].push(...lp[k]);
  assert.deepEqual(joined, ref);
  for (const top of joined.top_logprobs) assert.equal(Object.keys(top).length, 3);
});

test('chat: streaming logprobs and top_logprobs join to the non-streaming ones', async () => {
  const req = { model: 'x', messages: [{ role: 'user', content: 'Name a colour.' }], temperature: 0.9, seed: 8,
                max_completion_tokens: 16, logprobs: true, top_logprobs: 2 };
  const ref = (await client.chat.completions.create(req)).choices[0];
  assert.ok(ref.logprobs.content.length > 0);
  const chunks = await collect(await client.chat.completions.create({ ...req, stream: true }));
  const content = chunks.flatMap((c) => c.choices).flatMap((ch) => ch.logprobs?.content ?? []);
  assert.deepEqual(content, ref.logprobs.content);
  for (const c of content) {
    assert.equal(c.top_logprobs.length, 2);
    assert.deepEqual(c.bytes, [...Buffer.from(c.token, 'utf8')]);
    assert.ok(c.logprob <= 0);
  }
  // The role chunk has none.
  assert.equal(chunks[0].choices[0].logprobs, null);
});

test('errors: a bad field is a 400 the client raises as BadRequestError', async () => {
  await assert.rejects(client.completions.create({ model: 'x', prompt: PROMPT, max_tokens: -3 }),
                       (e) => e instanceof OpenAI.BadRequestError && e.status === 400);
});

function replay(trace) {
  return new Promise((resolve) => {
    execFile(BIN, ['replay', '--json', '-q', trace], { maxBuffer: 64 << 20 }, (err, stdout, stderrText) =>
      resolve({ code: err ? err.code : 0, stdout, stderr: stderrText }));
  });
}

async function checkCapture(cap, requestId, text) {
  assert.ok(cap, 'no capture in the response');
  assert.equal(cap.error, undefined, `capture failed: ${cap.error}`);
  assert.equal(cap.request_id, requestId);
  assert.equal(cap.mode, 'full');
  assert.equal(cap.verified, true, `capture did not verify: ${cap.detail}`);
  assert.ok(existsSync(cap.trace), cap.trace);
  const live = JSON.parse(readFileSync(cap.live_record, 'utf8'));
  assert.equal(live.verified, true);
  // Every tap's summary was recorded live and checked against the re-run's trace.
  assert.match(cap.detail, /\d+ tap rows verified/);
  assert.ok(live.taps.some((t) => t.name === 'layers.0.attn.out'), 'no per-tap summaries in the live record');
  assert.ok(live.taps.some((t) => t.name === 'logits'));
  const r = await replay(cap.trace);
  assert.equal(r.code, 0, `lockstep replay exited ${r.code}:\n${r.stdout}\n${r.stderr}`);
  const rep = JSON.parse(r.stdout);
  assert.equal(rep.deterministic, true, rep.verdict);
  assert.match(rep.verdict, /deterministic/i);
  if (text !== undefined) assert.ok(text.length > 0);
}

test('capture header: the trace verifies and replays exactly (non-streaming)', async () => {
  const rid = 'e2e-capture-1';
  const { data, response } = await client.completions.create(
    { model: 'x', prompt: PROMPT, ...sampled, max_tokens: 16 },
    { headers: { 'X-Lockstep-Capture': 'full', 'X-Lockstep-Token': token, 'x-request-id': rid } },
  ).withResponse();
  assert.equal(response.headers.get('x-request-id'), rid);
  await checkCapture(data.lockstep?.captures?.[0], rid, data.choices[0].text);
});

test('capture header: the trace verifies and replays exactly (streaming chat)', async () => {
  const rid = 'e2e-capture-2';
  const { data: stream, response } = await client.chat.completions.create(
    { model: 'x', messages: [{ role: 'user', content: 'Hello' }], max_tokens: 12, seed: 5, temperature: 0.7, stream: true },
    { headers: { 'X-Lockstep-Capture': 'full', 'X-Lockstep-Token': token, 'x-request-id': rid } },
  ).withResponse();
  assert.equal(response.headers.get('x-request-id'), rid);
  const chunks = await collect(stream);
  const capChunk = chunks.find((c) => c.lockstep);
  assert.ok(capChunk, 'no capture chunk');
  assert.equal(capChunk.choices.length, 0);
  await checkCapture(capChunk.lockstep.captures[0], rid);
});

test('capture header without the token is refused (401)', async () => {
  await assert.rejects(
    client.completions.create({ model: 'x', prompt: PROMPT, max_tokens: 4 }, { headers: { 'X-Lockstep-Capture': 'full' } }),
    (e) => e instanceof OpenAI.AuthenticationError && e.status === 401);
});

test('metrics count the captures and no verification failure', async () => {
  const res = await fetch(admin + '/metrics');
  assert.equal(res.status, 200);
  const text = await res.text();
  assert.match(text, /^lockstep_capture_verify_failures_total 0$/m);
  const m = /^lockstep_captures_total\{trigger="request"\} (\d+)/m.exec(text);
  assert.ok(m && Number(m[1]) >= 2, 'captures_total{trigger="request"} < 2');
});
