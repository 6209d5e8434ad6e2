#!/usr/bin/python3
"""tests/traces/crash_test.py — SIGKILL the recorder at random moments; every trace it leaves
must open (our reader: `lockstep inspect --verify`; and h5py) and hold every step up to the
last flush it announced.

The capture driver records a seeded run, flushing after every step and printing
"flushed N" once each flush is durable. A complete run of the same seed is the reference:
since the run is deterministic, each killed trace must hold a prefix of the reference's
rows in every table, at least through step N, byte for byte (compared by content hash).

With --splits SHIM, the kills are not random but aimed at the flushes that restructure a
chunk index (a table's first chunk, a B-tree node split), the rare windows random kills
almost never hit: the run uses 8-row chunks, so every table's index grows past one B-tree
node; SHIM (kill_at_write.so, LD_PRELOAD) first logs the index events in the writes to the trace
(a B-tree node written where none was, a root re-rooted in place), and then kills the
recorder right before, or one or two writes after, chosen events. The test also requires that some of those kills did tear an index, so that it
keeps testing the window (docs/trace-format.md, "Crash safety").

Usage: crash_test.py DRIVER LOCKSTEP PLUGIN_DIR WORK_DIR FIXTURE_MODEL [KILLS] [--splits SHIM]
"""
import json
import os
import random
import signal
import subprocess
import sys
import time

import h5py
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_trace import check_summaries, open_trace, read_table  # noqa: E402


