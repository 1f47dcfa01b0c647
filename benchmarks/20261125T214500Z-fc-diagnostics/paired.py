import sys,collections,statistics,re
d=collections.defaultdict(dict)
for l in open(sys.argv[1]):
    m=re.match(r'^(\d+) (\S+) (\S+) load (\S+) touch (\S+) res (\S+)',l)
    if m: d[int(m[1])][m[2]+'/'+m[3]]=(float(m[5]),float(m[6]))
keys=sorted({k for r in d.values() for k in r})
for k in keys:
    base='file/'+k.split('/')[1]
    rs=[d[r][k][0]/d[r][base][0] for r in d if r>0 and base in d[r] and k in d[r]]
    ts=[d[r][k][0] for r in d if r>0 and k in d[r]]
    cs=[d[r][k][0]-d[r][k][1] for r in d if r>0 and k in d[r]]
    print('%-24s touch med %.3f min %.3f  cost med %.3f  paired/file med %.3f (%.2f-%.2f)'%(k,statistics.median(ts),min(ts),statistics.median(cs),statistics.median(rs),min(rs),max(rs)))
