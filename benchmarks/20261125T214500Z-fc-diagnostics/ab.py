import sys,os,time,subprocess,statistics,random
sys.path.insert(0,'/tmp/fcx'); from fc import *
GM=os.environ.get('GM','/work/main/target/release/guestmem')
def drop(f):
    fd=os.open(f,os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd,0,0,os.POSIX_FADV_DONTNEED); os.close(fd)
def warm(f):
    with open(f,'rb') as h:
        while h.read(1<<24): pass
def one(var,cache):
    delay=0
    if '+d' in var: var,dd=var.split('+d'); delay=float(dd or 2.0)
    f='/tmp/fcx/4k.mem'
    (drop if cache=='cold' else warm)(f)
    srv=None
    if var=='file':
        vm=VM('r'); be=('File',f)
    else:
        sock='/tmp/fcx/u.sock'
        if os.path.exists(sock): os.unlink(sock)
        gmbin='/tmp/gm-old' if var.startswith('old') else ('/tmp/gm-settle' if var.startswith('settle') else GM)
        args=[gmbin,'serve-uffd','--once','--socket',sock,'--mem-file',f]+VARS[var]
        env=dict(os.environ)
        if var.endswith('-idle'): env['GM_IDLE']='1'
        if '-nomap' in var: env['GM_NOMAP']='1'
        if '-norel' in var: env['GM_NOREL']='1'
        srv=subprocess.Popen(args,stderr=subprocess.DEVNULL,env=env)
        while not os.path.exists(sock): time.sleep(0.005)
        time.sleep(0.1)
        vm=VM('r'); be=('Uffd',sock)
    t0=time.time()
    vm.call('PUT','/snapshot/load',{"snapshot_path":"/tmp/fcx/4k.vmstate","mem_backend":{"backend_type":be[0],"backend_path":be[1]},"resume_vm":True})
    load=time.time()-t0
    if delay: time.sleep(delay)
    vm.send(b't'); ts,l=vm.line('TOUCH'); assert l.endswith('BAD 0'),l
    touch=ts-t0-delay
    res=tpass(vm)
    vm.kill()
    if srv: srv.wait()
    return load,touch,res
VARS={'old':[],'settle':[],'gm-nomap':[],'gm-norel':[],'gm':[],'gm-idle':[],'gm-noregain-idle':['--regain-huge-pages','off'], 'gm-noregain':['--regain-huge-pages','off']}
if __name__=='__main__':
    vars_=sys.argv[1].split(','); caches=sys.argv[2].split(','); n=int(sys.argv[3])
    extra=sys.argv[4:] 
    res={}
    for r in range(n+1):
        combos=[(v,c) for v in vars_ for c in caches]; random.Random(r).shuffle(combos)
        for v,c in combos:
            x=one(v,c)
            if r>0: res.setdefault((v,c),[]).append(x)
            print(r,v,c,'load %.3f touch %.3f res %.3f cost %+.3f'%(x[0],x[1],x[2],x[1]-x[2]),flush=True)
    for k,xs in sorted(res.items()):
        m=lambda i: statistics.median(x[i] for x in xs)
        print('%-14s %-5s load %.3f touch %.3f (min %.3f) res %.3f cost %.3f'%(k[0],k[1],m(0),m(1),min(x[1] for x in xs),m(2),statistics.median(x[1]-x[2] for x in xs)))
