#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <fcntl.h>
#include <unistd.h>
#include <time.h>
#include <sys/mman.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <linux/userfaultfd.h>
#define FR (256<<10)
#define FILE_BYTES (512UL<<20)
#define NF (FILE_BYTES/FR)
static const uint64_t P=0x9E3779B185EBCA87ULL;
static inline uint64_t rotl(uint64_t x,int r){return (x<<r)|(x>>(64-r));}
static uint64_t sink;
static void check(const uint8_t*d,size_t n){uint64_t l[8]={1,2,3,4,5,6,7,8};
 for(size_t o=0;o<n;o+=64){const uint64_t*w=(const uint64_t*)(d+o);for(int i=0;i<8;i++)l[i]=rotl((l[i]^w[i])*P,29);}
 for(int i=0;i<8;i++)sink^=l[i];}
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int uffd; uint8_t*dst;
static void ucopy(const void*src){struct uffdio_copy c={.dst=(uint64_t)dst,.src=(uint64_t)src,.len=FR,.mode=0};
 if(ioctl(uffd,UFFDIO_COPY,&c)){perror("copy");exit(1);} madvise(dst,FR,MADV_DONTNEED);}
int main(int argc,char**argv){
 int fd=open("/tmp/mb/seg",O_RDWR|O_CREAT,0600); 
 uint8_t*b=malloc(FR); for(size_t i=0;i<NF;i++){for(size_t j=0;j<FR;j+=8)*(uint64_t*)(b+j)=i*FR+j; pwrite(fd,b,FR,i*FR);}
 uint8_t*map=mmap(0,FILE_BYTES,PROT_READ,MAP_SHARED,fd,0);
 uffd=syscall(SYS_userfaultfd,O_CLOEXEC|O_NONBLOCK); struct uffdio_api api={.api=UFFD_API}; ioctl(uffd,UFFDIO_API,&api);
 dst=mmap(0,FR,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);
 struct uffdio_register r={.range={(uint64_t)dst,FR},.mode=UFFDIO_REGISTER_MODE_MISSING}; if(ioctl(uffd,UFFDIO_REGISTER,&r)){perror("reg");return 1;}
 uint8_t*buf=aligned_alloc(4096,FR); memset(buf,1,FR); uint8_t*scr=aligned_alloc(4096,16384);
 const char*names[]={"file: copy from map","now: pread+check+copy","map: check map+copy from map","scratch: pread16K+check, copy from map","pread+copy (no check)","check only (map)","populate+check map+copy map","copy from prepopulated map","copy from buffer","populate only"};
 double best[10], sum[10]={0}; for(int k=0;k<10;k++)best[k]=1e9;
 for(int round=0;round<7;round++) for(int v=0;v<10;v++){ if(v==7) madvise(map,FILE_BYTES,22);
  double t0=now();
  for(size_t i=0;i<NF;i++){const uint8_t*m=map+i*FR;
   switch(v){
   case 0: ucopy(m); madvise((void*)m,FR,MADV_DONTNEED); break;
   case 1: pread(fd,buf,FR,i*FR); check(buf,FR); ucopy(buf); break;
   case 2: check(m,FR); ucopy(m); madvise((void*)m,FR,MADV_DONTNEED); break;
   case 3: for(size_t o=0;o<FR;o+=16384){pread(fd,scr,16384,i*FR+o);check(scr,16384);} ucopy(m); madvise((void*)m,FR,MADV_DONTNEED); break;
   case 4: pread(fd,buf,FR,i*FR); ucopy(buf); break;
   case 5: check(m,FR); madvise((void*)m,FR,MADV_DONTNEED); break;
   case 7: ucopy(m); break;
   case 8: ucopy(buf); break;
   case 9: madvise((void*)m,FR,22); madvise((void*)m,FR,MADV_DONTNEED); break;
   case 6: madvise((void*)m,FR,22); check(m,FR); ucopy(m); madvise((void*)m,FR,MADV_DONTNEED); break;
   }}
  double t=(now()-t0)/NF*1e6; if(round>0){sum[v]+=t; if(t<best[v])best[v]=t;}
 }
 for(int v=0;v<10;v++)printf("%-42s mean %.1f us/frame  min %.1f  (%.2fx file)\n",names[v],sum[v]/6,best[v],sum[v]/sum[0]);
 unlink("/tmp/mb/seg"); return sink==42;}
