"""python3 -m lockstep — the package's commands.

  python3 -m lockstep import openai FILE -m MODEL -o OUT.h5 [--source TEXT] [--json]
  python3 -m lockstep verify TRACE.h5

Errors are one line on stderr naming the file and the field, exit 1; usage errors exit 2."""
import argparse
import json
import sys

from ._format import TraceError


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m lockstep", description=__doc__.splitlines()[0])
    ap.add_argument("--plugin-path", help="folder holding libh5zstd_lockstep.so (default: $HDF5_PLUGIN_PATH, "
                    "$LOCKSTEP_HDF5_PLUGIN_DIR, the checkout's build/hdf5-plugins)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    imp = sub.add_parser("import", help="make a trace from another engine's output")
    isub = imp.add_subparsers(dest="kind", required=True)
    oa = isub.add_parser("openai", help="completions with token ids and logprobs (vLLM, sglang, lockstep serve)",
                         description="Each choice of each response becomes a request whose generated tokens are "
                         "the response's and whose top-k logits rows are its logprobs (logsumexp 0). Replay it "
                         "with `lockstep replay OUT --mode forced`.")
    oa.add_argument("file", help="a response (JSON), an array of them, or JSONL; {request, response} pairs too")
    oa.add_argument("-m", "--model", required=True, help="the checkpoint folder the server ran (fingerprinted)")
    oa.add_argument("-o", "--output", required=True, help="trace to write (replaced)")
    oa.add_argument("--source", default=None, help="meta.source (default: guessed from the responses)")
    oa.add_argument("--json", action="store_true", help="print what was imported as JSON")
    ver = sub.add_parser("verify", help="check every stored row against its XXH3-64 hash")
    ver.add_argument("trace")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "import":
            from .import_openai import import_openai
            r = import_openai(a.file, a.model, a.output, source=a.source, plugin_path=a.plugin_path)
            if a.json:
                print(json.dumps(r))
            else:
                print(f"{r['output']}: {r['requests']} request(s), {r['tokens']} generated tokens, top-{r['k']} "
                      f"logprobs, {r['prompt_rows']} prompt rows (source: {r['source']}); replay it with "
                      f"`lockstep replay {r['output']} --mode forced`")
        elif a.cmd == "verify":
            from .reader import open_trace
            with open_trace(a.trace, a.plugin_path) as t:
                print(f"{a.trace}: {t.verify()} stored rows match their content hashes")
    except TraceError as e:
        print(f"lockstep: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
