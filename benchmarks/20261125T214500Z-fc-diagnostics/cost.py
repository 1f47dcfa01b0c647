import sys,collections,statistics,re
for fn in sys.argv[1:]:
    d=collections.defaultdict(list)
    for l in open(fn):
        m=re.match(r'^(\d+) (\S+) (\S+) load (\S+) touch (\S+) res (\S+)',l)
        if m and int(m[1])>0: d[m[2]+'/'+m[3]].append((float(m[4]),float(m[5]),float(m[6])))
    print(fn)
    for k,xs in sorted(d.items()):
        inpass=[t-l-r for l,t,r in xs]
        print('  %-22s n %2d load %.4f  in-pass cost med %.4f  q1 %.4f q3 %.4f'%(k,len(xs),statistics.median(l for l,_,_ in xs),statistics.median(inpass),sorted(inpass)[len(xs)//4],sorted(inpass)[3*len(xs)//4]))
