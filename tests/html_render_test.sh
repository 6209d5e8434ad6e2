#!/usr/bin/env bash
# tests/html_render_test.sh — the diff's HTML report renders in a real browser and shows what
# the traces hold. A 12-layer copy of a fixture model (so that string order would put
# layers.10 before layers.2) records two requests; a teacher-forced replay with an FP8 KV cache
# writes the report; headless Chromium (Debian's `chromium`) loads it. The rendered DOM is
# checked against numbers computed here from the traces themselves (`lockstep export` of the
# logits, `lockstep inspect --json` of the tokens), not from the diff: the verdict's flip count
# and max KL, every KL point and top-1 flip per position, the flips on the token strip, the
# colour bar, the position axis, both requests selectable, layers in natural order. A free
# replay must mark the fork where the forced one first flipped; an exact replay must draw every
# heatmap cell as bit-identical. The screenshot must not be blank.
# Usage: html_render_test.sh LOCKSTEP_BINARY SOURCE_DIR [KEEP_DIR]  (KEEP_DIR: keep the files)
set -u
LS=$1
SRC=$2
CHROME=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$CHROME" ]; then
  echo "SKIP: no chromium on this machine (tools/install-deps.sh installs Debian's chromium)"
  exit 0
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
KEEP=${3:-}

# A 12-layer model: v3_basic's layers 0–2, then layer 2's weights again as layers 3–11.
python3 - "$SRC/tests/fixtures/models/v3_basic" "$TMP/m12" 12 <<'EOF' || exit 1
import json, os, shutil, struct, sys
src, dst, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.makedirs(dst)
with open(os.path.join(src, 'model.safetensors'), 'rb') as f:
    hl = struct.unpack('<Q', f.read(8))[0]
    head = json.loads(f.read(hl))
    data = f.read()
cfg = json.load(open(os.path.join(src, 'config.json')))
last = 'model.layers.%d.' % (cfg['num_hidden_layers'] - 1)
t = {k: (v['dtype'], v['shape'], data[v['data_offsets'][0]:v['data_offsets'][1]])
     for k, v in head.items() if k != '__metadata__'}
for l in range(cfg['num_hidden_layers'], n):
    t.update({'model.layers.%d.' % l + k[len(last):]: v for k, v in list(t.items()) if k.startswith(last)})
cfg['num_hidden_layers'] = n
json.dump(cfg, open(os.path.join(dst, 'config.json'), 'w'), indent=2)
shutil.copy(os.path.join(src, 'generation_config.json'), dst)
hdr, off = {'__metadata__': {'format': 'pt'}}, 0
for k in sorted(t):
    hdr[k] = {'dtype': t[k][0], 'shape': t[k][1], 'data_offsets': [off, off + len(t[k][2])]}
    off += len(t[k][2])
h = json.dumps(hdr).encode()
h += b' ' * (-len(h) % 8)
with open(os.path.join(dst, 'model.safetensors'), 'wb') as g:
    g.write(struct.pack('<Q', len(h)) + h + b''.join(t[k][2] for k in sorted(t)))
EOF

printf '%s\n' '{"id":"alpha","prompt_ids":[5,6,7,8,9,10,11,12]}' '{"id":"beta","prompt_ids":[40,41,42,43,44]}' >"$TMP/prompts.jsonl"
"$LS" record -m "$TMP/m12" --prompts "$TMP/prompts.jsonl" -n 8 -o "$TMP/a.h5" -q --logits full || exit 1
"$LS" replay "$TMP/a.h5" --mode forced --kv-cache fp8_e4m3 -o "$TMP/b.h5" -q --html "$TMP/report.html" >/dev/null || exit 1
"$LS" replay "$TMP/a.h5" --mode free --kv-cache fp8_e4m3 -o "$TMP/c.h5" -q --html "$TMP/free.html" >/dev/null || exit 1
"$LS" replay "$TMP/a.h5" -o "$TMP/e.h5" -q --html "$TMP/exact.html" >/dev/null || exit 1
for t in a b c; do "$LS" inspect --json "$TMP/$t.h5" >"$TMP/$t.json" || exit 1; done
for t in a b; do
  for r in 0 1; do
    "$LS" export "$TMP/$t.h5" -r $r --tap logits -o "$TMP/$t.$r.npy" --positions-out "$TMP/$t.$r.pos.npy" || exit 1
  done
done

FLAGS=(--headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking
       --disable-component-update --disable-sync --user-data-dir="$TMP/profile")
