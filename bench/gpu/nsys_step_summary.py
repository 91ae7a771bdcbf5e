# nsys_step_summary.py — a decode step kernel by kernel from `nsys stats --report cuda_gpu_trace --format csv`
# (bench/results/gpu-2026-11-26, run 2): groups the trace into steps at each embedding kernel and prints, per
# step, the kernels' count, span and time by kernel; then, over the steps first..last, the mean time of each
# kernel of a layer: its own duration, and end to end (from the end of the kernel before to its own end, which is
# what it adds to a step whose kernels overlap under programmatic launch).
# Usage: python3 nsys_step_summary.py trace.csv [first last]
import collections
import csv
import re
import statistics as st
import sys

rows = list(csv.DictReader(open(sys.argv[1])))
ev = []
for r in rows:
    n = r['Name']
    short = n if n.startswith('[CUDA') else re.sub(r'<.*', '', re.sub(r'\(.*', '', n)).replace('void ', '')
    ev.append((int(r['Start (ns)']), int(r['Duration (ns)']), short, r['GrdX']))
ev.sort()
steps, cur = [], None
for e in ev:
    if e[2] == 'k_embed':
        cur = []
        steps.append(cur)
    if cur is not None and not e[2].startswith('[CUDA'):
        cur.append(e)
for i, ks in enumerate(steps):
    span = ks[-1][0] + ks[-1][1] - ks[0][0]
    by = collections.defaultdict(lambda: [0, 0])
    for e in ks:
        by[e[2]][0] += 1
        by[e[2]][1] += e[1]
    kernels = ' '.join('%s:%d/%.0f' % (k, v[0], v[1] / 1e3) for k, v in by.items())
    print(i, len(ks), 'span %.1f us' % (span / 1e3), kernels)
if len(sys.argv) > 3:
    first, last = int(sys.argv[2]), int(sys.argv[3])
    own, e2e = collections.defaultdict(list), collections.defaultdict(list)
    for ks in steps[first:last + 1]:
        for j, e in enumerate(ks):
            key = (j if j == 0 or j == len(ks) - 1 else (j - 1) % 5, e[2], e[3])
            own[key].append(e[1] / 1e3)
            if j:
                e2e[key].append((e[0] + e[1] - ks[j - 1][0] - ks[j - 1][1]) / 1e3)
    print('steps %d..%d: (index in the layer, kernel, grid): mean own time, mean end to end (us)' % (first, last))
    for k in sorted(own, key=lambda k: (k[0] != 0, k[0])):
        print(k, len(own[k]), '%.2f' % st.mean(own[k]), '%.2f' % st.mean(e2e[k]) if e2e[k] else '-')
