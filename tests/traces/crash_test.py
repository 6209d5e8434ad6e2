#!/usr/bin/python3
"""tests/traces/crash_test.py — SIGKILL the recorder at random moments; every trace it leaves
must open (our reader: `lockstep inspect --verify`; and h5py) and hold every step up to the
last flush it announced.

The capture driver records a seeded run, flushing after every step and printing
"flushed N" once each flush is durable. A complete run of the same seed is the reference:
since the run is deterministic, each killed trace must hold a prefix of the reference's
rows in every table, at least through step N, byte for byte (compared by content hash).

Usage: crash_test.py DRIVER LOCKSTEP PLUGIN_DIR WORK_DIR FIXTURE_MODEL [KILLS]
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


def run_driver(driver, model, out, extra=()):
    return subprocess.Popen([driver, "--model", model, "--out", out, "--print-flushes", "--flush-interval", "0",
                             "--max-tokens", "60", "--kv", "fp8_e4m3", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def tables(f):
    out = ["sampling", "steps", "step_batch"]
    for group in ("taps", "kv"):
        for name, g in f[group].items():
            out.append(f"{group}/{name}/summary")
    return out


def main():
    driver, lockstep, plugins, work, model = sys.argv[1:6]
    kills = int(sys.argv[6]) if len(sys.argv) > 6 else 20
    os.environ["HDF5_PLUGIN_PATH"] = plugins
    os.makedirs(work, exist_ok=True)
    rng = random.Random(int(os.environ.get("LOCKSTEP_CRASH_SEED", "20261129")))

    ref_path = os.path.join(work, "reference.h5")
    t0 = time.monotonic()
    p = run_driver(driver, model, ref_path)
    _, err = p.communicate()
    duration = time.monotonic() - t0
    assert p.returncode == 0, err
    ref, _ = open_trace(ref_path)
    ref_steps = read_table(ref, None, "steps")
    ref_rows = {t: read_table(ref, None, t) for t in tables(ref)}

    verified = 0
    attempts = 0
    while verified < kills:
        attempts += 1
        assert attempts < kills * 5, "too few kills landed after the trace was created"
        path = os.path.join(work, f"killed_{verified}.h5")
        for stale in (path, path + ".tails", path + ".partial", path + ".tails.partial"):
            if os.path.exists(stale):
                os.remove(stale)
        p = run_driver(driver, model, path)
        time.sleep(rng.uniform(0.0, duration * 1.1))
        p.send_signal(signal.SIGKILL)
        out, _ = p.communicate()
        lines = out.split("\n")
        flushed = max([int(l.split()[1]) for l in lines if l.startswith("flushed ")], default=0)
        if not os.path.exists(path):
            # The trace appears (renamed from .partial) at its first flush, whole.
            assert flushed == 0, f"kill {verified}: {flushed} steps flushed but no trace at {path}"
            continue

        # Our reader: opens, every stored row matches its hash, and the steps are there.
        r = subprocess.run([lockstep, "inspect", "--verify", "--json", path], capture_output=True, text=True)
        assert r.returncode == 0, f"kill {verified}: lockstep inspect failed: {r.stderr.strip()}"
        info = json.loads(r.stdout)
        assert info["steps"] >= flushed, f"kill {verified}: {info['steps']} steps < {flushed} flushed"
        assert info["flushed_steps"] >= flushed

        # h5py, with the documented tail rule: a prefix of the reference in every table.
        f, side = open_trace(path)
        steps = read_table(f, side, "steps")
        assert len(steps) >= flushed, f"kill {verified}: h5py sees {len(steps)} steps < {flushed}"
        for t in tables(f):
            rows = read_table(f, side, t)
            want = ref_rows[t]
            assert len(rows) <= len(want), f"kill {verified}: {t} has more rows than the complete run"
            if t in ("steps",):
                assert np.array_equal(rows["step"], want["step"][:len(rows)])
                continue
            if t == "sampling":
                assert np.array_equal(rows["token"], want["token"][:len(rows)]), f"kill {verified}: tokens"
                assert np.sum(rows["step"] < flushed) == np.sum(want["step"] < flushed), f"kill {verified}: sampling"
                continue
            if t == "step_batch":
                assert np.array_equal(rows, want[:len(rows)])
                continue
            assert np.array_equal(rows["hash"], want["hash"][:len(rows)]), f"kill {verified}: {t} differs from the run"
            # Every row produced by a flushed step is there.
            need = int(np.sum(want["step"] < flushed))
            assert len(rows) >= need, f"kill {verified}: {t} holds {len(rows)} rows, steps < {flushed} made {need}"
        check_summaries(f, side, "taps")
        check_summaries(f, side, "kv")
        f.close()
        if side is not None:
            side.close()
        print(f"kill {verified}: after {flushed}/{len(ref_steps)} flushed steps "
              f"({'complete' if info['complete'] else 'incomplete'}): {info['steps']} steps readable")
        verified += 1
    print(f"{verified} kills verified with lockstep inspect --verify and h5py")


if __name__ == "__main__":
    main()
