/*
 * host_cost: what a process stallprof does NOT watch pays while stallprof
 * runs on the host (docs/benchmarks.md, "What the rest of the host pays").
 *
 * Usage: host_cost syscall|pipe|both SECONDS
 *   syscall: a getppid() loop (a syscall that does nothing: the tracing
 *            slow path a syscall tracepoint puts every task on shows whole);
 *            prints "ns_per_syscall N" per 100 ms window;
 *   pipe:    two processes bounce one byte through two pipes (per round
 *            trip: 2 context switches, 2 wakeups, 4 syscalls); prints
 *            "us_per_round_trip N" per 100 ms window;
 *   both:    the two alternate, one 100 ms window each (the pipe's other
 *            process waits in read() through the syscall windows).
 * Then "done". Neither makes a wait syscall (epoll/poll/select), so no
 * stallprof mode ever watches it. A line is printed, and flushed, at the
 * end of its window: its arrival dates the window (bench/host_alternate.py).
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define WINDOW_NS 100000000u

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static void syscall_window(void) {
    uint64_t t0 = now_ns(), n = 0;
    while (now_ns() - t0 < WINDOW_NS) {
        for (int i = 0; i < 1000; i++) getppid();
        n += 1000;
    }
    printf("ns_per_syscall %.1f\n", (double)(now_ns() - t0) / n);
    fflush(stdout);
}

/* The parent's ends of the two pipes to the echoing child. */
static int to_child = -1, from_child = -1;

static void pipe_window(void) {
    char c = 1;
    uint64_t t0 = now_ns(), n = 0;
    while (now_ns() - t0 < WINDOW_NS) {
        if (write(to_child, &c, 1) != 1 || read(from_child, &c, 1) != 1) {
            perror("host_cost: pipe");
            exit(1);
        }
        n++;
    }
    printf("us_per_round_trip %.3f\n", (double)(now_ns() - t0) / n / 1000.0);
    fflush(stdout);
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: host_cost syscall|pipe|both SECONDS\n");
        return 2;
    }
    int sys = strcmp(argv[1], "syscall") == 0 || strcmp(argv[1], "both") == 0;
    int rtt = strcmp(argv[1], "pipe") == 0 || strcmp(argv[1], "both") == 0;
    if (!sys && !rtt) {
        fprintf(stderr, "host_cost: unknown mode %s\n", argv[1]);
        return 2;
    }
    uint64_t end = now_ns() + (uint64_t)(atof(argv[2]) * 1e9);
    pid_t child = -1;
    if (rtt) {
        int a[2], b[2];
        if (pipe(a) || pipe(b)) {
            perror("pipe");
            return 1;
        }
        child = fork();
        if (child == 0) {
            /* Only the parent's ends stay open elsewhere: its exit is our EOF. */
            close(a[1]);
            close(b[0]);
            char c;
            while (read(a[0], &c, 1) == 1 && c)
                if (write(b[1], &c, 1) != 1) break;
            _exit(0);
        }
        close(a[0]);
        close(b[1]);
        to_child = a[1];
        from_child = b[0];
    }
    while (now_ns() < end) {
        if (sys) syscall_window();
        if (rtt) pipe_window();
    }
    if (rtt) {
        char c = 0;
        if (write(to_child, &c, 1) == 1) waitpid(child, 0, 0);
    }
    printf("done\n");
    return 0;
}
