/*
 * host_cost: what a process stallprof does NOT watch pays while stallprof
 * runs on the host (docs/benchmarks.md, "What the rest of the host pays").
 *
 * Usage: host_cost syscall|pipe SECONDS
 *   syscall: a getppid() loop (a syscall that does nothing: the tracing
 *            slow path a syscall tracepoint puts every task on shows whole);
 *            prints "ns_per_syscall N" per 100 ms window;
 *   pipe:    two processes bounce one byte through two pipes (per round
 *            trip: 2 context switches, 2 wakeups, 4 syscalls); prints
 *            "us_per_round_trip N" per 100 ms window.
 * Then "done". Neither makes a wait syscall (epoll/poll/select), so no
 * stallprof mode ever watches it.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: host_cost syscall|pipe SECONDS\n");
        return 2;
    }
    uint64_t end = now_ns() + (uint64_t)(atof(argv[2]) * 1e9);
    if (strcmp(argv[1], "syscall") == 0) {
        while (now_ns() < end) {
            uint64_t t0 = now_ns(), n = 0;
            while (now_ns() - t0 < 100000000u) {
                for (int i = 0; i < 1000; i++) getppid();
                n += 1000;
            }
            printf("ns_per_syscall %.1f\n", (double)(now_ns() - t0) / n);
            fflush(stdout);
        }
    } else if (strcmp(argv[1], "pipe") == 0) {
        int a[2], b[2];
        if (pipe(a) || pipe(b)) {
            perror("pipe");
            return 1;
        }
        pid_t child = fork();
        if (child == 0) {
            char c;
            while (read(a[0], &c, 1) == 1 && c) write(b[1], &c, 1);
            _exit(0);
        }
        char c = 1;
        while (now_ns() < end) {
            uint64_t t0 = now_ns(), n = 0;
            while (now_ns() - t0 < 100000000u) {
                write(a[1], &c, 1);
                read(b[0], &c, 1);
                n++;
            }
            printf("us_per_round_trip %.3f\n", (double)(now_ns() - t0) / n / 1000.0);
            fflush(stdout);
        }
        c = 0;
        write(a[1], &c, 1);
        waitpid(child, 0, 0);
    } else {
        fprintf(stderr, "host_cost: unknown mode %s\n", argv[1]);
        return 2;
    }
    printf("done\n");
    return 0;
}
