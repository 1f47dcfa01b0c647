import sys,os,time,subprocess,statistics
sys.path.insert(0,'/tmp/fcx'); from fc import *
vm,t0=restore('4k','File','/tmp/fcx/4k.mem')
tpass(vm)
res={}
for r in range(8):
    for mode in ('none','0','1','2'):
        if mode!='none':
            h=subprocess.Popen(['/tmp/fcx/hog',mode],stdin=subprocess.PIPE,stdout=subprocess.PIPE,stderr=subprocess.DEVNULL); h.stdout.readline()
            time.sleep(0.5)
            h.stdin.write(b'\n'); h.stdin.flush()
        x=tpass(vm)
        if mode!='none': h.wait()
        res.setdefault(mode,[]).append(x)
vm.kill()
for k,v in res.items(): print(k,'median %.3f'%statistics.median(v),' '.join('%.3f'%x for x in v))
