#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <fcntl.h>
#include <unistd.h>
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <sys/mman.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <linux/userfaultfd.h>
#define FR (256<<10)
#define FILE_BYTES (512UL<<20)
#define NF (FILE_BYTES/FR)
#define RING 16
static const uint64_t P=0x9E3779B185EBCA87ULL;
static inline uint64_t rotl(uint64_t x,int r){return (x<<r)|(x>>(64-r));}
static volatile uint64_t sink;
static void check(const uint8_t*d,size_t n){uint64_t l[8]={1,2,3,4,5,6,7,8};
 for(size_t o=0;o<n;o+=64){const uint64_t*w=(const uint64_t*)(d+o);for(int i=0;i<8;i++)l[i]=rotl((l[i]^w[i])*P,29);}
 for(int i=0;i<8;i++)sink^=l[i];}
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int uffd,fd; uint8_t*dst,*map; uint8_t*bufs[RING];
static void ucopy(uint8_t*d,const void*src){struct uffdio_copy c={.dst=(uint64_t)d,.src=(uint64_t)src,.len=FR,.mode=0};
 if(ioctl(uffd,UFFDIO_COPY,&c)){perror("copy");exit(1);} }
atomic_long produced, consumed; int mode;
static void*producer(void*a){ for(long i=0;i<NF;i++){ while(i-atomic_load(&consumed)>=RING) ; // spin (bench only)
   const uint8_t*m=map+i*FR;
   if(mode==1){pread(fd,bufs[i%RING],FR,i*FR);check(bufs[i%RING],FR);}
   else if(mode==2){madvise((void*)m,FR,22);check(m,FR);}
   atomic_store(&produced,i+1);} return 0;}
int main(){
 fd=open("/tmp/mb/seg",O_RDWR|O_CREAT,0600);
 uint8_t*b=malloc(FR); for(size_t i=0;i<NF;i++){for(size_t j=0;j<FR;j+=8)*(uint64_t*)(b+j)=i*FR+j; pwrite(fd,b,FR,i*FR);}
 map=mmap(0,FILE_BYTES,PROT_READ,MAP_SHARED,fd,0);
 uffd=syscall(SYS_userfaultfd,O_CLOEXEC|O_NONBLOCK); struct uffdio_api api={.api=UFFD_API}; ioctl(uffd,UFFDIO_API,&api);
 dst=mmap(0,FILE_BYTES,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);
 struct uffdio_register r={.range={(uint64_t)dst,FILE_BYTES},.mode=UFFDIO_REGISTER_MODE_MISSING}; if(ioctl(uffd,UFFDIO_REGISTER,&r)){perror("reg");return 1;}
 for(int k=0;k<RING;k++){bufs[k]=aligned_alloc(4096,FR);memset(bufs[k],1,FR);}
 const char*names[]={"file: copy from map (1 thread)","now: B pread+check ring, A copy buf","mapped: B populate+check, A copy map","mapped 1 thread: populate+check+copy"};
 double tt[4][9];
 for(int round=0;round<9;round++) for(int v=0;v<4;v++){
  madvise(dst,FILE_BYTES,MADV_DONTNEED);
  mode=v; atomic_store(&produced,0); atomic_store(&consumed,0); pthread_t th;
  double t0=now();
  if(v==1||v==2) pthread_create(&th,0,producer,0);
  for(long i=0;i<NF;i++){const uint8_t*m=map+i*FR;
   if(v==0){ucopy(dst+i*FR,m);madvise((void*)m,FR,MADV_DONTNEED);}
   else if(v==3){madvise((void*)m,FR,22);check(m,FR);ucopy(dst+i*FR,m);madvise((void*)m,FR,MADV_DONTNEED);}
   else { while(atomic_load(&produced)<=i); 
     if(v==1) ucopy(dst+i*FR,bufs[i%RING]); else {ucopy(dst+i*FR,m);madvise((void*)m,FR,MADV_DONTNEED);}
     atomic_store(&consumed,i+1);}
  }
  if(v==1||v==2) pthread_join(th,0);
  tt[v][round]=(now()-t0)/NF*1e6;
 }
 for(int v=0;v<4;v++){double s[8];for(int k=1;k<9;k++)s[k-1]=tt[v][k];
  for(int a=0;a<8;a++)for(int c=a+1;c<8;c++)if(s[c]<s[a]){double x=s[a];s[a]=s[c];s[c]=x;}
  double m0[8];for(int k=1;k<9;k++)m0[k-1]=tt[0][k];for(int a=0;a<8;a++)for(int c=a+1;c<8;c++)if(m0[c]<m0[a]){double x=m0[a];m0[a]=m0[c];m0[c]=x;}
  printf("%-42s median %.1f us/frame  min %.1f max %.1f (%.2fx file)\n",names[v],(s[3]+s[4])/2,s[0],s[7],(s[3]+s[4])/(m0[3]+m0[4]));}
 unlink("/tmp/mb/seg"); return 0;}
