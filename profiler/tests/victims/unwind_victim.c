/* Victim for stallprof's unwinder test (profiler/src/unwind.rs).
 *
 * Built by the test with `cc -O2 -fomit-frame-pointer` (and a .debug_frame-only
 * variant). victim_level_one -> two -> three; three captures its own rip, rsp,
 * rbp and copies up to 16 KiB of stack above rsp, writes
 *   u64 ip, u64 sp, u64 bp, u64 len, len bytes of stack
 * to stdout, then waits for stdin to close so the test can read its maps.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#define WINDOW 16384

static struct {
    uint64_t ip, sp, bp, len;
    unsigned char stack[WINDOW];
} cap;

static int write_all(const void *p, size_t n) {
    const char *c = p;
    while (n > 0) {
        ssize_t w = write(1, c, n);
        if (w <= 0) return -1;
        c += w;
        n -= (size_t)w;
    }
    return 0;
}

__attribute__((noinline)) int victim_level_three(int x) {
    volatile char scratch[200]; /* a real frame: CFA = rsp + N, no rbp */
    uint64_t ip, sp, bp;
    __asm__ volatile("lea 0(%%rip), %0\n\tmov %%rsp, %1\n\tmov %%rbp, %2"
                     : "=r"(ip), "=r"(sp), "=r"(bp));
    scratch[x & 127] = (char)x;
    cap.ip = ip;
    cap.sp = sp;
    cap.bp = bp;
    /* Read through /proc/self/mem: stops at the top of the stack mapping. */
    int fd = open("/proc/self/mem", O_RDONLY);
    uint64_t done = 0;
    while (fd >= 0 && done < WINDOW) {
        ssize_t r = pread(fd, cap.stack + done, WINDOW - done, (off_t)(sp + done));
        if (r <= 0) break;
        done += (uint64_t)r;
    }
    if (fd >= 0) close(fd);
    cap.len = done;
    return scratch[x & 127] + (int)done;
}

__attribute__((noinline)) int victim_level_two(int x) {
    volatile int keep = victim_level_three(x + 1);
    return keep + 1;
}

__attribute__((noinline)) int victim_level_one(int x) {
    volatile int keep = victim_level_two(x + 1);
    return keep + 1;
}

int main(void) {
    int r = victim_level_one(1);
    if (write_all(&cap, 32 + cap.len) != 0) return 1;
    char buf[64];
    while (read(0, buf, sizeof buf) > 0) {
    }
    return r == 0;
}
