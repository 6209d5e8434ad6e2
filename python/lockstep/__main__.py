"""python3 -m lockstep — the package's commands.

  python3 -m lockstep import openai FILE -m MODEL -o OUT.h5 [--source TEXT] [--json]
  python3 -m lockstep import sglang DIR -m MODEL -o OUT.h5 [--map NAME=TAP ...] [--tokens FILE] [--json]
  python3 -m lockstep verify TRACE.h5

Errors are one line on stderr naming the file and the field, exit 1; usage errors exit 2."""
import argparse
import json
import os
import sys

from ._format import TraceError


def _sglang_epilog():
    from .import_sglang import NAME_TABLE
    rows = "\n".join(f"  non_intrusive__{p:52} {t}" for p, t in NAME_TABLE)
    return ("built-in names (the dumper's hooks on sglang's DeepSeek modules; {L} a layer, [.0] optional):\n" + rows +
            "\n  lockstep's own tap names (layers.3.attn.out, or attn.out with a layer_id= tag) map to themselves."
            "\n  input_ids, positions, seq_lens, req_pool_indices, rids: the passes' tokens and requests."
            "\n  Errors: one line naming the file and the field, exit 1 (docs/python.md).")


def main(argv=None):
    # `lockstep import …` (cli/import_cmd.cc) runs this with LOCKSTEP_PROG=lockstep, so usage lines
    # name the command the user typed.
    ap = argparse.ArgumentParser(prog=os.environ.get("LOCKSTEP_PROG") or "python3 -m lockstep",
                                 description=__doc__.splitlines()[0])
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
    sg = isub.add_parser("sglang", help="sglang's debug-dumper tensors (torch.save files), mapped to taps",
                         formatter_class=argparse.RawDescriptionHelpFormatter,
                         description="Reads the .pt files sglang's dumper "
                         "(sglang/srt/debug_utils/dumper.py) wrote for one run, without torch, maps their names to "
                         "lockstep taps and writes a trace whose rows are those tensors at the positions each forward "
                         "pass computed. Replay it with `lockstep replay OUT --mode forced`; `lockstep diff` then "
                         "compares each imported tap with lockstep's reference.", epilog=_sglang_epilog())
    sg.add_argument("dir", help="the dumper's run folder (DUMPER_DIR/<exp_name>, SGLANG_DUMPER_DIR/sglang_dump_<time>) "
                    "or the folder holding exactly one of them")
    sg.add_argument("-m", "--model", required=True, help="the checkpoint folder sglang ran (fingerprinted; required)")
    sg.add_argument("-o", "--output", required=True, help="trace to write (replaced; required)")
    sg.add_argument("--map", action="append", default=[], metavar="NAME=TAP",
                    help="also map dump NAME to TAP (before the built-in table); NAME may hold {L} (a layer number), "
                    "TAP a tap name, a per-layer one (attn.out: the layer from {L} or the dump's layer_id), or - to "
                    "ignore NAME; repeatable (default: none)")
    sg.add_argument("--tokens", default=None, metavar="FILE",
                    help="the requests' tokens when input_ids were not dumped, or to fix the prompt/generation split: "
                    "JSON {\"prompt\": [ids], \"generated\": [ids]}, a list of them (request order), or a "
                    "completions response `import openai` reads (default: from the dumped input_ids)")
    sg.add_argument("--logits-topk", type=int, default=32, metavar="K",
                    help="top-k of the logits kept for vocabularies over 4096; smaller ones are kept whole "
                    "(default: 32)")
    sg.add_argument("--source", default=None,
                    help="meta.source (default: 'sglang dumper (<file naming>): <folder>, <N> forward passes')")
    sg.add_argument("--json", action="store_true", help="print what was imported as JSON (default: a summary line)")
    ver = sub.add_parser("verify", help="check every stored row against its XXH3-64 hash")
    ver.add_argument("trace")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "import" and a.kind == "sglang":
            from .import_sglang import import_sglang
            r = import_sglang(a.dir, a.model, a.output, maps=a.map, tokens=a.tokens, logits_topk=a.logits_topk,
                              source=a.source, plugin_path=a.plugin_path)
            if a.json:
                print(json.dumps(r))
            else:
                print(f"{r['output']}: {r['requests']} request(s), {r['passes']} forward passes, {r['rows']} rows in "
                      f"{r['taps']} taps from {r['files_read']} of {r['files']} dumps "
                      f"({len(r['skipped_names'])} names without a tap); replay it with "
                      f"`lockstep replay {r['output']} --mode forced`")
                for n in r["notes"]:
                    print("note: " + n)
        elif a.cmd == "import":
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
