#!/usr/bin/env python3
"""Checks that code running after a register release stays inside the released budget.

After `setmaxnreg.dec N` (SASS: USETMAXREG.DEALLOC ... N) a warp may only use registers
R0..R(N-1); ptxas allocates registers for the whole kernel, so nothing guarantees that the
code the warp then runs (the megakernel's producer, store warp and gather warps) fits. This walks the SASS
control flow from each DEALLOC (branches, fall-through, calls) to the exits and reports the
highest register reached.

    cuobjdump --dump-sass -fun <mangled kernel> build/bin/mok > k.sass
    python3 scripts/check_setmaxnreg.py k.sass      # exit 1 when a path goes over
"""
import re
import sys

INS = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
TARGET = re.compile(r"0x([0-9a-f]+)")


def parse(text):
    ins = []
    for line in text.splitlines():
        m = INS.match(line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    return ins


def regs(op):
    return [int(r) for r in re.findall(r"\bR(\d+)\b", op)]


def check(ins):
    index = {a: i for i, (a, _) in enumerate(ins)}
    worst = []
    for i, (addr, op) in enumerate(ins):
        m = re.search(r"USETMAXREG\.DEALLOC\S*\s+(0x[0-9a-f]+|\d+)", op)
        if not m:
            continue
        budget = int(m.group(1), 0)
        seen, stack, top, where = set(), [i + 1], -1, None
        while stack:
            j = stack.pop()
            while j < len(ins) and j not in seen:
                seen.add(j)
                a, o = ins[j]
                for r in regs(o):
                    if r > top:
                        top, where = r, f"{a:#x}: {o}"
                body = re.sub(r"^@!?U?P\w+\s+", "", o)
                conditional = body != o
                word = body.split()[0] if body.split() else ""
                if word.startswith(("BRA", "CALL", "BRX", "JMP")):
                    t = TARGET.search(body)
                    if t and int(t.group(1), 16) in index:
                        stack.append(index[int(t.group(1), 16)])
                    if word.startswith("BRA") and not conditional and "DIV" not in word:
                        break
                if word.startswith(("EXIT", "RET", "BPT.TRAP")) and not conditional:
                    break  # (a trap ends the thread: no fall-through)
                j += 1
        worst.append((addr, budget, top, where))
    return worst


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    results = check(parse(open(sys.argv[1]).read()))
    if not results:
        print("check_setmaxnreg: no USETMAXREG.DEALLOC in the SASS")
        return 1
    bad = False
    for addr, budget, top, where in results:
        ok = top < budget
        bad |= not ok
        print(f"check_setmaxnreg: DEALLOC to {budget} at {addr:#x}: highest register reached R{top} "
              f"({'ok' if ok else 'OVER BUDGET'}; {where})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
