import os, sys, time, socket, subprocess, threading, queue, json, glob
FC='/work/shared/firecracker/firecracker'
GUEST='/work/shared/firecracker/guest.elf'
D='/tmp/fcx'
class VM:
    def __init__(s,name):
        s.api=f'{D}/{name}.api'
        try: os.unlink(s.api)
        except FileNotFoundError: pass
        s.p=subprocess.Popen([FC,'--api-sock',s.api,'--log-path',f'{D}/{name}.log','--level','Warning'],stdin=subprocess.PIPE,stdout=subprocess.PIPE,stderr=subprocess.DEVNULL)
        open(f'{D}/{name}.log','a').close()
        s.q=queue.Queue()
        threading.Thread(target=s.reader,daemon=True).start()
        for i in range(200):
            if os.path.exists(s.api): break
            time.sleep(0.01)
    def reader(s):
        for line in s.p.stdout:
            s.q.put((time.time(),line.decode(errors='replace').strip()))
    def call(s,m,path,body):
        for i in range(500):
            try:
                c=socket.socket(socket.AF_UNIX); c.connect(s.api); break
            except (ConnectionRefusedError,FileNotFoundError):
                c.close(); time.sleep(0.004)
        b=json.dumps(body).encode()
        c.sendall(f'{m} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {len(b)}\r\n\r\n'.encode()+b)
        r=c.recv(65536).decode(); c.close()
        if not (r.startswith('HTTP/1.1 2')): raise Exception(r)
        return r
    def line(s,prefix,t=600):
        end=time.time()+t
        while True:
            ts,l=s.q.get(timeout=end-time.time())
            if l.startswith(prefix): return ts,l
    def send(s,c):
        s.p.stdin.write(c); s.p.stdin.flush()
    def kill(s):
        s.p.kill(); s.p.wait()
    def threads(s):
        out={}
        for t in glob.glob(f'/proc/{s.p.pid}/task/*'):
            out[open(t+'/comm').read().strip()]=int(t.split('/')[-1])
        return out
def boot(name='4k',huge=False):
    vm=VM('boot-'+name)
    vm.call('PUT','/boot-source',{"kernel_image_path":GUEST,"boot_args":"console=ttyS0 reboot=k panic=1"})
    mc={"vcpu_count":1,"mem_size_mib":576}
    if huge: mc["huge_pages"]="2M"
    vm.call('PUT','/machine-config',mc)
    vm.call('PUT','/actions',{"action_type":"InstanceStart"})
    vm.line('READY')
    vm.call('PATCH','/vm',{"state":"Paused"})
    vm.call('PUT','/snapshot/create',{"snapshot_type":"Full","snapshot_path":f"{D}/{name}.vmstate","mem_file_path":f"{D}/{name}.mem"})
    vm.kill()
def restore(name,backend,path):
    vm=VM('r')
    t0=time.time()
    vm.call('PUT','/snapshot/load',{"snapshot_path":f"{D}/{name}.vmstate","mem_backend":{"backend_type":backend,"backend_path":path},"resume_vm":True})
    return vm,t0
def tpass(vm):
    t=time.time(); vm.send(b't'); ts,l=vm.line('TOUCH'); assert l.endswith('BAD 0'),l; return ts-t
if __name__=='__main__':
    if sys.argv[1]=='boot': boot()
