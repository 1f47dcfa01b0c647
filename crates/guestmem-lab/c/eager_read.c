/* The plainest eager restore: N threads pread their share of a memory file, 1 MiB at a
 * time, into fresh anonymous memory (mmap, no advice). The comparison for guestmem's eager
 * restore (lab/restore-bench.sh). Prints the seconds from before mmap to the last byte read.
 * With a third argument "huge", the memory is advised MADV_HUGEPAGE first (guestmem's
 * regions are), so both get the same kind of fresh memory.
 * Build: cc -O2 -pthread eager_read.c -o eager_read. Usage: eager_read FILE THREADS [huge] */
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static int fd;
static char *mem;
static size_t size;
static int nthreads;

static void *work(void *arg) {
    long t = (long)arg;
    size_t per = (size / nthreads + 4095) & ~(size_t)4095;
    size_t start = t * per, end = start + per > size ? size : start + per;
    for (size_t at = start; at < end;) {
        size_t n = end - at > (1 << 20) ? (1 << 20) : end - at;
        ssize_t got = pread(fd, mem + at, n, at);
        if (got <= 0) { perror("pread"); exit(1); }
        at += got;
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: %s FILE THREADS [huge]\n", argv[0]); return 2; }
    fd = open(argv[1], O_RDONLY);
    if (fd < 0) { perror("open"); return 1; }
    struct stat st;
    fstat(fd, &st);
    size = st.st_size;
    nthreads = atoi(argv[2]);
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) { perror("mmap"); return 1; }
    if (argc > 3) madvise(mem, size, MADV_HUGEPAGE);
    pthread_t th[256];
    for (long t = 0; t < nthreads; t++) pthread_create(&th[t], NULL, work, (void *)t);
    for (long t = 0; t < nthreads; t++) pthread_join(th[t], NULL);
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("%.6f\n", (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9);
    return 0;
}
