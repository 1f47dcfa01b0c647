import sys,os,time,subprocess,statistics,random
sys.path.insert(0,'/tmp/fcx'); from fc import *
from ab import VARS, warm
GM='/tmp/gm-exp'
f='/tmp/fcx/4k.mem'; warm(f)
A,_=restore('4k','File',f)
for i in range(2): tpass(A)
def bg(var):
    """start B's server and firecracker; return a function that loads B, and a cleanup."""
    if var=='none': return (lambda: None), (lambda: None)
    if var=='hog':
        h=subprocess.Popen(['/tmp/fcx/hog','1'],stdin=subprocess.PIPE,stdout=subprocess.PIPE,stderr=subprocess.DEVNULL); h.stdout.readline()
        def go(): h.stdin.write(b'\n'); h.stdin.flush()
        return go,(lambda: h.wait())
    if var=='file':
        vm=VM('b')
        def go():
            threading.Thread(target=lambda: vm.call('PUT','/snapshot/load',{"snapshot_path":"/tmp/fcx/4k.vmstate","mem_backend":{"backend_type":"File","backend_path":f},"resume_vm":False})).start()
        return go,(lambda: vm.kill())
    env=dict(os.environ)
    if '-nomap' in var: env['GM_NOMAP']='1'
    if '-norel' in var: env['GM_NOREL']='1'
    sock='/tmp/fcx/b.sock'
    if os.path.exists(sock): os.unlink(sock)
    extra=['--regain-huge-pages','off'] if 'noregain' in var else []
    srv=subprocess.Popen([GM,'serve-uffd','--once','--socket',sock,'--mem-file',f]+extra,stderr=subprocess.DEVNULL,env=env)
    while not os.path.exists(sock): time.sleep(0.005)
    time.sleep(0.1); vm=VM('b')
    def go():
        threading.Thread(target=lambda: vm.call('PUT','/snapshot/load',{"snapshot_path":"/tmp/fcx/4k.vmstate","mem_backend":{"backend_type":"Uffd","backend_path":sock},"resume_vm":False})).start()
    def clean():
        vm.kill(); srv.wait()
    return go,clean
import threading
vs=sys.argv[1].split(','); n=int(sys.argv[2])
res={}
for r in range(n):
    order=vs[:]; random.Random(r).shuffle(order)
    for v in order:
        go,clean=bg(v)
        time.sleep(0.3)
        t=time.time(); go(); A.send(b't'); ts,l=A.line('TOUCH'); x=ts-t
        time.sleep(2.5); clean(); time.sleep(0.5)
        res.setdefault(v,[]).append(x)
for v in vs:
    xs=res[v]; print('%-16s median %.4f min %.4f  %s'%(v,statistics.median(xs),min(xs),' '.join('%.3f'%x for x in xs)))
A.kill()
