import sys,os,time,subprocess,statistics,random
sys.path.insert(0,'/tmp/fcx'); from fc import *
from ab import warm
RESUME=os.environ.get("RESUME","1")=="1"
GM=os.environ.get('GM','/tmp/gm-exp')
f='/tmp/fcx/4k.mem'; warm(f)
V={'gm':[],'gm-idle':[],'gm-pf0':['--prefetch-threads','0'],'gm-t1':['--threads','1']}
def one(v):
    sock='/tmp/fcx/u.sock'; srv=None
    if v=='file': be={"backend_type":"File","backend_path":f}
    else:
        if os.path.exists(sock): os.unlink(sock)
        env=dict(os.environ)
        if v.endswith('-idle'): env['GM_IDLE']='1'
        srv=subprocess.Popen([GM,'serve-uffd','--once','--socket',sock,'--mem-file',f]+V[v],stderr=subprocess.DEVNULL,env=env)
        while not os.path.exists(sock): time.sleep(0.005)
        be={"backend_type":"Uffd","backend_path":sock}
    time.sleep(0.15)
    vm=VM('r'); time.sleep(0.05)
    t0=time.time(); vm.call('PUT','/snapshot/load',{"snapshot_path":"/tmp/fcx/4k.vmstate","mem_backend":be,"resume_vm":RESUME}); x=time.time()-t0
    time.sleep(0.4); vm.kill()
    if srv: srv.wait()
    return x
vs=sys.argv[1].split(','); n=int(sys.argv[2]); res={}
for r in range(n):
    o=vs[:]; random.Random(r).shuffle(o)
    for v in o: res.setdefault(v,[]).append(one(v))
for v in vs: xs=sorted(res[v]); print('%-8s median %.4f min %.4f q3 %.4f'%(v,statistics.median(xs),xs[0],xs[3*len(xs)//4]))
