import sys,os,time,subprocess
sys.path.insert(0,'/tmp/fcx'); from fc import *
from ab import VARS, warm
GM='/tmp/gm-old'
def one(var):
    f='/tmp/fcx/4k.mem'; warm(f); srv=None
    if var=='file': vm=VM('r'); be=('File',f)
    else:
        sock='/tmp/fcx/u.sock'
        if os.path.exists(sock): os.unlink(sock)
        srv=subprocess.Popen([GM,'serve-uffd','--once','--socket',sock,'--mem-file',f]+VARS[var],stderr=subprocess.DEVNULL)
        while not os.path.exists(sock): time.sleep(0.005)
        time.sleep(0.1); vm=VM('r'); be=('Uffd',sock)
    vm.call('PUT','/snapshot/load',{"snapshot_path":"/tmp/fcx/4k.vmstate","mem_backend":{"backend_type":be[0],"backend_path":be[1]},"resume_vm":True})
    tid=vm.threads()['fc_vcpu 0']
    p=subprocess.Popen(['perf','record','-q','-F','4999','-g','-t',str(tid),'-o',f'/tmp/fcx/perf-{var}.data'],stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    t=time.time(); vm.send(b't'); ts,l=vm.line('TOUCH'); t1=ts-t
    p.send_signal(2); p.wait()
    x=tpass(vm)
    vm.kill()
    if srv: srv.wait()
    print(var,'first %.3f res %.3f'%(t1,x))
one('file'); one('gm')
