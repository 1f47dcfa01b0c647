import sys,os,time,subprocess
sys.path.insert(0,'/tmp/fcx'); from fc import *
GM='/work/main/target/release/guestmem'
def guest_range(pid):
    best=None
    for l in open(f'/proc/{pid}/maps'):
        a,b=[int(x,16) for x in l.split()[0].split('-')]
        if best is None or b-a>best[1]-best[0]: best=(a,b)
    return best
def one(rest):
    sock='/tmp/fcx/u.sock'
    if os.path.exists(sock): os.unlink(sock)
    srv=subprocess.Popen([GM,'serve-uffd','--once','--socket',sock,'--mem-file','/tmp/fcx/4k.mem','--regain-huge-pages','off'],stderr=subprocess.DEVNULL)
    while not os.path.exists(sock): time.sleep(0.01)
    time.sleep(0.2)
    vm,t0=restore('4k','Uffd',sock)
    time.sleep(2)
    a,b=guest_range(vm.p.pid)
    base=[tpass(vm) for i in range(3)]
    c=subprocess.Popen(['/tmp/fcx/collapse',str(vm.p.pid),hex(a),str(b-a),str(rest)])
    during=tpass(vm)
    c.wait()
    after=[tpass(vm) for i in range(3)]
    vm.kill(); srv.wait()
    print('rest' if rest else 'full', 'base',' '.join('%.3f'%x for x in base),'during %.3f'%during,'after',' '.join('%.3f'%x for x in after),flush=True)
for i in range(2):
    one(1); one(0)
