/*
 * event_storm: epoll event loops that tick at a set rate, for the agent-cost
 * and scaling sections of `cargo xtask bench`.
 *
 * Each of THREADS threads parks in epoll_wait on its own timerfd that fires
 * every 1e9/RATE ns, then spins BUSY_US microseconds (a short busy period:
 * the loop's "work"), and parks again. Every iteration is one wait exit + one
 * wait enter for the profiler (plus sched/sample events when a busy period is
 * caught on or off the CPU), so RATE x THREADS sets the event rate.
 *
 * Usage: event_storm THREADS RATE_PER_THREAD BUSY_US SECONDS [RESULT_FILE]
 * SECONDS = 0 runs until killed (SIGTERM/SIGINT end it cleanly).
 * On exit writes to RESULT_FILE (or stdout): iterations=N elapsed_ns=T
 *
 * Build: cc -O2 -pthread event_storm.c -o event_storm
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

static long rate, busy_us;
static atomic_long iterations;
static volatile sig_atomic_t stop;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

static void *loop(void *arg) {
    (void)arg;
    int ep = epoll_create1(0);
    int tfd = timerfd_create(CLOCK_MONOTONIC, 0);
    if (ep < 0 || tfd < 0) { perror("event_storm: epoll/timerfd"); exit(2); }
    long period = 1000000000L / rate;
    struct itimerspec its = {{period / 1000000000L, period % 1000000000L}, {period / 1000000000L, period % 1000000000L}};
    if (its.it_value.tv_sec == 0 && its.it_value.tv_nsec == 0) its.it_value.tv_nsec = 1;
    timerfd_settime(tfd, 0, &its, NULL);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = tfd};
    epoll_ctl(ep, EPOLL_CTL_ADD, tfd, &ev);
    while (!stop) {
        struct epoll_event out;
        int n = epoll_wait(ep, &out, 1, 200);
        if (n <= 0) continue;
        uint64_t exp;
        if (read(tfd, &exp, sizeof exp) != sizeof exp) continue;
        if (busy_us > 0) {
            uint64_t end = now_ns() + (uint64_t)busy_us * 1000;
            while (now_ns() < end) {}
        }
        atomic_fetch_add(&iterations, 1);
    }
    return NULL;
}

static void on_signal(int sig) { (void)sig; stop = 1; }

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: event_storm THREADS RATE_PER_THREAD BUSY_US SECONDS [RESULT_FILE]\n");
        return 2;
    }
    int threads = atoi(argv[1]);
    rate = atol(argv[2]);
    busy_us = atol(argv[3]);
    double seconds = atof(argv[4]);
    if (threads < 1 || rate < 1) { fprintf(stderr, "event_storm: THREADS and RATE must be >= 1\n"); return 2; }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    uint64_t t0 = now_ns();
    pthread_t *tids = calloc(threads, sizeof *tids);
    for (int i = 0; i < threads; i++) pthread_create(&tids[i], NULL, loop, NULL);
    if (seconds > 0) {
        struct timespec d = {(time_t)seconds, (long)((seconds - (time_t)seconds) * 1e9)};
        while (nanosleep(&d, &d) != 0 && !stop) {}
        stop = 1;
    } else {
        while (!stop) pause();
    }
    for (int i = 0; i < threads; i++) pthread_join(tids[i], NULL);
    uint64_t el = now_ns() - t0;
    FILE *f = argc > 5 ? fopen(argv[5], "w") : stdout;
    if (!f) f = stdout;
    fprintf(f, "iterations=%ld elapsed_ns=%llu\n", atomic_load(&iterations), (unsigned long long)el);
    fclose(f);
    return 0;
}
