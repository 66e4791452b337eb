/*
 * loop_cost: what one event-loop iteration costs, to price what the
 * profiler adds per iteration. An epoll loop on an eventfd that is always
 * readable (level-triggered), so epoll_wait returns at once: every
 * iteration is one enter and one return of the loop's wait, the worst case
 * for a profiler that watches waits. Optionally WORK_NS of spinning per
 * iteration (CPU the loop spends on a request).
 *
 * Usage: loop_cost SECONDS [WORK_NS] [READY_FILE]
 * Prints one line per 100 ms window: "ns_per_iter N", then "done". With
 * READY_FILE, idles (epoll_wait, 10 ms timeout) until that file exists, so
 * a profiler can attach first.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: loop_cost SECONDS [WORK_NS] [READY_FILE]\n");
        return 2;
    }
    double secs = atof(argv[1]);
    uint64_t work = argc > 2 ? strtoull(argv[2], 0, 10) : 0;
    const char *ready = argc > 3 ? argv[3] : 0;
    int ep = epoll_create1(0);
    int ev = eventfd(1, 0); /* counter 1: readable until read, never read */
    struct epoll_event e = {.events = EPOLLIN, .data.fd = ev};
    if (ep < 0 || ev < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, ev, &e) < 0) {
        perror("epoll/eventfd");
        return 1;
    }
    struct epoll_event out;
    if (ready) {
        int idle_fd = epoll_create1(0);
        while (access(ready, F_OK) != 0)
            epoll_wait(idle_fd, &out, 1, 10);
    }
    uint64_t end = now_ns() + (uint64_t)(secs * 1e9);
    uint64_t win_start = now_ns(), iters = 0;
    for (;;) {
        if (epoll_wait(ep, &out, 1, -1) != 1) {
            perror("epoll_wait");
            return 1;
        }
        if (work) {
            uint64_t t = now_ns();
            while (now_ns() - t < work) {
            }
        }
        iters++;
        if ((iters & 255) == 0) {
            uint64_t t = now_ns();
            if (t - win_start >= 100000000u) {
                printf("ns_per_iter %.1f\n", (double)(t - win_start) / iters);
                fflush(stdout);
                iters = 0;
                win_start = t;
                if (t >= end)
                    break;
            }
        }
    }
    printf("done\n");
    return 0;
}