def run_driver(driver, model, out, extra=(), env=None):
    return subprocess.Popen([driver, "--model", model, "--out", out, "--print-flushes", "--flush-interval", "0",
                             "--max-tokens", "60", "--kv", "fp8_e4m3", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def tables(f):
    out = ["sampling", "steps", "step_batch"]
    for group in ("taps", "kv"):
        for name, g in f[group].items():
            out.append(f"{group}/{name}/summary")
    return out


def torn_tables(f):
    """Tables whose chunk index HDF5 cannot read (rows then come from the chunk directory)."""
    torn = 0
    for t in tables(f):
        for name in ("summary", "values") if "/" in t else ("",):
            path = t.rsplit("/", 1)[0] + "/" + name if name else t
            if path not in f:
                continue
            try:
                f[path].id.get_num_chunks()
            except Exception:
                torn += 1
    return torn


def verify(label, path, flushed, lockstep, ref_rows):
    """The killed trace at `path` opens with both readers and holds a prefix of the reference
    through step `flushed`. Returns (steps readable, complete, tables with a torn index)."""
    # Our reader: opens, every stored row matches its hash, and the steps are there.
    r = subprocess.run([lockstep, "inspect", "--verify", "--json", path], capture_output=True, text=True)
    assert r.returncode == 0, f"{label}: lockstep inspect failed: {r.stderr.strip()}"
    info = json.loads(r.stdout)
    assert info["steps"] >= flushed, f"{label}: {info['steps']} steps < {flushed} flushed"
    assert info["flushed_steps"] >= flushed

    # h5py, with the documented tail rule: a prefix of the reference in every table.
    f, side = open_trace(path)
    steps = read_table(f, side, "steps")
    assert len(steps) >= flushed, f"{label}: h5py sees {len(steps)} steps < {flushed}"
    for t in tables(f):
        rows = read_table(f, side, t)
        want = ref_rows[t]
        assert len(rows) <= len(want), f"{label}: {t} has more rows than the complete run"
        if t in ("steps",):
            assert np.array_equal(rows["step"], want["step"][:len(rows)])
            continue
        if t == "sampling":
            assert np.array_equal(rows["token"], want["token"][:len(rows)]), f"{label}: tokens"
            assert np.sum(rows["step"] < flushed) == np.sum(want["step"] < flushed), f"{label}: sampling"
            continue
        if t == "step_batch":
            assert np.array_equal(rows, want[:len(rows)])
            continue
        assert np.array_equal(rows["hash"], want["hash"][:len(rows)]), f"{label}: {t} differs from the run"
        # Every row produced by a flushed step is there.
        need = int(np.sum(want["step"] < flushed))
        assert len(rows) >= need, f"{label}: {t} holds {len(rows)} rows, steps < {flushed} made {need}"
    check_summaries(f, side, "taps")
    check_summaries(f, side, "kv")
    torn = torn_tables(f) if not info["complete"] else 0
    f.close()
    if side is not None:
        side.close()
    return info["steps"], info["complete"], torn


def remove_stale(path):
    for stale in (path, path + ".tails", path + ".partial", path + ".tails.partial", path + ".chunks"):
        if os.path.exists(stale):
            os.remove(stale)


def flushed_steps(out):
    return max([int(l.split()[1]) for l in out.split("\n") if l.startswith("flushed ")], default=0)


def main():
    args = sys.argv[1:]
    shim = None
    if "--splits" in args:
        i = args.index("--splits")
        shim = args[i + 1]
        del args[i:i + 2]
    driver, lockstep, plugins, work, model = args[:5]
    kills = int(args[5]) if len(args) > 5 else 20
    os.environ["HDF5_PLUGIN_PATH"] = plugins
    os.makedirs(work, exist_ok=True)
    rng = random.Random(int(os.environ.get("LOCKSTEP_CRASH_SEED", "20261129")))
    extra = ("--chunk-bytes", "64", "--max-tokens", "230") if shim else ()

    ref_path = os.path.join(work, "reference.h5")
    remove_stale(ref_path)
    env = dict(os.environ)
    log = os.path.join(work, "writes.log")
    if shim:
        if os.path.exists(log):
            os.remove(log)
        env.update(LD_PRELOAD=shim, LOCKSTEP_KILL_PATH=os.path.abspath(ref_path), LOCKSTEP_WRITE_LOG=log)
    t0 = time.monotonic()
    p = run_driver(driver, model, os.path.abspath(ref_path), extra, env)
    _, err = p.communicate()
    duration = time.monotonic() - t0
    assert p.returncode == 0, err
    ref, _ = open_trace(ref_path)
    ref_steps = read_table(ref, None, "steps")
    ref_rows = {t: read_table(ref, None, t) for t in tables(ref)}

    if shim:
        # Index events, numbered by the shim: "new" (a B-tree node where none was) and
        # "reroot" (a root re-rooted in place by a split). Events from the first re-rooting on
        # belong to splits. Kill right before the write holding an event, or 1 or 2 writes
        # after it (the root rewritten, the nodes it now points to not yet).
        split_events, other_events = [], []
        for line in open(log):
            for ev in line.split()[3:]:
                kind, number = ev.split(":")
                if kind == "reroot" or split_events:
                    split_events.append(int(number))
                else:
                    other_events.append(int(number))
        assert split_events, "no chunk index split: the run is too short for the test"
        split_points = [(e, d) for e in split_events for d in (0, 1, 2)]
        other_points = [(e, d) for e in other_events for d in (0, 1)]
        chosen = rng.sample(split_points, min(kills, len(split_points)))
        chosen = sorted(chosen + rng.sample(other_points, min(len(other_points), max(2, kills // 5))))
        torn_total = 0
        for n, (event, delay) in enumerate(chosen):
            path = os.path.abspath(os.path.join(work, f"split_{n}.h5"))
            remove_stale(path)
            env = dict(os.environ, LD_PRELOAD=shim, LOCKSTEP_KILL_PATH=path, LOCKSTEP_KILL_EVENT=f"{event}:{delay}")
            p = run_driver(driver, model, path, extra, env)
            out, _ = p.communicate()
            flushed = flushed_steps(out)
            label = f"kill {delay} writes after index event {event}"
            if not os.path.exists(path):
                assert flushed == 0, f"{label}: {flushed} steps flushed but no trace"
                continue
            steps, complete, torn = verify(label, path, flushed, lockstep, ref_rows)
            torn_total += torn
            print(f"{label}: after {flushed}/{len(ref_steps)} flushed steps: {steps} steps readable"
                  f"{f', {torn} torn chunk indexes recovered' if torn else ''}")
        print(f"{len(chosen)} kills around {len(split_events) + len(other_events)} index events "
              f"({len(split_events)} from splits); {torn_total} torn indexes recovered")
        assert torn_total > 0, "no kill tore a chunk index: the test no longer reaches the window it is for"
        return

    verified = 0
    attempts = 0
    while verified < kills:
        attempts += 1
        assert attempts < kills * 5, "too few kills landed after the trace was created"
        path = os.path.join(work, f"killed_{verified}.h5")
        remove_stale(path)
        p = run_driver(driver, model, path)
        time.sleep(rng.uniform(0.0, duration * 1.1))
        p.send_signal(signal.SIGKILL)
        out, _ = p.communicate()
        flushed = flushed_steps(out)
        if not os.path.exists(path):
            # The trace appears (renamed from .partial) at its first flush, whole.
            assert flushed == 0, f"kill {verified}: {flushed} steps flushed but no trace at {path}"
            continue
        steps, complete, _ = verify(f"kill {verified}", path, flushed, lockstep, ref_rows)
        print(f"kill {verified}: after {flushed}/{len(ref_steps)} flushed steps "
              f"({'complete' if complete else 'incomplete'}): {steps} steps readable")
        verified += 1
    print(f"{verified} kills verified with lockstep inspect --verify and h5py")


if __name__ == "__main__":
    main()