dump() { timeout 60 "$CHROME" "${FLAGS[@]}" --dump-dom "$1" >"$2" 2>>"$TMP/chrome.log"; }
dump "file://$TMP/report.html" "$TMP/dom.html"
dump "file://$TMP/report.html#request-1" "$TMP/dom1.html"
dump "file://$TMP/free.html" "$TMP/free-dom.html"
dump "file://$TMP/exact.html" "$TMP/exact-dom.html"
timeout 60 "$CHROME" "${FLAGS[@]}" --window-size=1200,2000 --screenshot="$TMP/shot.png" "file://$TMP/report.html" \
  >/dev/null 2>>"$TMP/chrome.log"
[ -n "$KEEP" ] && mkdir -p "$KEEP" && cp "$TMP"/*.html "$TMP/shot.png" "$KEEP"/

python3 - "$TMP" <<'EOF'
import html.parser, json, math, os, re, struct, sys, zlib
T = sys.argv[1]
fails = []
def check(ok, msg):
    if not ok: fails.append(msg)

# ---- the oracle, from the traces --------------------------------------------------------
def npy(path):
    b = open(path, 'rb').read()
    hl = struct.unpack('<H', b[8:10])[0]
    h = b[10:10 + hl].decode()
    shape = tuple(int(x) for x in re.search(r"'shape': \(([^)]*)\)", h).group(1).split(',') if x.strip())
    code = {'<f4': 'f', '<i8': 'q'}[re.search(r"'descr': '([^']+)'", h).group(1)]
    vals = struct.unpack('<%d%s' % (len(b[10 + hl:]) // struct.calcsize(code), code), b[10 + hl:])
    cols = shape[1] if len(shape) > 1 else 1
    return [list(vals[i * cols:(i + 1) * cols]) for i in range(shape[0])] if len(shape) > 1 else list(vals)
def logsoftmax(x):
    m = max(x)
    z = math.log(sum(math.exp(v - m) for v in x)) + m
    return [v - z for v in x]
def argmax(x):
    return max(range(len(x)), key=lambda i: (x[i], -i))
oracle = {}
for r in (0, 1):
    la, lb = npy(f'{T}/a.{r}.npy'), npy(f'{T}/b.{r}.npy')
    pa, pb = npy(f'{T}/a.{r}.pos.npy'), npy(f'{T}/b.{r}.pos.npy')
    assert pa == pb, 'logit positions differ between the traces'
    rows = {}
    for p, x, y in zip(pa, la, lb):
        lp, lq = logsoftmax(x), logsoftmax(y)
        rows[p] = (max(0.0, sum(math.exp(a) * (a - b) for a, b in zip(lp, lq))), argmax(x) != argmax(y))
    oracle[r] = rows
reqs = {t: {q['id']: q for q in json.load(open(f'{T}/{t}.json'))['requests']} for t in 'abc'}
total_flips = sum(f for r in oracle.values() for _, f in r.values())
max_kl = max(kl for r in oracle.values() for kl, _ in r.values())
check(total_flips > 0, 'the FP8 cache flips no top-1 token on this fixture: the flip checks below test nothing')

# ---- the rendered DOM -------------------------------------------------------------------
class Dom(html.parser.HTMLParser):
    """Every element with its attributes, text and the ids of the elements around it."""
    VOID = {'meta', 'br', 'img', 'input', 'link', 'hr', 'wbr'}
    def __init__(self, text):
        super().__init__()
        self.els, self.stack = [], []
        self.feed(text)
    def handle_starttag(self, tag, attrs):
        e = {'tag': tag, 'a': dict(attrs), 'text': '', 'in': [s['a'].get('id') for s in self.stack if s['a'].get('id')]}
        e['cls'] = set((e['a'].get('class') or '').split())
        self.els.append(e)
        if tag not in self.VOID: self.stack.append(e)
    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in self.VOID: self.stack.pop()
    def handle_endtag(self, tag):
        while self.stack:
            if self.stack.pop()['tag'] == tag: break
    def handle_data(self, d):
        for s in self.stack: s['text'] += d
    def find(self, tag=None, cls=None, inside=None, id=None):
        return [e for e in self.els if (tag is None or e['tag'] == tag) and (cls is None or cls in e['cls'])
                and (inside is None or inside in e['in']) and (id is None or e['a'].get('id') == id)]

dom = Dom(open(f'{T}/dom.html', encoding='utf-8').read())
verdict = dom.find(id='verdict')
check(verdict and 'First divergence' in verdict[0]['text'], 'the verdict is missing or names no first divergence')
fl = dom.find(inside='verdict-flips', cls='v')
check(fl and fl[0]['a'].get('data-flips') == str(total_flips),
      f"verdict: {fl[0]['a'].get('data-flips') if fl else None} top-1 flips, the traces' logits give {total_flips}")
mk = [e for e in dom.find(inside='verdict-kl') if 'data-max-kl' in e['a']]
check(mk and abs(float(mk[0]['a']['data-max-kl']) - max_kl) <= 1e-4 * max_kl + 1e-9,
      f"verdict: max KL {mk[0]['a']['data-max-kl'] if mk else None}, the traces' logits give {max_kl:.6g}")

tabs, secs = dom.find(tag='button', cls='tab'), dom.find(tag='section', cls='request')
check(len(tabs) >= 2 and len(secs) >= 2, f'{len(tabs)} request tabs and {len(secs)} request sections, want 2 of each')
for r in (0, 1):
    pts = dom.find(tag='circle', cls='kl-point', inside=f'kl-chart-{r}')
    got = {int(e['a']['data-position']): (float(e['a']['data-kl']), 'flip' in e['cls']) for e in pts}
    check(set(got) == set(oracle[r]), f'request {r}: KL chart positions {sorted(got)}, logits at {sorted(oracle[r])}')
    for p, (kl, flip) in oracle[r].items():
        if p not in got: continue
        check(abs(got[p][0] - kl) <= 1e-4 * kl + 1e-7, f'request {r} position {p}: KL {got[p][0]} drawn, {kl:.6g} in the traces')
        check(got[p][1] == flip, f'request {r} position {p}: top-1 flip {got[p][1]} drawn, {flip} in the traces')
    marked = {int(e['a']['data-position']) for e in dom.find(tag='span', cls='flip', inside=f'tokens-{r}')}
    want = {p + 1 for p, (_, f) in oracle[r].items() if f}
    check(marked == want, f'request {r}: flips marked on tokens {sorted(marked)}, want {sorted(want)}')
    ent = dom.find(tag='polyline', cls='entropy-a', inside=f'entropy-chart-{r}')
    check(ent and len(ent[0]['a'].get('points', '').split()) == len(oracle[r]),
          f'request {r}: the entropy curve has not one point per logits position')
    bar = [e for e in dom.find(cls='colourbar', inside=f'heatmap-{r}') if e['a'].get('data-scale') == 'log10']
    ticks = [e['text'] for e in dom.find(cls='cb-tick', inside=f'colourbar-{r}')]
    check(bar and len(ticks) >= 3 and all(t.startswith('1') for t in ticks), f'request {r}: no log colour bar with decade ticks ({ticks})')
    xt = [e['text'] for e in dom.find(tag='text', cls='tick', inside=f'heatmap-{r}') if re.fullmatch(r'\d+', e['text'])]
    lab = [e['text'] for e in dom.find(tag='text', cls='axis-label', inside=f'heatmap-{r}')]
    check(len(xt) >= 3 and xt[0] == '0' and 'position (token index)' in lab, f'request {r}: the heatmap has no position axis')
    check(dom.find(cls='boundary', inside=f'heatmap-{r}'), f'request {r}: the prompt/generation boundary is not drawn')
    layers = [e['text'] for e in dom.find(tag='text', cls='layer-label', inside=f'heatmap-{r}')]
    check(layers == [f'layers.{l}' for l in range(12)], f'request {r}: heatmap rows {layers}, want layers.0 … layers.11 in order')
    cells = dom.find(tag='rect', cls='cell', inside=f'heatmap-{r}')
    check(len(cells) >= 12 * 12, f'request {r}: {len(cells)} heatmap cells')
    check(not [c for c in cells if 'err' in c['cls'] and c['a'].get('fill', '').lower() in ('#ffffff', '#fff', 'white')],
          f'request {r}: a cell that differs is drawn white, the colour of bit-identical cells')
    check(dom.find(tag='polyline', cls='layer-curve', inside=f'layer-chart-{r}'), f'request {r}: no per-layer error curve')
names = [e['text'] for e in dom.find(tag='td', cls='tensor-name')]
by_tap = {}  # tap → its layers in the order listed
for m in (re.match(r'layers\.(\d+)\.(.+)', n) for n in names):
    if m: by_tap.setdefault(m.group(2), []).append(int(m.group(1)))
check(by_tap.get('resid_out') == list(range(12)) and all(v == sorted(v) for v in by_tap.values()),
      f'tensor table not in natural layer order: {names[:30]}')
check('layers.2.resid_out' in names and 'layers.10.resid_out' in names and
      names.index('layers.2.resid_out') < names.index('layers.10.resid_out'), 'layers.10 listed before layers.2')

# Switching requests: #request-1 shows request 1 only.
d1 = Dom(open(f'{T}/dom1.html', encoding='utf-8').read())
shown = [s['a'].get('data-request') for s in d1.find(tag='section', cls='request') if 'hidden' not in s['a']]
check(shown == ['1'], f'with #request-1 the sections shown are {shown}, want request 1 alone')
shown0 = [s['a'].get('data-request') for s in secs if 'hidden' not in s['a']]
check(shown0 == ['0'], f'on load the sections shown are {shown0}, want the first divergent request (0) alone')

# A free replay forks where the forced one first flipped (greedy: b's argmax is b's token).
fd = Dom(open(f'{T}/free-dom.html', encoding='utf-8').read())
forks = 0
for r in (0, 1):
    ga, gc = reqs['a'][r]['generated'], reqs['c'][r]['generated']
    n_prompt = reqs['a'][r]['prompt_tokens']
    g = next((i for i, (x, y) in enumerate(zip(ga, gc)) if x != y), -1)
    first_flip = min((p for p, (_, f) in oracle[r].items() if f), default=None)
    if first_flip is not None and first_flip + 1 - n_prompt < len(ga):
        check(g == first_flip + 1 - n_prompt, f'request {r}: the free replay forks at generated token {g}, '
              f'the forced replay first flips at position {first_flip}')
    marked = [int(e['a']['data-position']) for e in fd.find(tag='span', cls='fork', inside=f'tokens-{r}')]
    check(marked == ([n_prompt + g] if g >= 0 else []), f'request {r}: fork marked at {marked}, tokens differ from generated token {g}')
    if g >= 0:
        check(fd.find(cls='fork-line', inside=f'kl-chart-{r}') or fd.find(cls='fork-label', inside=f'kl-chart-{r}'),
              f'request {r}: the KL chart does not mark the fork')
    forks += g >= 0
tv = fd.find(inside='verdict-tokens', cls='v')
check(forks > 0 and tv and f'changed in {forks} of 2' in tv[0]['text'], f'free replay: verdict says {tv[0]["text"] if tv else None!r}')

# An exact replay: every heatmap cell bit-identical, drawn as such.
ed = Dom(open(f'{T}/exact-dom.html', encoding='utf-8').read())
ec = ed.find(tag='rect', cls='cell')
check(ec and all(('identical' in c['cls']) == (c['a'].get('fill') == '#ffffff') for c in ec) and
      sum('identical' in c['cls'] for c in ec) >= 12 * 12, 'exact replay: cells not drawn as bit-identical')
check('ok' in ed.find(id='verdict')[0]['cls'], 'exact replay: the verdict is not "identical"')

# The screenshot: decode the PNG (zlib, the five filters) and count its colours.
b = open(f'{T}/shot.png', 'rb').read()
check(b[:8] == b'\x89PNG\r\n\x1a\n', 'the screenshot is not a PNG')
pos, idat, w = 8, b'', 0
while pos < len(b):
    n, typ = struct.unpack('>I4s', b[pos:pos + 8])
    if typ == b'IHDR': w, h, depth, ctype = struct.unpack('>IIBB', b[pos + 8:pos + 18])
    if typ == b'IDAT': idat += b[pos + 8:pos + 8 + n]
    pos += 12 + n
bpp = {2: 3, 6: 4}[ctype]
raw, stride, prev, colours, inked = zlib.decompress(idat), w * bpp, bytearray(w * bpp), set(), 0
for y in range(min(h, 700)):  # the top of the page: verdict, tabs, the KL chart
    f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
    for i in range(stride):
        a = line[i - bpp] if i >= bpp else 0
        c = prev[i - bpp] if i >= bpp else 0
        if f == 1: line[i] = (line[i] + a) & 255
        elif f == 2: line[i] = (line[i] + prev[i]) & 255
        elif f == 3: line[i] = (line[i] + (a + prev[i]) // 2) & 255
        elif f == 4:
            p = a + prev[i] - c
            pa, pb, pc = abs(p - a), abs(p - prev[i]), abs(p - c)
            line[i] = (line[i] + (a if pa <= pb and pa <= pc else prev[i] if pb <= pc else c)) & 255
    if y % 2 == 0:
        for x in range(0, stride, bpp * 2):
            px = bytes(line[x:x + 3])
            colours.add(px)
            inked += px not in (b'\xff\xff\xff', b'\xf5\xf7\xf9')
    prev = line
frac = inked / ((min(h, 700) + 1) // 2 * ((w + 1) // 2))
check(len(colours) >= 200 and frac > 0.05, f'screenshot looks blank: {len(colours)} colours, {frac:.1%} of pixels not background')

if fails:
    print('\n'.join('FAIL: ' + f for f in fails))
    sys.exit(1)
print(f'ok: {total_flips} top-1 flips and max KL {max_kl:.3g} match the traces; 2 requests selectable; '
      f'screenshot {w}x{h}, {len(colours)} colours, {frac:.0%} inked')
EOF
rc=$?
[ $rc -ne 0 ] && grep -v dbus "$TMP/chrome.log" | tail -5
exit $rc
