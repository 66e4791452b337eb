/*
 * hostile_loop: an epoll loop that stalls in JIT-like code and can map
 * whatever file it is given, for tests/hostile.rs (issue 13: reads the
 * target cannot weaponize).
 *
 * Every 200 ms tick the loop spins for 60 ms in code it copied into an
 * anonymous executable page (a countdown loop, called in chunks until the
 * time is up), so samples land in anonymous memory and stallprof looks the
 * address up in /tmp/perf-PID.map. Before anything else it writes that
 * perf map with one line naming the page "jit_spin_loop"; the test may then
 * grow the file (a sparse 3 GB tail).
 *
 * Usage: hostile_loop READY_PATH [--map-exec PATH]
 *   READY_PATH    written ("ready\n") once the perf map is there
 *   --map-exec    mmap all of PATH (any size; e.g. a sparse 4 GB file)
 *                 PROT_READ|PROT_EXEC, held until exit
 *
 * Build: cc -O1 -g -o hostile_loop hostile_loop.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

static void die(const char *what) {
    fprintf(stderr, "hostile_loop: %s: %s\n", what, strerror(errno));
    exit(2);
}

static uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* x86-64: mov rax, rdi; 1: dec rax; jnz 1b; ret */
static const unsigned char COUNTDOWN[] = {0x48, 0x89, 0xf8, 0x48, 0xff,
                                          0xc8, 0x75, 0xfb, 0xc3};

typedef uint64_t (*countdown_fn)(uint64_t);

__attribute__((noinline)) static void spin_in_jit(countdown_fn jit, int ms) {
    uint64_t end = mono_ns() + (uint64_t)ms * 1000000ull;
    do
        jit(2000000);
    while (mono_ns() < end);
    __asm__ volatile("" ::: "memory");
}

int main(int argc, char **argv) {
    const char *ready = NULL, *map_exec = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--map-exec") && i + 1 < argc) map_exec = argv[++i];
        else if (!ready) ready = argv[i];
        else {
            fprintf(stderr, "usage: hostile_loop READY_PATH [--map-exec PATH]\n");
            return 2;
        }
    }
    if (!ready) {
        fprintf(stderr, "usage: hostile_loop READY_PATH [--map-exec PATH]\n");
        return 2;
    }

    void *page = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (page == MAP_FAILED) die("mmap jit page");
    memcpy(page, COUNTDOWN, sizeof COUNTDOWN);
    if (mprotect(page, 4096, PROT_READ | PROT_EXEC) != 0) die("mprotect");
    char perf_map[64];
    snprintf(perf_map, sizeof perf_map, "/tmp/perf-%d.map", (int)getpid());
    FILE *pm = fopen(perf_map, "w");
    if (!pm) die("open perf map");
    fprintf(pm, "%lx %zx jit_spin_loop\n", (unsigned long)(uintptr_t)page, sizeof COUNTDOWN);
    fclose(pm);

    if (map_exec) {
        int fd = open(map_exec, O_RDONLY | O_CLOEXEC);
        if (fd < 0) die("open --map-exec file");
        struct stat st;
        if (fstat(fd, &st) != 0) die("fstat");
        if (mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_EXEC, MAP_PRIVATE, fd, 0) == MAP_FAILED)
            die("mmap --map-exec file");
        close(fd);
    }

    FILE *r = fopen(ready, "w");
    if (!r) die("open ready file");
    fputs("ready\n", r);
    fclose(r);

    int tfd = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC);
    if (tfd < 0) die("timerfd_create");
    struct itimerspec its = {.it_interval = {0, 200000000L}, .it_value = {0, 200000000L}};
    if (timerfd_settime(tfd, 0, &its, NULL) != 0) die("timerfd_settime");
    int ep = epoll_create1(EPOLL_CLOEXEC);
    if (ep < 0) die("epoll_create1");
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = tfd};
    if (epoll_ctl(ep, EPOLL_CTL_ADD, tfd, &ev) != 0) die("epoll_ctl");
    for (;;) {
        struct epoll_event out;
        int n = epoll_wait(ep, &out, 1, -1);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) die("epoll_wait");
        uint64_t expirations;
        if (read(tfd, &expirations, sizeof expirations) < 0) die("read timerfd");
        spin_in_jit((countdown_fn)page, 60);
    }
}
