/*
 * c_loop: a C epoll event loop that stalls on a known schedule and writes down,
 * with its own CLOCK_MONOTONIC, exactly when each stall happened. The root
 * integration tests compare stallprof's output with this log: truth comes
 * from the victim.
 *
 * The loop parks in epoll_wait on a timerfd that fires every 10 ms. Each
 * scheduled stall runs alone in its own loop iteration, from one of three
 * noinline functions whose names the tests look for in the stacks:
 *
 *   spin_for_ms(ms)      on-CPU: busy loop checking CLOCK_MONOTONIC (vDSO, no syscall)
 *   sleep_for_ms(ms)     off-CPU in nanosleep (glibc issues clock_nanosleep)
 *   read_slow_pipe(ms)   off-CPU in a blocking read(2) on a pipe that a second
 *                        thread ("pipe_writer") writes to after ms milliseconds
 *
 * Usage:
 *   c_loop LOG_PATH [--schedule SPEC] [--repeat N] [--start-file PATH] [--linger]
 *
 *   SPEC is a comma list of steps: spin:MS, sleep:MS, pipe:MS, idle:TICKS.
 *        A stall step takes one loop iteration; idle:N lets N iterations pass.
 *        Default: DEFAULT_SCHEDULE below, repeated --repeat times (default 2)
 *        with 20 idle ticks between rounds.
 *   --start-file PATH  tick idle until PATH exists before the schedule starts
 *        (also read from env C_LOOP_START_FILE); lets a test attach with --pid
 *        first and then release the victim.
 *   --linger  after logging "done", keep ticking idle (no stalls) until killed,
 *        so a --pid recording can be stopped by the test rather than by exit.
 *
 * Timeline: ~300 ms of idle ticks (so attaching completes), [wait for the
 * start file, then another ~300 ms], the schedule, 20 idle ticks, "done".
 *
 * Log: JSON lines, fflush'ed one by one:
 *   {"kind":"ready","pid":P,"tid":T}
 *   {"kind":"spin"|"sleep"|"pipe","func":"spin_for_ms"|..,"ms":MS,"seq":N,"tid":T,
 *    "busy_start_ns":..,"busy_end_ns":..,"work_start_ns":..,"work_end_ns":..,
 *    "busy_cpu_ns":..}
 *   {"kind":"done"}
 * busy_start_ns is read right after epoll_wait returns, busy_end_ns right
 * before the next epoll_wait call; busy_cpu_ns is the thread's CPU time between
 * the two (CLOCK_THREAD_CPUTIME_ID). A stall's line is written at the start of
 * the following iteration, so the write is not part of the stall it describes.
 *
 * Build: cc -O1 -g -fno-omit-frame-pointer -pthread c_loop.c -o c_loop
 * (must also build and work with -fomit-frame-pointer).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/syscall.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#define TICK_MS 10
#define STARTUP_IDLE_TICKS 30 /* ~300 ms: lets the profiler finish attaching */
#define ROUND_GAP_TICKS 20
#define TAIL_IDLE_TICKS 20
#define MAX_STEPS 256

static const char DEFAULT_SCHEDULE[] =
    "idle:20,spin:120,idle:5,sleep:80,idle:5,pipe:100,idle:5,"
    "spin:60,idle:5,sleep:150,idle:5,pipe:70,idle:5";

enum step_kind { STEP_IDLE, STEP_SPIN, STEP_SLEEP, STEP_PIPE };

struct step {
    enum step_kind kind;
    int arg; /* ms for stalls, ticks for idle */
};

static void die(const char *what) {
    fprintf(stderr, "c_loop: %s: %s\n", what, strerror(errno));
    exit(2);
}

