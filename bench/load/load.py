#!/usr/bin/env python3
# bench/load/load.py — bench/load/load.mjs (issue 7's bounded loopback load test) for machines
# without Node: Python 3.7+ standard library only. Same options, same checks, same JSON summary
# (plus config.client = "load.py"), so its figures compare with load.mjs's.
#
# N concurrent clients (default 64, one thread each) stream completions until a fixed total of
# requests has been sent; every request records its time to first token (TTFT) and the gaps
# between its text chunks (ITL), and must end with `data: [DONE]`. Meanwhile a poller in its own
# process (so the client threads' GIL cannot delay it) times the admin /metrics every 200 ms
# (must stay under 100 ms), beside a control request to a trivial server in a third process that
# tells a machine stall (not judged, counted, at most a tenth of the ticks) from /metrics waiting
# behind the server's work (judged). Every --capture-every'th request asks for a capture
# (X-Lockstep-Capture) and --admin-captures finished ones are captured through
# POST /admin/capture/{id}; each must say verified, and so must its <id>.live.json sidecar.
# Prints a table and, as the last line of stdout, the JSON summary; exits 1 if any request was
# lost or any check failed, 2 on the hard timeout. Loopback only.
#
#   python3 bench/load/load.py --bin build/lockstep                      # starts its own server
#   python3 bench/load/load.py --bin .gpu-bin/lockstep --server-arg=--backend --server-arg=cuda
#   python3 bench/load/load.py --api http://127.0.0.1:8000/v1 --admin http://127.0.0.1:8001 --token-file tok.txt
import argparse, datetime, http.client, json, math, multiprocessing, os, re, secrets, shutil
import socket, subprocess, sys, tempfile, threading, time, urllib.parse

PROMPTS = ['The quick brown fox', '<!DOCTYPE html>', 'def fibonacci(n):', 'Once upon a time, in a land far away,',
           'SELECT name FROM users WHERE', 'The capital of France is', '1, 2, 3, 5, 8,', 'Dear Sir or Madam,']
LOOPBACK = {'127.0.0.1', 'localhost', '::1'}
# The control server: a separate process answering "ok" over keep-alive HTTP/1.1.
CONTROL_SERVER = r'''
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'
    def do_GET(self):
        self.send_response(200); self.send_header('Content-Length', '2'); self.end_headers(); self.wfile.write(b'ok')
    def log_message(self, *a): pass
s = http.server.ThreadingHTTPServer(('127.0.0.1', 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
'''


def now_ms():
    return time.perf_counter() * 1000.0


def parse_args(argv):
    p = argparse.ArgumentParser(description='bounded loopback load test for `lockstep serve` (load.mjs in Python)',
                                allow_abbrev=False)
    def nonneg(v):  # a number ≥ 0, kept an int where it is one (so the JSON reads as load.mjs's)
        x = float(v)
        if not math.isfinite(x) or x < 0: raise ValueError(v)
        return int(x) if x == int(x) else x
    p.add_argument('--bin', default=''); p.add_argument('--api', default=''); p.add_argument('--admin', default='')
    p.add_argument('--token-file', default='')
    p.add_argument('--clients', type=nonneg, default=64); p.add_argument('--requests', type=nonneg, default=512)
    p.add_argument('--max-tokens', type=nonneg, default=32); p.add_argument('--capture-every', type=nonneg, default=64)
    p.add_argument('--capture-mode', choices=['summary', 'full'], default='summary')
    p.add_argument('--admin-captures', type=nonneg, default=2)
    p.add_argument('--metrics-interval-ms', type=nonneg, default=200); p.add_argument('--metrics-limit-ms', type=nonneg, default=100)
    p.add_argument('--timeout-s', type=nonneg, default=600)
    p.add_argument('--server-arg', action='append', default=[], help='one flag for `lockstep serve`; repeat (use --server-arg=--flag)')
    p.add_argument('--temperature', type=nonneg, default=0.8); p.add_argument('--label', default=''); p.add_argument('--out', default='')
    o = p.parse_args(argv)
    for k in ('clients', 'requests', 'max_tokens', 'capture_every', 'admin_captures'):
        setattr(o, k, int(getattr(o, k)))
    o.api, o.admin = o.api.rstrip('/'), o.admin.rstrip('/')
    if not o.bin and not (o.api and o.admin): p.error('give --bin (start a server) or --api and --admin')
    if o.clients < 1 or o.requests < 1: p.error('--clients and --requests must be ≥ 1')
    return o


