#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int c,char**v){int pid=atoi(v[1]);unsigned long a=strtoul(v[2],0,0),len=strtoul(v[3],0,0);int rest=atoi(v[4]);
 int pfd=syscall(SYS_pidfd_open,pid,0); double t0=now(); int ok=0,bad=0;
 for(unsigned long x=a;x<a+len;x+=2<<20){ double t=now(); struct iovec io={(void*)x,2<<20}; if(syscall(SYS_process_madvise,pfd,&io,1,MADV_COLLAPSE,0)<0)bad++; else ok++; if(rest){double d=now()-t; struct timespec s={0,(long)(d*1e9)}; nanosleep(&s,0);} }
 fprintf(stderr,"collapse ok %d bad %d in %.3f s\n",ok,bad,now()-t0);}