static uint64_t clock_ns(clockid_t id) {
    struct timespec ts;
    clock_gettime(id, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t mono_ns(void) { return clock_ns(CLOCK_MONOTONIC); }
static uint64_t thread_cpu_ns(void) { return clock_ns(CLOCK_THREAD_CPUTIME_ID); }

/* ---- the three culprits ------------------------------------------------ */

/* Most samples should land in this function's own code, not in the vDSO:
 * do a chunk of arithmetic between clock reads. */
__attribute__((noinline)) void spin_for_ms(int ms) {
    uint64_t end = mono_ns() + (uint64_t)ms * 1000000ull;
    volatile uint64_t acc = 0;
    do {
        for (int i = 0; i < 20000; i++)
            acc = acc * 6364136223846793005ull + 1442695040888963407ull;
    } while (mono_ns() < end);
    __asm__ volatile("" ::: "memory"); /* no tail call, no folding */
}

__attribute__((noinline)) void sleep_for_ms(int ms) {
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
    __asm__ volatile("" ::: "memory");
}

/* The writer thread: waits for a request, sleeps, writes one byte. It never
 * touches the loop's epoll set, so it is not a loop thread. */
static int pipe_fds[2];
static sem_t pipe_request;
static volatile int pipe_delay_ms;

static void *pipe_writer(void *arg) {
    (void)arg;
    for (;;) {
        while (sem_wait(&pipe_request) != 0) {
        }
        int ms = pipe_delay_ms;
        struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
        }
        char b = 'x';
        if (write(pipe_fds[1], &b, 1) != 1)
            die("pipe_writer: write");
    }
    return NULL;
}

__attribute__((noinline)) void read_slow_pipe(int ms) {
    pipe_delay_ms = ms;
    sem_post(&pipe_request);
    char b;
    ssize_t n;
    while ((n = read(pipe_fds[0], &b, 1)) < 0 && errno == EINTR) {
    }
    if (n != 1)
        die("read_slow_pipe: read");
    __asm__ volatile("" ::: "memory");
}

/* ---- schedule ---------------------------------------------------------- */

static int parse_schedule(const char *spec, struct step *out, int max) {
    char *copy = strdup(spec), *save = NULL, *tok;
    int n = 0;
    for (tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        char *colon = strchr(tok, ':');
        if (!colon || n == max) {
            fprintf(stderr, "c_loop: bad schedule step '%s' (want spin|sleep|pipe|idle:N)\n", tok);
            exit(2);
        }
        *colon = 0;
        int arg = atoi(colon + 1);
        enum step_kind k;
        if (!strcmp(tok, "spin")) k = STEP_SPIN;
        else if (!strcmp(tok, "sleep")) k = STEP_SLEEP;
        else if (!strcmp(tok, "pipe")) k = STEP_PIPE;
        else if (!strcmp(tok, "idle")) k = STEP_IDLE;
        else {
            fprintf(stderr, "c_loop: unknown schedule step '%s'\n", tok);
            exit(2);
        }
        if (arg <= 0) {
            fprintf(stderr, "c_loop: schedule step '%s' needs a positive number\n", tok);
            exit(2);
        }
        out[n++] = (struct step){k, arg};
    }
    free(copy);
    return n;
}

static const char *kind_name(enum step_kind k) {
    switch (k) {
    case STEP_SPIN: return "spin";
    case STEP_SLEEP: return "sleep";
    case STEP_PIPE: return "pipe";
    default: return "idle";
    }
}

static const char *func_name(enum step_kind k) {
    switch (k) {
    case STEP_SPIN: return "spin_for_ms";
    case STEP_SLEEP: return "sleep_for_ms";
    case STEP_PIPE: return "read_slow_pipe";
    default: return "";
    }
}

__attribute__((noinline)) static void run_stall(const struct step *s) {
    switch (s->kind) {
    case STEP_SPIN: spin_for_ms(s->arg); break;
    case STEP_SLEEP: sleep_for_ms(s->arg); break;
    case STEP_PIPE: read_slow_pipe(s->arg); break;
    default: break;
    }
    __asm__ volatile("" ::: "memory");
}

/* ---- the loop ---------------------------------------------------------- */

struct pending {
    int valid;
    struct step step;
    int seq;
    uint64_t busy_start, busy_end, work_start, work_end, cpu_start, cpu_end;
};

int main(int argc, char **argv) {
    const char *log_path = NULL, *spec = DEFAULT_SCHEDULE;
    const char *start_file = getenv("C_LOOP_START_FILE");
    int repeat = 2, linger = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--schedule") && i + 1 < argc) spec = argv[++i];
        else if (!strcmp(argv[i], "--repeat") && i + 1 < argc) repeat = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--start-file") && i + 1 < argc) start_file = argv[++i];
        else if (!strcmp(argv[i], "--linger")) linger = 1;
        else if (argv[i][0] != '-' && !log_path) log_path = argv[i];
        else {
            fprintf(stderr,
                    "usage: c_loop LOG_PATH [--schedule SPEC] [--repeat N] "
                    "[--start-file PATH] [--linger]\n");
            return 2;
        }
    }
    if (!log_path) {
        fprintf(stderr, "c_loop: missing LOG_PATH\n");
        return 2;
    }
    if (start_file && !*start_file) start_file = NULL;

    /* Build the full plan: startup idle, [start file], rounds, tail idle. */
    struct step round[MAX_STEPS];
    int round_len = parse_schedule(spec, round, MAX_STEPS);
    int plan_len = 0, plan_cap = 4 + repeat * (round_len + 1);
    struct step *plan = calloc((size_t)plan_cap, sizeof *plan);
    for (int r = 0; r < repeat; r++) {
        if (r > 0) plan[plan_len++] = (struct step){STEP_IDLE, ROUND_GAP_TICKS};
        for (int j = 0; j < round_len; j++) plan[plan_len++] = round[j];
    }
    plan[plan_len++] = (struct step){STEP_IDLE, TAIL_IDLE_TICKS};

    FILE *log = fopen(log_path, "w");
    if (!log) die("open log");

    if (pipe(pipe_fds) != 0) die("pipe");
    if (sem_init(&pipe_request, 0, 0) != 0) die("sem_init");
    pthread_t writer;
    if (pthread_create(&writer, NULL, pipe_writer, NULL) != 0) die("pthread_create");
    pthread_setname_np(writer, "pipe_writer");

    int tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    if (tfd < 0) die("timerfd_create");
    struct itimerspec its = {.it_interval = {0, TICK_MS * 1000000L},
                             .it_value = {0, TICK_MS * 1000000L}};
    if (timerfd_settime(tfd, 0, &its, NULL) != 0) die("timerfd_settime");
    int ep = epoll_create1(EPOLL_CLOEXEC);
    if (ep < 0) die("epoll_create1");
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = tfd};
    if (epoll_ctl(ep, EPOLL_CTL_ADD, tfd, &ev) != 0) die("epoll_ctl");

    fprintf(log, "{\"kind\":\"ready\",\"pid\":%d,\"tid\":%ld}\n", (int)getpid(),
            (long)syscall(SYS_gettid));
    fflush(log);
    long tid = (long)syscall(SYS_gettid);

    /* phase: 0 startup idle, 1 waiting for start file, 2 post-start idle, 3 plan */
    int phase = 0, idle_left = STARTUP_IDLE_TICKS, pc = 0, seq = 0, done = 0;
    struct pending pend = {0};

    for (;;) {
        /* The thread CPU clock is a system call, the monotonic one is not
         * (vDSO): read it first, so busy_end is the last thing before
         * epoll_wait. On a loaded machine a pending (lazy) reschedule takes
         * effect on that syscall's return after a long spin; the run-queue
         * wait it starts is still part of the busy period. */
        uint64_t cpu_end = thread_cpu_ns(), busy_end = mono_ns();
        if (pend.valid && !pend.busy_end) {
            pend.busy_end = busy_end;
            pend.cpu_end = cpu_end;
        }
        struct epoll_event out;
        int n = epoll_wait(ep, &out, 1, -1);
        uint64_t busy_start = mono_ns(), cpu_start = thread_cpu_ns();
        if (n < 0) {
            if (errno == EINTR) continue;
            die("epoll_wait");
        }

        /* Log the previous iteration's stall, now that its end is known. */
        if (pend.valid) {
            fprintf(log,
                    "{\"kind\":\"%s\",\"func\":\"%s\",\"ms\":%d,\"seq\":%d,\"tid\":%ld,"
                    "\"busy_start_ns\":%llu,\"busy_end_ns\":%llu,"
                    "\"work_start_ns\":%llu,\"work_end_ns\":%llu,\"busy_cpu_ns\":%llu}\n",
                    kind_name(pend.step.kind), func_name(pend.step.kind), pend.step.arg,
                    pend.seq, tid, (unsigned long long)pend.busy_start,
                    (unsigned long long)pend.busy_end, (unsigned long long)pend.work_start,
                    (unsigned long long)pend.work_end,
                    (unsigned long long)(pend.cpu_end - pend.cpu_start));
            fflush(log);
            pend.valid = 0;
        }
        if (done && !linger) break;

        uint64_t expirations;
        if (n > 0 && read(tfd, &expirations, sizeof expirations) < 0 && errno != EAGAIN)
            die("read timerfd");

        if (done) continue; /* lingering: idle ticks until killed */

        if (phase == 0 || phase == 2) {
            if (--idle_left > 0) continue;
            if (phase == 0 && start_file) {
                phase = 1;
                continue;
            }
            phase = 3;
            idle_left = 0;
            continue;
        }
        if (phase == 1) {
            if (access(start_file, F_OK) == 0) {
                phase = 2;
                idle_left = STARTUP_IDLE_TICKS;
            }
            continue;
        }

        /* phase 3: walk the plan */
        if (idle_left > 0) {
            idle_left--;
            continue;
        }
        if (pc == plan_len) {
            fprintf(log, "{\"kind\":\"done\"}\n");
            fflush(log);
            done = 1;
            if (!linger) break;
            continue;
        }
        struct step s = plan[pc++];
        if (s.kind == STEP_IDLE) {
            idle_left = s.arg - 1;
            continue;
        }
        pend = (struct pending){.valid = 1, .step = s, .seq = seq++,
                                .busy_start = busy_start, .cpu_start = cpu_start};
        pend.work_start = mono_ns();
        run_stall(&s);
        pend.work_end = mono_ns();
    }
    fclose(log);
    return 0;
}
