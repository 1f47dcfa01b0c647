import sys,os,time,subprocess,re
sys.path.insert(0,'/tmp/fcx'); from fc import *
from ab import warm
T='/sys/kernel/tracing'
def w(p,v): open(f'{T}/{p}','w').write(v)
GM='/tmp/gm-new'
f='/tmp/fcx/4k.mem'; warm(f)
sock='/tmp/fcx/u.sock'
if os.path.exists(sock): os.unlink(sock)
srv=subprocess.Popen([GM,'serve-uffd','--once','--socket',sock,'--mem-file',f],stderr=subprocess.DEVNULL)
while not os.path.exists(sock): time.sleep(0.005)
time.sleep(0.15); vm=VM('r'); time.sleep(0.05)
w('buffer_size_kb','20000'); w('trace','')
w('events/sched/sched_switch/enable','1'); w('events/sched/sched_wakeup/enable','1'); w('events/sched/sched_migrate_task/enable','1')
w('trace_marker','LOAD-START')
t0=time.time(); vm.call('PUT','/snapshot/load',{"snapshot_path":"/tmp/fcx/4k.vmstate","mem_backend":{"backend_type":"Uffd","backend_path":sock},"resume_vm":True}); x=time.time()-t0
w('trace_marker','LOAD-END')
time.sleep(0.01)
w('events/sched/enable','0')
print('load %.4f'%x, 'fc pid',vm.p.pid,'srv pid',srv.pid)
vm.kill(); srv.wait()