def pct(xs, p):
    if not xs: return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]


def r3(x):  # as load.mjs's Math.round(x * 1000) / 1000
    return None if x is None else math.floor(x * 1000 + 0.5) / 1000


def stats(xs):
    return {'n': len(xs), 'p50': r3(pct(xs, 50)), 'p90': r3(pct(xs, 90)), 'p99': r3(pct(xs, 99)), 'max': r3(pct(xs, 100))}


def connect(base, timeout):
    """A keep-alive connection to base's host with TCP_NODELAY (as Node's http sets)."""
    u = urllib.parse.urlsplit(base)
    if u.hostname not in LOOPBACK: raise SystemExit(f'load: {base}: not loopback; this load test runs on loopback only')
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    c.connect()
    c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return c


def http_once(base, path, method='GET', body=None, headers=None, timeout=30):
    c = connect(base, timeout)
    try:
        c.request(method, urllib.parse.urlsplit(base).path + path, body=body, headers=headers or {})
        r = c.getresponse()
        return r.status, r.read().decode('utf-8', 'replace')
    finally:
        c.close()


# ---- the /metrics poller (its own process: not delayed by the streams' threads) ----
# Each tick times /metrics and, at the same moment (a second thread), a control request to the
# control server. A control answer that is itself slow says the machine stalled at that moment,
# not that /metrics waited behind the server's streams; main() counts such ticks as stalls.
def poller(metrics_base, control_base, interval_ms, started, stop, conn):
    conns = {}
    def once(base, path, out):
        t0 = now_ms()
        try:
            if base not in conns: conns[base] = connect(base, 5)
            conns[base].request('GET', path)
            r = conns[base].getresponse()
            n = len(r.read())
            out.update(ms=now_ms() - t0, status=r.status, bytes=n)
        except Exception as e:  # noqa: BLE001 — any failure is a failed tick
            conns.pop(base, None)
            out.update(ms=now_ms() - t0, status=0, error=str(e))
    ticks = []
    started.set()
    while not stop.is_set():
        t0 = now_ms()
        m, c = {}, {}
        th = threading.Thread(target=once, args=(control_base, '/', c)); th.start()
        once(metrics_base, urllib.parse.urlsplit(metrics_base).path + '/metrics', m)
        th.join()
        m['control_ms'] = c['ms']
        ticks.append(m)
        stop.wait(max(0.0, (interval_ms - (now_ms() - t0)) / 1000))
    conn.send(ticks)


def start_server(o, work):
    args = [o.bin, 'serve', '--port', '0', '--admin-port', '0', '--quiet', '--max-concurrent', str(max(64, o.clients)),
            '--capture-dir', os.path.join(work, 'caps'), '--admin-token-file', o.token_file, *o.server_arg]
    try:
        child = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except OSError as e:
        raise SystemExit(f'load: cannot start {o.bin}: {e}')
    log, ready = [], threading.Event()
    found = {}
    def drain():  # keeps the pipe empty for the whole run; the log is read at the end
        size = 0
        for raw in child.stderr:
            line = raw.decode('utf-8', 'replace')
            if size < 1 << 20: log.append(line); size += len(line)
            m = re.search(r'API on (http://[^\s,]+), health/metrics/admin on (http://\S+)', line)
            if m and not ready.is_set(): found.update(api=m[1], admin=m[2]); ready.set()
        ready.set()
    threading.Thread(target=drain, daemon=True).start()
    if not ready.wait(60) or not found:
        child.kill()
        raise SystemExit('load: server did not start in 60 s (or exited):\n' + ''.join(log))
    return child, found['api'].rstrip('/'), found['admin'].rstrip('/'), lambda: ''.join(log)


