#!/usr/bin/env python3
"""tests/kernel_launch_lint.py — CTest kernel_launch_lint: every CUDA kernel of kernels/cuda keeps
the overlapped-launch rule of kernels/cuda/launch.cuh.

LaunchKernel lets a kernel start while the previous one on its stream is still running; a kernel
launched that way must wait (dev::WaitForPrior, or dev::GridDependencySync which waits first)
before it reads any activation, or it computes on stale values — a race no single-run test is
sure to catch. So: no kernel of the folder is launched with <<<…>>> (which would bypass the
setting), and every __global__ function calls dev::GridDependencySync (the stream GEMV's
preamble, which requests weights first, calls WaitForPrior and then GridDependencySync too).
"""
import pathlib
import re
import sys

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".") / "kernels" / "cuda"
problems = []
kernels = 0
for path in sorted(list(root.glob("*.cu")) + list(root.glob("*.cuh"))):
    # Comments blanked out (line numbers kept): they may show the syntax they warn against.
    text = re.sub(r"//[^\n]*|/\*.*?\*/", lambda c: re.sub(r"[^\n]", " ", c.group(0)), path.read_text(), flags=re.S)
    for m in re.finditer(r"<<<", text):
        line = text.count("\n", 0, m.start()) + 1
        problems.append(f"{path}:{line}: a <<<…>>> launch (use LaunchKernel, kernels/cuda/launch.cuh)")
    for m in re.finditer(r"__global__[^{;]*?\([^{;]*\)\s*\{", text, re.S):
        kernels += 1
        # The body: from the brace to its match.
        i, depth = m.end(), 1
        while depth and i < len(text):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        body = text[m.end():i]
        if "dev::GridDependencySync()" not in body:
            line = text.count("\n", 0, m.start()) + 1
            name = [n for n in re.findall(r"(\w+)\s*\(", m.group(0)) if n != "__launch_bounds__"][0]
            problems.append(f"{path}:{line}: kernel {name} never calls dev::GridDependencySync()")
if kernels == 0:
    problems.append(f"{root}: no __global__ kernels found (wrong source directory?)")
for p in problems:
    print(p)
print(f"kernel_launch_lint: {kernels} kernels checked, {len(problems)} problem(s)")
sys.exit(1 if problems else 0)
