# nsys_step_summary.py — a decode step kernel by kernel from `nsys stats --report cuda_gpu_trace --format csv`
# (bench/results/gpu-2026-11-26, run 2): groups the trace into steps at each embedding kernel and prints, per
# step, the kernels' count, span and time by kernel; then the mean time of each kernel of a layer.
# Usage: python3 nsys_step_summary.py trace.csv
import csv, re, collections, statistics as st, sys
rows=list(csv.DictReader(open(sys.argv[1])))
ev=[]
for r in rows:
    n=r['Name']; s=int(r['Start (ns)']); d=int(r['Duration (ns)'])
    short=re.sub(r'\(.*','',n); short=re.sub(r'<.*','',short).replace('void ','')
    if n.startswith('[CUDA'): short=n
    ev.append((s,d,short,r['GrdX'],r['Strm']))
ev.sort()
# group into steps starting at k_embed
steps=[];cur=None
for e in ev:
    if e[2]=='k_embed':
        cur=[];steps.append(cur)
    if cur is not None: cur.append(e)
print(len(steps),'groups')
def summary(g):
    ks=[e for e in g if not e[2].startswith('[CUDA')]
    span=(ks[-1][0]+ks[-1][1])-ks[0][0]
    by=collections.defaultdict(lambda:[0,0])
    for e in ks: by[e[2]][0]+=1; by[e[2]][1]+=e[1]
    return len(ks),span,dict(by)
for i,g in enumerate(steps):
    n,span,by=summary(g)
    if i%12==0 or n<200 and i<150:
        pass
sizes=collections.Counter(summary(g)[0] for g in steps)
print(sizes)
# print a few steps fully summarized
for i in range(len(steps)):
    n,span,by=summary(steps[i])
    if n>300: continue
    print(i,n,'span %.1f us'%(span/1e3),' '.join('%s:%d/%.0f'%(k,v[0],v[1]/1e3) for k,v in by.items()))
print('--- per kernel in a layer, no-PDL short steps 114..149 (mean us)')
import itertools
acc=collections.defaultdict(list)
for i in range(114,150):
    ks=[e for e in steps[i] if not e[2].startswith('[CUDA')]
    for j,e in enumerate(ks):
        key = j if j<1 or j>=161 else ((j-1)%5)
        acc[(key,e[2],e[3])].append(e[1]/1e3)
for k,v in sorted(acc.items(), key=lambda x:str(x[0][0])):
    print(k, len(v), '%.2f'%st.mean(v))
print('--- gaps between kernels, no-PDL short steps')
g=[]
for i in range(114,150):
    ks=[e for e in steps[i] if not e[2].startswith('[CUDA')]
    for a,b in zip(ks,ks[1:]): g.append((b[0]-(a[0]+a[1]))/1e3)
print('gap mean %.2f us, sum per step %.1f'%(st.mean(g), sum(g)/36))
print('--- PDL short steps 42..77: start-to-start per kernel index in layer')
acc=collections.defaultdict(list)
for i in range(42,78):
    ks=[e for e in steps[i] if not e[2].startswith('[CUDA')]
    for j in range(len(ks)-1):
        key = j if j<1 or j>=161 else ((j-1)%5)
        acc[(key,ks[j][2])].append((ks[j+1][0]+ks[j+1][1]-ks[j][0]-ks[j][1])/1e3)
for k,v in sorted(acc.items(), key=lambda x:str(x[0][0])):
    print(k, len(v), 'end-to-end %.2f'%st.mean(v))
