#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#include <sys/resource.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int c,char**v){ size_t n=512UL<<20; int mode=atoi(v[1]); setpriority(PRIO_PROCESS,0,5);
 char*src=mmap(0,n,3,MAP_PRIVATE|MAP_ANONYMOUS|MAP_POPULATE,-1,0); memset(src,1,n);
 char*dst=mmap(0,n,3,MAP_PRIVATE|MAP_ANONYMOUS|(mode==0?MAP_POPULATE:0),-1,0);
 if(mode==0) memset(dst,2,n);
 printf("ready\n"); fflush(stdout); getchar();
 double t=now(); if(mode==2){ while(now()-t<0.3); } else { for(size_t o=0;o<n;o+=1<<20) memcpy(dst+o,src+o,1<<20);} fprintf(stderr,"hog %d %.3f\n",mode,now()-t);}