def main():
    o = parse_args(sys.argv[1:])
    work = tempfile.mkdtemp(prefix='lockstep-load-')
    failures, lock = [], threading.Lock()
    def fail(msg):
        with lock:
            if len(failures) < 50: failures.append(msg)
    server = control = None
    def cleanup():
        for p in (server, control):
            if p is not None and p.poll() is None: p.kill()
        shutil.rmtree(work, ignore_errors=True)
    def hard_timeout():
        print(f'load: hard timeout ({o.timeout_s:g} s) reached', file=sys.stderr)
        print(json.dumps({'ok': False, 'error': f'timed out after {o.timeout_s:g} s', 'failures': failures}), flush=True)
        cleanup()
        os._exit(2)
    hard = threading.Timer(o.timeout_s, hard_timeout); hard.daemon = True; hard.start()

    try:
        token = ''
        if o.bin:
            if not o.token_file:
                o.token_file = os.path.join(work, 'token.txt')
                fd = os.open(o.token_file, os.O_WRONLY | os.O_CREAT, 0o600)
                os.write(fd, (secrets.token_hex(16) + '\n').encode()); os.close(fd)
            server, o.api, o.admin, server_log = start_server(o, work)
        if o.token_file:
            with open(o.token_file) as f: token = f.read().split('\n')[0]
        for u in (o.api, o.admin):
            if urllib.parse.urlsplit(u).hostname not in LOOPBACK: raise SystemExit(f'load: {u}: not loopback')

        control = subprocess.Popen([sys.executable, '-c', CONTROL_SERVER], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        control_base = f'http://127.0.0.1:{int(control.stdout.readline())}'
        ctx = multiprocessing.get_context('spawn')  # a fresh interpreter: no threads forked
        started, stop, (recv, send) = ctx.Event(), ctx.Event(), ctx.Pipe(duplex=False)
        poll_proc = ctx.Process(target=poller, args=(o.admin, control_base, o.metrics_interval_ms, started, stop, send),
                                daemon=True)
        poll_proc.start()
        started.wait(30)  # an interpreter's start-up is not part of the run (load.mjs's worker starts at once)

        run_id = secrets.token_hex(3)
        ttft, itl, e2e = [], [], []
        n = {'next': 0, 'ok': 0, 'lost': 0, 'done': 0, 'tokens': 0, 'chunks': 0}
        cap = {'asked': 0, 'verified': 0, 'failed': 0, 'sidecars_verified': 0, 'admin_asked': 0, 'admin_verified': 0}
        admin_at = {(k + 1) * o.requests // (o.admin_captures + 1) for k in range(o.admin_captures)}
        def bump(d, k, by=1):
            with lock: d[k] += by

        def check_capture(c, where):
            if c.get('error') or not c.get('verified'):
                bump(cap, 'failed'); fail(f"{where}: capture {c.get('request_id', '')} did not verify: {c.get('error') or c.get('detail')}")
                return False
            live = c.get('live_record')
            if live and os.path.exists(live):
                with open(live) as f: v = json.load(f).get('verified')
                if v is not True:
                    bump(cap, 'failed'); fail(f'{where}: {live} says verified={v}'); return False
                bump(cap, 'sidecars_verified')
            return True

        def one(conn, i):
            """One streaming completion on conn; returns False when the connection is unusable."""
            rid = f'load-{run_id}-{i}'
            capture = o.capture_every > 0 and i % o.capture_every == o.capture_every - 1
            body = json.dumps({'model': 'x', 'prompt': PROMPTS[i % len(PROMPTS)], 'max_tokens': o.max_tokens,
                               'temperature': o.temperature, 'seed': i, 'ignore_eos': True, 'stream': True,
                               'stream_options': {'include_usage': True}}).encode()
            headers = {'content-type': 'application/json', 'x-request-id': rid}
            if capture:
                headers.update({'X-Lockstep-Capture': o.capture_mode, 'X-Lockstep-Token': token}); bump(cap, 'asked')
            t0 = now_ms()
            last, got_done, usage, captures, failed, ev = 0.0, False, None, None, False, []
            my_ttft, my_itl = [], []
            try:
                conn.request('POST', urllib.parse.urlsplit(o.api).path + '/completions', body=body, headers=headers)
                res = conn.getresponse()
                if res.status != 200:
                    text = res.read().decode('utf-8', 'replace')
                    bump(n, 'lost'); fail(f'{rid}: HTTP {res.status} {text[:200]}'); return True
                for raw in iter(res.readline, b''):  # one SSE line at a time, as it arrives
                    t = now_ms()
                    line = raw.decode('utf-8').rstrip('\r\n')
                    if line: ev.append(line); continue
                    event, ev = '\n'.join(ev), []
                    if not event.startswith('data: '): continue
                    payload = event[6:]
                    if payload == '[DONE]': got_done = True; continue
                    try: j = json.loads(payload)
                    except ValueError: failed = True; fail(f'{rid}: bad event {payload[:100]}'); continue
                    if j.get('error'): failed = True; fail(f"{rid}: error event {json.dumps(j['error'])}"); continue
                    usage = j.get('usage') or usage
                    if j.get('lockstep'): captures = j['lockstep'].get('captures')
                    if j.get('choices') and j['choices'][0].get('text'):
                        bump(n, 'chunks')
                        (my_ttft if last == 0 else my_itl).append(t - (t0 if last == 0 else last))
                        last = t
            except (OSError, http.client.HTTPException) as e:
                bump(n, 'lost'); fail(f'{rid}: {e!r}'); return False
            with lock: e2e.append(now_ms() - t0); ttft.extend(my_ttft); itl.extend(my_itl)
            if got_done: bump(n, 'done')
            else: failed = True; fail(f'{rid}: stream ended without [DONE]')
            if not usage or usage.get('completion_tokens') != o.max_tokens: failed = True; fail(f'{rid}: usage {json.dumps(usage)}')
            else: bump(n, 'tokens', usage['completion_tokens'])
            if capture:
                if not captures or len(captures) != 1: failed = True; bump(cap, 'failed'); fail(f'{rid}: no capture chunk')
                elif check_capture(captures[0], rid): bump(cap, 'verified')
            bump(n, 'lost' if failed else 'ok')
            return True

        def admin_capture(i):
            rid = f'load-{run_id}-{i}'
            bump(cap, 'admin_asked')
            try:
                status, text = http_once(o.admin, f'/admin/capture/{rid}?mode={o.capture_mode}', 'POST', b'{}',
                                         {'content-type': 'application/json', 'authorization': f'Bearer {token}'}, timeout=o.timeout_s)
            except (OSError, http.client.HTTPException) as e:
                status, text = 0, repr(e)
            if status != 200:
                bump(cap, 'failed'); fail(f'admin capture {rid}: HTTP {status} {text[:200]}'); return
            if check_capture(json.loads(text), f'admin {rid}'): bump(cap, 'admin_verified')

        def client():
            conn = None
            while True:
                with lock:
                    if n['next'] >= o.requests: break
                    i = n['next']; n['next'] += 1
                try:
                    conn = conn or connect(o.api, o.timeout_s)
                except OSError as e:
                    bump(n, 'lost'); fail(f'load-{run_id}-{i}: connect: {e!r}'); continue
                if not one(conn, i): conn.close(); conn = None
                if i in admin_at: admin_capture(i)
            if conn: conn.close()

        t0 = now_ms()
        threads = [threading.Thread(target=client, daemon=True) for _ in range(o.clients)]
        for th in threads: th.start()
        for th in threads: th.join()
        wall = (now_ms() - t0) / 1000
        stop.set()
        ticks = recv.recv()
        poll_proc.join()
        control.terminate()

        metrics_ms = [t['ms'] for t in ticks]
        control_ms = [t['control_ms'] for t in ticks]
        metrics_errors, stalls, judged = 0, 0, []
        for t in ticks:
            if t['status'] != 200: metrics_errors += 1; fail(f"/metrics answered {t['status']} {t.get('error', '')}")
            if t['control_ms'] >= o.metrics_limit_ms / 2: stalls += 1  # a machine stall: not judged
            else: judged.append(t['ms'])

        # The server's own view.
        try: m = http_once(o.admin, '/metrics')[1]
        except (OSError, http.client.HTTPException): m = ''
        total = lambda rx: sum(float(x) for x in re.findall(rx, m, re.M))
        server_metrics = {
            'captures_total': total(r'^lockstep_captures_total\{[^}]*\} (\S+)$'),
            'capture_verify_failures_total': total(r'^lockstep_capture_verify_failures_total (\S+)$'),
            'requests_rejected_total': total(r'^lockstep_requests_rejected_total (\S+)$'),
            'request_success_total': total(r'^lockstep_request_success_total\{[^}]*\} (\S+)$'),
            'generation_tokens_total': total(r'^lockstep_generation_tokens_total (\S+)$'),
        }
        server_metrics = {k: int(v) if v == int(v) else v for k, v in server_metrics.items()}

        ok, lost, polls = n['ok'], n['lost'], len(ticks)
        if ok + lost != o.requests: fail(f'accounted {ok + lost} of {o.requests} requests')
        if n['done'] != o.requests: fail(f"[DONE] received {n['done']} of {o.requests}")
        # Every judged tick must answer under the limit; ticks lost to machine stalls are reported,
        # and more than a tenth of them means the run could not judge the bound at all.
        m_max = max(judged) if judged else math.inf
        if polls < max(1, math.floor(wall * 1000 / o.metrics_interval_ms) - 2): fail(f'only {polls} /metrics polls in {wall:.1f} s')
        if m_max >= o.metrics_limit_ms:
            fail(f'/metrics took {m_max:.1f} ms (limit {o.metrics_limit_ms:g} ms) while a control answered in time')
        if stalls > polls / 10:
            fail(f'the machine stalled in {stalls} of {polls} /metrics ticks (control ≥ {o.metrics_limit_ms / 2:g} ms): too loaded to judge the bound')
        if cap['verified'] != cap['asked'] or cap['admin_verified'] != cap['admin_asked']: fail(f'captures: {json.dumps(cap)}')
        if server_metrics['capture_verify_failures_total'] != 0:
            fail(f"server counts {server_metrics['capture_verify_failures_total']} verify failures")
        if server_metrics['requests_rejected_total'] != 0: fail(f"server rejected {server_metrics['requests_rejected_total']} requests")

        summary = {
            'ok': not failures and lost == 0, 'label': o.label,
            'date': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='milliseconds').replace('+00:00', 'Z'),
            'config': {'clients': o.clients, 'requests': o.requests, 'max_tokens': o.max_tokens, 'capture_every': o.capture_every,
                       'capture_mode': o.capture_mode, 'admin_captures': o.admin_captures, 'server_args': o.server_arg,
                       'cpus': os.cpu_count(), 'client': 'load.py'},
            'wall_s': r3(wall), 'requests': {'ok': ok, 'lost': lost, 'done_received': n['done']},
            'tokens': n['tokens'], 'tokens_per_s': r3(n['tokens'] / wall), 'requests_per_s': r3(o.requests / wall),
            'ttft_ms': stats(ttft), 'itl_ms': stats(itl), 'e2e_ms': stats(e2e),
            'metrics_latency_ms': {**stats(metrics_ms), 'judged_max': r3(max(judged)) if judged else None,
                                   'machine_stalls': stalls, 'control': stats(control_ms), 'errors': metrics_errors,
                                   'limit': o.metrics_limit_ms},
            'captures': cap, 'server_metrics': server_metrics, 'failures': failures,
        }
        hard.cancel()
        if server:
            server.terminate()
            try: server.wait(10)
            except subprocess.TimeoutExpired: server.kill(); server.wait()
            if 'DID NOT VERIFY' in server_log():
                summary['ok'] = False; failures.append('server log: CAPTURE DID NOT VERIFY')
    finally:
        cleanup()

    ml, tt, it = summary['metrics_latency_ms'], summary['ttft_ms'], summary['itl_ms']
    rows = [('requests ok / lost / [DONE]', f"{ok} / {lost} / {n['done']} of {o.requests}"),
            ('tokens/s, requests/s', f"{summary['tokens_per_s']}, {summary['requests_per_s']} ({summary['wall_s']} s)"),
            ('TTFT p50 / p90 / p99 / max (ms)', f"{tt['p50']} / {tt['p90']} / {tt['p99']} / {tt['max']}"),
            ('ITL p50 / p90 / p99 / max (ms)', f"{it['p50']} / {it['p90']} / {it['p99']} / {it['max']}"),
            ('/metrics p50 / p99 / max (ms)', f"{ml['p50']} / {ml['p99']} / {ml['max']} (judged max {ml['judged_max']}, limit {o.metrics_limit_ms:g})"),
            ('control max, stalls, polls', f"{ml['control']['max']} ms, {stalls}, {polls}"),
            ('captures verified', f"{cap['verified'] + cap['admin_verified']} / {cap['asked'] + cap['admin_asked']} "
                                  f"({cap['sidecars_verified']} sidecars)")]
    for k, v in rows: print(f'{k:<32} {v}')
    for f in failures: print(f'FAIL {f}')
    print(json.dumps(summary), flush=True)
    if o.out:
        with open(o.out, 'w') as f: f.write(json.dumps(summary, indent=2) + '\n')
    print(f"load: {'PASS' if summary['ok'] else 'FAIL'} {ok}/{o.requests} ok, {summary['tokens_per_s']} tok/s, "
          f"TTFT p50 {tt['p50']} ms p99 {tt['p99']} ms, ITL p50 {it['p50']} ms p99 {it['p99']} ms, "
          f"/metrics max {ml['max']} ms (judged {ml['judged_max']} ms, {stalls} stalls), "
          f"captures {cap['verified'] + cap['admin_verified']}/{cap['asked'] + cap['admin_asked']} verified", file=sys.stderr)
    return 0 if summary['ok'] else 1


if __name__ == '__main__':
    sys.exit(main())
