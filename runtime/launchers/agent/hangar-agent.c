/*
 * hangar-agent: the guest agent of a Hangar sandbox.
 *
 * It runs as PID 1 inside the sandbox and serves a unix socket that the host reaches
 * directly (gVisor's --host-uds=create on a bind-mounted directory), so an exec or a file
 * operation costs one connection instead of one `runsc exec` process.
 *
 * Process model. The main process only keeps handlers available and reaps children: as PID 1
 * it inherits every orphan in the sandbox, and it must never block on anything else. Each
 * connection is served by a forked handler that runs exactly one request and exits, so a
 * slow client, a bad request or a crash costs one connection only. Handlers are forked ahead
 * of time ("spares", waiting in accept() themselves), because in gVisor a fork costs more
 * than the rest of a request; see the main process section. A handler starts its command the
 * way posix_spawn does (see struct spawn) and waits for it with waitpid(pid); the main
 * process can never steal that child, because a process only ever reaps its own children.
 *
 * Cost model. Inside gVisor (ptrace platform) every system call traps to the sentry and costs
 * tens of microseconds, a fork milliseconds; a request's path is therefore kept short in
 * syscalls, and whatever can be prepared before a connection arrives is.
 *
 * Wire format (both directions): frames of 1 byte type, 4 bytes big-endian payload length,
 * payload (at most MAX_PAYLOAD). The first client frame is the request; its payload and all
 * reply fields are "key=value\0" sequences. runtime/launchers/agent_client.py is the client
 * and describes each request.
 *
 * Build: gcc -static -O2 -Wall -Wextra -o hangar-agent hangar-agent.c
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <stddef.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/vfs.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#define PROTOCOL_VERSION 1
#define DEFAULT_SOCKET "/.hangar/run/agent.sock"
#define DEFAULT_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

#define MAX_PAYLOAD (1u << 20)
#define OUTPUT_CHUNK (64u << 10)
#define FILE_CHUNK (256u << 10)
#define HEADER_LEN 5

/* How long output may keep arriving after the command itself exited (from a grandchild
 * that inherited the pipes) before the process group is killed and the exit reported. */
#define DRAIN_MS 200
/* After that kill, what is already in a pipe is still delivered, up to this much. */
#define FINAL_DRAIN_LIMIT (4u << 20)
/* A connection must deliver its request frame within this time. */
#define REQUEST_TIMEOUT_MS 30000
/* After the reply, how long to wait for the client to hang up before closing on it. */
#define LINGER_MS 500
/* SIGTERM to PID 1: how long everything gets to exit before SIGKILL. */
#define SHUTDOWN_GRACE_MS 2000
/* Quiesce (before a checkpoint): how long open connections get to close or detach. */
#define QUIESCE_MS 3000
#define TUNNEL_BUF (64 * 1024) /* per direction of a tunnel (op_tunnel) */
/* A detached command nobody re-attached to is given up this long after it exited. */
#define DETACHED_EXITED_MS (3600 * 1000)

extern char **environ;

/* ---- process-wide state ---------------------------------------------------------------- */

static pid_t g_agent_pid;
static int g_is_init;
static int g_sigpipe[2] = {-1, -1}; /* self-pipe: signal handlers wake poll() through it */
static volatile sig_atomic_t g_got_term;
/* SIGUSR1: main: close every connection to the host (a checkpoint is coming); handler: detach
 * from the client. SIGUSR2, main only: listen again (after a restore). See op_quiesce. */
static volatile sig_atomic_t g_quiesce_req, g_relisten_req, g_detach_req;
static int g_quiescing; /* main: not listening, for a checkpoint */
static int g_close_now; /* handler: quiescing, so no lingering on close (see linger_close) */
/* Shared memory (MAP_SHARED, made before any fork) for the quiesce: how many handlers are
 * detached, and the main process's verdict for op_quiesce. */
enum { QUIESCE_NONE, QUIESCE_DONE, QUIESCE_FAILED };
static struct shared {
    int detached;
    int quiesced;
} *g_shared;

/* Handler only: what its SIGTERM handler must clean up (see on_handler_term). */
static volatile sig_atomic_t g_cmd_pgid;
static volatile sig_atomic_t g_tmp_live;
static char g_tmp_path[PATH_MAX];

/* Set in every handler and spare (see on_signal), and once it has a connection to serve. */
static volatile sig_atomic_t g_is_handler, g_serving;

/* Handler only: the big buffers of a request. The main process allocates them once and
 * never touches them, so every handler inherits them with fork() at no cost, instead of
 * mapping them anew for each request. See handler_prepare. */
static struct {
    char *req; /* the request frame, MAX_PAYLOAD + 1 */
    char *rx;  /* exec: the client frame being read; write: data frames (MAX_PAYLOAD + 1) */
    char *in;  /* exec: stdin the command has yet to take; read: file chunks (MAX_PAYLOAD + 1) */
    char *tx;  /* exec: the output frame being sent (HEADER_LEN + OUTPUT_CHUNK) */
} g_buf;
static int g_devnull = -1; /* stdin of commands that get none; -1 if /dev/null is missing */

/* The agent never changes directory, so when it runs in / (as PID 1 does), commands whose cwd
 * is / need no chdir. */
static int g_cwd_is_root;

/* Main only: live handler pids (spares included), so a non-init agent can stop them on
 * SIGTERM. */
static pid_t *g_handlers;
static size_t g_nhandlers, g_handlers_cap;

static void logmsg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void logmsg(const char *fmt, ...)
{
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf - 1, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if ((size_t)n > sizeof buf - 2)
        n = (int)sizeof buf - 2;
    buf[n++] = '\n';
    /* One write per line: several handlers may log at once. */
    ssize_t r = write(STDERR_FILENO, "hangar-agent: ", 14);
    r = write(STDERR_FILENO, buf, (size_t)n);
    (void)r;
}

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int ms_until(int64_t deadline, int64_t now, int cap)
{
    int64_t left = deadline - now;
    if (left < 0)
        return 0;
    return left > cap ? cap : (int)left;
}

static const struct {
    int num;
    const char *name;
} errno_names[] = {
#define E(x) {x, #x}
    E(EPERM),     E(ENOENT),       E(ESRCH),     E(EINTR),        E(EIO),          E(ENXIO),
    E(E2BIG),     E(ENOEXEC),      E(EBADF),     E(ECHILD),       E(EAGAIN),       E(ENOMEM),
    E(EACCES),    E(EFAULT),       E(EBUSY),     E(EEXIST),       E(EXDEV),        E(ENODEV),
    E(ENOTDIR),   E(EISDIR),       E(EINVAL),    E(ENFILE),       E(EMFILE),       E(ENOTTY),
    E(ETXTBSY),   E(EFBIG),        E(ENOSPC),    E(ESPIPE),       E(EROFS),        E(EMLINK),
    E(EPIPE),     E(ERANGE),       E(EDEADLK),   E(ENAMETOOLONG), E(ENOSYS),       E(ENOTEMPTY),
    E(ELOOP),     E(EMSGSIZE),     E(EOVERFLOW), E(ENOTSUP),      E(ECONNRESET),   E(ETIMEDOUT),
    E(ESTALE),    E(EDQUOT),       E(ENOTSOCK),  E(EADDRINUSE),   E(ECONNREFUSED), E(ENOBUFS),
    E(ENOTCONN),  E(EILSEQ),
#undef E
};

static const char *errno_name(int err)
{
    for (size_t i = 0; i < sizeof errno_names / sizeof errno_names[0]; i++)
        if (errno_names[i].num == err)
            return errno_names[i].name;
    return "EUNKNOWN";
}

/* ---- signals --------------------------------------------------------------------------- */

/* SIGTERM or SIGINT in a handler (or spare). A handler of a non-init agent being stopped
 * takes the command down with it, since nothing else knows its process group. Under PID 1 a
 * handler with a connection stays: PID 1's kill(-1, SIGTERM) reaches the command directly,
 * the handler reports its exit, and SIGKILL ends the handler if the command outlasts the
 * grace period. An idle spare just goes. Only async-signal-safe calls here. */
static void on_handler_term(void)
{
    if (g_is_init && g_serving)
        return;
    pid_t pgid = g_cmd_pgid;
    if (pgid > 0) {
        kill(-pgid, SIGKILL);
        kill(pgid, SIGKILL); /* in case it had not reached setsid() yet */
    }
    if (g_tmp_live)
        unlink(g_tmp_path);
    _exit(128 + SIGTERM);
}

/* The one handler for SIGCHLD, SIGTERM and SIGINT, in the main process and in handlers alike:
 * a forked handler then needs no sigaction() calls of its own, only g_is_handler set (while
 * signals are still blocked from the fork). */
static void on_signal(int sig)
{
    int saved = errno;
    if (sig == SIGTERM || sig == SIGINT) {
        if (g_is_handler)
            on_handler_term();
        g_got_term = 1;
    }
    if (sig == SIGUSR1) {
        if (g_is_handler)
            g_detach_req = 1;
        else
            g_quiesce_req = 1;
    }
    if (sig == SIGUSR2 && !g_is_handler)
        g_relisten_req = 1;
    if (g_sigpipe[1] >= 0) {
        char c = (char)sig;
        ssize_t r = write(g_sigpipe[1], &c, 1); /* a full pipe already means "wake up" */
        (void)r;
    }
    errno = saved;
}

static void set_handler(int sig, void (*fn)(int))
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = fn;
    sa.sa_flags = SA_RESTART; /* poll() still wakes; everything else just carries on */
    sigemptyset(&sa.sa_mask);
    sigaction(sig, &sa, NULL);
}

static int make_sigpipe(void)
{
    return pipe2(g_sigpipe, O_CLOEXEC | O_NONBLOCK);
}

/* Empties a non-blocking self-pipe. A short read means it is empty: what is written later
 * wakes poll() again, so there is no need to pay for a read that says EAGAIN. */
static void drain_fd(int fd)
{
    char buf[256];
    ssize_t n;
    do
        n = read(fd, buf, sizeof buf);
    while (n == (ssize_t)sizeof buf || (n < 0 && errno == EINTR));
}

/* Blocks the signals whose handlers touch shared state, around fork() and clone(), so the
 * child can replace them before any can run in it. */
static void block_signals(sigset_t *old)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGCHLD);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGUSR1);
    sigaddset(&set, SIGUSR2);
    sigprocmask(SIG_BLOCK, &set, old);
}

/* ---- plain I/O ------------------------------------------------------------------------- */

/* Waits for `events` on fd until `deadline` (-1: forever). 1 ready (or hung up), 0 timeout. */
static int wait_fd(int fd, short events, int64_t deadline)
{
    for (;;) {
        int timeout = deadline < 0 ? -1 : ms_until(deadline, now_ms(), INT_MAX);
        if (deadline >= 0 && timeout == 0)
            return 0;
        struct pollfd p = {.fd = fd, .events = events};
        int n = poll(&p, 1, timeout);
        if (n > 0)
            return 1;
        if (n < 0 && errno != EINTR)
            return -1;
    }
}

/* Writes everything, also to a non-blocking fd. 0 ok, -1 error (errno set). */
static int write_all(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                if (wait_fd(fd, POLLOUT, -1) < 0)
                    return -1;
                continue;
            }
            return -1;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

/* 1: got len bytes; 0: clean EOF before the first byte; -1: error, timeout or short read.
 * fd must be non-blocking (the deadline holds only then): it is read first and polled only
 * when nothing is there yet, which saves a poll() per read when the data has arrived. */
static int read_full(int fd, void *buf, size_t len, int64_t deadline)
{
    size_t got = 0;
    while (got < len) {
        ssize_t n = read(fd, (char *)buf + got, len - got);
        if (n > 0) {
            got += (size_t)n;
            continue;
        }
        if (n == 0)
            return got == 0 ? 0 : -1;
        if (errno == EINTR)
            continue;
        if ((errno != EAGAIN && errno != EWOULDBLOCK) || wait_fd(fd, POLLIN, deadline) != 1)
            return -1;
    }
    return 1;
}

/* Closes each fd that is open (>= 0). */
static void close_fds(const int *fds, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (fds[i] >= 0)
            close(fds[i]);
}

/* Closes fds a..b, all ours: one close_range() where the kernel has it, rather than a
 * close() each. */
static void close_span(int a, int b)
{
#ifdef SYS_close_range
    if (syscall(SYS_close_range, (unsigned)a, (unsigned)b, 0u) == 0)
        return;
#endif
    for (int fd = a; fd <= b; fd++)
        close(fd);
}

/* Closes n (at most 8) distinct open fds. main() creates the ones every handler drops with
 * consecutive numbers, so this is usually a single syscall (each costs ~0.1 ms in gVisor). */
static void close_set(const int *fds, size_t n)
{
    int v[8];
    if (n == 0 || n > 8) {
        close_fds(fds, n);
        return;
    }
    for (size_t i = 0; i < n; i++) { /* insertion sort: n is tiny */
        int x = fds[i];
        size_t j = i;
        for (; j > 0 && v[j - 1] > x; j--)
            v[j] = v[j - 1];
        v[j] = x;
    }
    if (v[0] >= 0 && v[n - 1] - v[0] == (int)n - 1)
        close_span(v[0], v[n - 1]);
    else
        close_fds(fds, n);
}

/* Only for a pipe or pty end we just created: its other status flags are known to be clear
 * (F_SETFL ignores the access mode), so there is no need to F_GETFL them first. */
static void set_nonblock_fresh(int fd)
{
    fcntl(fd, F_SETFL, O_NONBLOCK);
}

/* ---- frames and fields ----------------------------------------------------------------- */

static void put_header(char *p, char type, uint32_t len)
{
    p[0] = type;
    p[1] = (char)(len >> 24);
    p[2] = (char)(len >> 16);
    p[3] = (char)(len >> 8);
    p[4] = (char)len;
}

static uint32_t get_be32(const unsigned char *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

enum { FRAME_OK = 1, FRAME_EOF = 0, FRAME_ERROR = -1, FRAME_TOO_BIG = -2 };

/* Reads one frame into buf (MAX_PAYLOAD + 1 bytes: the payload is NUL-terminated so the
 * last field is a C string even if the client left out its NUL). */
static int read_frame(int fd, char *type, char *buf, uint32_t *len, int64_t deadline)
{
    unsigned char hdr[HEADER_LEN];
    int rc = read_full(fd, hdr, HEADER_LEN, deadline);
    if (rc != 1)
        return rc == 0 ? FRAME_EOF : FRAME_ERROR;
    *type = (char)hdr[0];
    *len = get_be32(hdr + 1);
    if (*len > MAX_PAYLOAD)
        return FRAME_TOO_BIG;
    if (*len > 0 && read_full(fd, buf, *len, deadline) != 1)
        return FRAME_ERROR;
    buf[*len] = '\0';
    return FRAME_OK;
}

/* Iterates over the values of `key` in a "key=value\0..." payload; *pos starts at 0.
 * buf[len] must be NUL. Entries without '=' are ignored. */
static const char *next_field(const char *buf, size_t len, const char *key, size_t *pos)
{
    size_t klen = strlen(key);
    while (*pos < len) {
        const char *s = buf + *pos;
        size_t l = strnlen(s, len - *pos);
        *pos += l + 1;
        if (l > klen && memcmp(s, key, klen) == 0 && s[klen] == '=')
            return s + klen + 1;
    }
    return NULL;
}

static const char *get_field(const char *buf, size_t len, const char *key)
{
    size_t pos = 0;
    return next_field(buf, len, key, &pos);
}

/* Strict unsigned parse: digits only, no sign or spaces, no overflow, at most max. */
static int parse_uint(const char *s, int base, unsigned long long max, unsigned long long *out)
{
    if (!s || !*s || *s == '-' || *s == '+' || *s == ' ')
        return -1;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, base);
    if (errno || *end || v > max)
        return -1;
    *out = v;
    return 0;
}

/* Reply fields, built in place. Only file names and error messages vary in length, and
 * those are bounded well below the buffer. */
struct fields {
    size_t len;
    char buf[8192];
};

static void field_add(struct fields *f, const char *key, const char *value)
{
    size_t k = strlen(key), v = strlen(value);
    if (k + v + 2 > sizeof f->buf - f->len)
        return;
    memcpy(f->buf + f->len, key, k);
    f->buf[f->len + k] = '=';
    memcpy(f->buf + f->len + k + 1, value, v);
    f->buf[f->len + k + 1 + v] = '\0';
    f->len += k + v + 2;
}

static void field_addf(struct fields *f, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void field_addf(struct fields *f, const char *key, const char *fmt, ...)
{
    char value[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(value, sizeof value, fmt, ap);
    va_end(ap);
    field_add(f, key, value);
}

static const char *type_name(mode_t mode)
{
    if (S_ISREG(mode))
        return "file";
    if (S_ISDIR(mode))
        return "dir";
    if (S_ISLNK(mode))
        return "symlink";
    return "other";
}

static void field_add_mtime(struct fields *f, const struct timespec *ts)
{
    long long sec = (long long)ts->tv_sec;
    long nsec = ts->tv_nsec;
    if (sec < 0 && nsec > 0) /* -1.5 s is stored as sec=-2, nsec=0.5e9 */
        field_addf(f, "mtime", "-%lld.%09ld", -(sec + 1), 1000000000L - nsec);
    else
        field_addf(f, "mtime", "%lld.%09ld", sec, nsec);
}

static void field_add_stat(struct fields *f, const struct stat *st)
{
    field_add(f, "type", type_name(st->st_mode));
    field_addf(f, "size", "%lld", (long long)st->st_size);
    field_addf(f, "mode", "%o", (unsigned)(st->st_mode & 07777));
    field_add_mtime(f, &st->st_mtim);
}

/* ---- buffered replies (handlers other than exec's streaming loop) ---------------------- */

/* Small frames (directory entries, replies) are batched into one write; the `failed` flag
 * turns every later write into a no-op once the client is gone. */
static struct {
    int fd;
    int failed;
    size_t len;
    char buf[64 << 10];
} g_out;

static void out_flush(void)
{
    if (!g_out.failed && g_out.len > 0 && write_all(g_out.fd, g_out.buf, g_out.len) < 0)
        g_out.failed = 1;
    g_out.len = 0;
}

static int out_frame(char type, const void *payload, size_t len)
{
    if (g_out.failed)
        return -1;
    if (HEADER_LEN + len > sizeof g_out.buf - g_out.len)
        out_flush();
    put_header(g_out.buf + g_out.len, type, (uint32_t)len);
    g_out.len += HEADER_LEN;
    if (HEADER_LEN + len <= sizeof g_out.buf) {
        if (len)
            memcpy(g_out.buf + g_out.len, payload, len);
        g_out.len += len;
    } else {
        /* A big data frame: no point copying it through the buffer. */
        out_flush();
        if (!g_out.failed && write_all(g_out.fd, payload, len) < 0)
            g_out.failed = 1;
    }
    return g_out.failed ? -1 : 0;
}

/* One of g_buf's buffers, allocated now if handler_prepare could not. NULL: out of memory. */
static char *handler_buf(char **slot, size_t size)
{
    if (!*slot)
        *slot = malloc(size);
    return *slot;
}

static void reply_fields(char type, const struct fields *f)
{
    out_frame(type, f->buf, f->len);
}

static void reply_ok(void)
{
    out_frame('K', "", 0);
}

static void reply_error(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void reply_error(int err, const char *fmt, ...)
{
    struct fields f = {0};
    char message[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(message, sizeof message, fmt, ap);
    va_end(ap);
    field_add(&f, "errno", errno_name(err));
    field_add(&f, "message", message);
    reply_fields('F', &f);
}

/* "subject: strerror" for a failed system call on subject (usually a path). */
static void reply_errno(int err, const char *subject)
{
    reply_error(err, "%.2048s: %s", subject, strerror(err));
}

/* ---- requests -------------------------------------------------------------------------- */

struct request {
    char type;
    char *buf; /* fields; buf[len] is NUL */
    uint32_t len;
};

static const char *req_get(const struct request *r, const char *key)
{
    return get_field(r->buf, r->len, key);
}

static int req_flag(const struct request *r, const char *key)
{
    const char *v = req_get(r, key);
    return v && strcmp(v, "1") == 0;
}

/* The path field, which must be absolute; replies EINVAL and returns NULL otherwise. */
static const char *req_path(const struct request *r)
{
    const char *path = req_get(r, "path");
    if (!path || !*path) {
        reply_error(EINVAL, "missing path");
        return NULL;
    }
    if (path[0] != '/') {
        reply_error(EINVAL, "%.2048s: path must be absolute", path);
        return NULL;
    }
    return path;
}

/* The optional octal mode field; replies EINVAL and returns -1 when malformed. */
static int req_mode(const struct request *r, mode_t fallback, mode_t *mode)
{
    const char *v = req_get(r, "mode");
    unsigned long long m;
    *mode = fallback;
    if (!v)
        return 0;
    if (parse_uint(v, 8, 07777, &m) < 0) {
        reply_error(EINVAL, "bad mode %.64s: expected octal permission bits", v);
        return -1;
    }
    *mode = (mode_t)m;
    return 0;
}

/* ---- filesystem helpers ---------------------------------------------------------------- */

/* mkdir -p. Returns 0 or an errno value. `created` (may be NULL) reports whether the last
 * component was made by this call. */
static int mkdir_p(const char *path, mode_t mode, int *created)
{
    char buf[PATH_MAX];
    size_t len = strlen(path);
    if (created)
        *created = 0;
    if (len >= sizeof buf)
        return ENAMETOOLONG;
    memcpy(buf, path, len + 1);
    while (len > 1 && buf[len - 1] == '/')
        buf[--len] = '\0';
    for (char *p = buf + 1;; p++) {
        if (*p != '/' && *p != '\0')
            continue;
        char saved = *p;
        if (p[-1] != '/') { /* skip the empty components of "a//b" */
            *p = '\0';
            if (mkdir(buf, mode) == 0) {
                if (!saved && created)
                    *created = 1;
            } else {
                int err = errno;
                struct stat st;
                /* Whatever the error (EEXIST, or EROFS/EACCES on an existing parent), an
                 * existing directory is what we wanted. */
                if (stat(buf, &st) < 0 || !S_ISDIR(st.st_mode))
                    return err == EEXIST ? (saved ? ENOTDIR : EEXIST) : err;
            }
            *p = saved;
        }
        if (!saved)
            return 0;
    }
}

/* rm -r of a directory relative to dirfd, never following symlinks. 0 or first errno. */
static int remove_dir_at(int dirfd, const char *name)
{
    int fd = openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return errno;
    DIR *d = fdopendir(fd);
    if (!d) {
        int err = errno;
        close(fd);
        return err;
    }
    int err = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        int is_dir = e->d_type == DT_DIR;
        if (e->d_type == DT_UNKNOWN) {
            struct stat st;
            is_dir = fstatat(fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode);
        }
        int rc = 0;
        if (is_dir)
            rc = remove_dir_at(fd, e->d_name);
        else if (unlinkat(fd, e->d_name, 0) < 0)
            rc = errno;
        if (rc && rc != ENOENT && !err)
            err = rc;
    }
    closedir(d);
    if (unlinkat(dirfd, name, AT_REMOVEDIR) < 0 && !err)
        err = errno;
    return err;
}

/* ---- pseudo filesystems ---------------------------------------------------------------- */

/* A request with no_pseudo_fs=1 (a caller who may not exec, and so must not see what /proc
 * shows of every process: its environment holds the sandbox's secrets) may not read, list or
 * stat anything on procfs or sysfs. The path is resolved here one component at a time, as the
 * kernel would (symlinks followed, at most MAX_LINKS), so that every directory passed through,
 * every symlink followed and the file itself is checked with fstatfs(): a name string cannot
 * tell (/proc/self, a symlink in /tmp, a bind mount or a second procfs mounted elsewhere), and
 * checking only the file opened is not enough either, since a magic link under /proc/<pid>/fd
 * reaches a deleted file or a memfd on an ordinary filesystem. Every magic link lives on
 * procfs, so refusing each component there refuses every path through one. */
#define PROC_SUPER_MAGIC 0x9fa0
#define SYSFS_MAGIC 0x62656572
#define MAX_LINKS 40
#define PSEUDO_REFUSED (-1000) /* walk_open's answer for a path through procfs or sysfs */
#define PSEUDO_ERRNO "EPSEUDOFS"

static int on_pseudo_fs(int fd)
{
    struct statfs s;
    /* An fd whose filesystem cannot be told is refused as well. */
    return fstatfs(fd, &s) < 0 || s.f_type == PROC_SUPER_MAGIC || s.f_type == SYSFS_MAGIC;
}

/* open(path, flags) without passing through procfs or sysfs. `flags` O_PATH: the last
 * component is not followed (lstat). Returns an fd, -errno, or PSEUDO_REFUSED. */
static int walk_open(const char *path, int flags)
{
    char rest[2 * PATH_MAX], name[NAME_MAX + 1];
    size_t len = strlen(path);
    int links = 0, rc = -EINVAL;
    if (len >= PATH_MAX)
        return -ENAMETOOLONG;
    memcpy(rest, path, len + 1);
    int dir = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (dir < 0)
        return -errno;
    const char *p = rest;
    for (;;) {
        while (*p == '/')
            p++;
        size_t n = strcspn(p, "/");
        if (n > NAME_MAX) {
            rc = -ENAMETOOLONG;
            break;
        }
        memcpy(name, n ? p : ".", n ? n : 1);
        name[n ? n : 1] = '\0';
        p += n;
        const char *after = p + strspn(p, "/");
        int last = !*after, trailing = last && *p == '/';
        int fd = openat(dir, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0) {
            rc = -errno;
            break;
        }
        struct stat st;
        if (on_pseudo_fs(fd)) {
            close(fd);
            rc = PSEUDO_REFUSED;
            break;
        }
        if (fstat(fd, &st) < 0) {
            rc = -errno;
            close(fd);
            break;
        }
        if (S_ISLNK(st.st_mode) && (!last || trailing || !(flags & O_PATH))) {
            char target[PATH_MAX];
            close(fd);
            ssize_t t = readlinkat(dir, name, target, sizeof target - 1);
            if (++links > MAX_LINKS || t <= 0) {
                rc = t < 0 ? -errno : t == 0 ? -ENOENT : -ELOOP;
                break;
            }
            target[t] = '\0';
            size_t tail = strlen(after);
            if ((size_t)t + 1 + tail >= sizeof rest) {
                rc = -ENAMETOOLONG;
                break;
            }
            /* rest becomes target + "/" + what was left (after points into rest). */
            memmove(rest + t + 1, after, tail + 1);
            memcpy(rest, target, (size_t)t);
            rest[t] = '/';
            if (target[0] == '/') {
                int root = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
                if (root < 0) {
                    rc = -errno;
                    break;
                }
                close(dir);
                dir = root;
            }
            p = rest;
            continue;
        }
        if (!last) {
            if (!S_ISDIR(st.st_mode)) {
                close(fd);
                rc = -ENOTDIR;
                break;
            }
            close(dir);
            dir = fd;
            continue;
        }
        if (flags & O_PATH) {
            rc = fd;
            break;
        }
        close(fd);
        /* O_NOFOLLOW: a symlink swapped in since the check is refused, not followed; and
         * what was opened is checked again (something could be mounted over it meanwhile). */
        rc = openat(dir, name, flags | O_NOFOLLOW | O_CLOEXEC);
        if (rc < 0) {
            rc = -errno;
        } else if (on_pseudo_fs(rc)) {
            close(rc);
            rc = PSEUDO_REFUSED;
        }
        break;
    }
    close(dir);
    return rc;
}

/* open(2) for read, list and stat: checked by walk_open when the request says no_pseudo_fs.
 * Replies and returns -1 on failure. */
static int open_for(const struct request *r, const char *path, int flags)
{
    int fd;
    if (!req_flag(r, "no_pseudo_fs")) {
        fd = open(path, flags | O_CLOEXEC);
        if (fd < 0)
            reply_errno(errno, path);
        return fd;
    }
    fd = walk_open(path, flags);
    if (fd == PSEUDO_REFUSED) {
        struct fields f = {0};
        char message[2200];
        snprintf(message, sizeof message, "%.2048s: is on /proc or /sys (or passes through them)", path);
        field_add(&f, "errno", PSEUDO_ERRNO);
        field_add(&f, "message", message);
        reply_fields('F', &f);
        return -1;
    }
    if (fd < 0)
        reply_errno(-fd, path);
    return fd;
}

/* The reply field that says the request's no_pseudo_fs was enforced: a client that asked for
 * it refuses an answer without it (from an agent older than the check). */
static void field_add_enforced(struct fields *f, const struct request *r)
{
    if (req_flag(r, "no_pseudo_fs"))
        field_add(f, "no_pseudo_fs", "1");
}

/* ---- simple requests ------------------------------------------------------------------- */

static void op_ping(void)
{
    struct fields f = {0};
    field_addf(&f, "version", "%d", PROTOCOL_VERSION);
    field_addf(&f, "pid", "%d", (int)g_agent_pid);
    reply_fields('K', &f);
}

static void op_stat(const struct request *r)
{
    const char *path = req_path(r);
    struct stat st;
    if (!path)
        return;
    if (req_flag(r, "no_pseudo_fs")) {
        int fd = open_for(r, path, O_PATH | O_NOFOLLOW);
        if (fd < 0)
            return;
        int err = fstat(fd, &st) < 0 ? errno : 0;
        close(fd);
        if (err) {
            reply_errno(err, path);
            return;
        }
    } else if (lstat(path, &st) < 0) {
        reply_errno(errno, path);
        return;
    }
    struct fields f = {0};
    field_add_stat(&f, &st);
    field_add_enforced(&f, r);
    reply_fields('K', &f);
}

static void op_mkdir(const struct request *r)
{
    const char *path = req_path(r);
    mode_t mode;
    int created;
    if (!path || req_mode(r, 0755, &mode) < 0)
        return;
    int err = mkdir_p(path, mode, &created);
    if (err) {
        reply_errno(err, path);
        return;
    }
    if (created)
        chmod(path, mode); /* like mkdir -p -m: the mode is exact, not filtered by umask */
    reply_ok();
}

static void op_delete(const struct request *r)
{
    const char *path = req_path(r);
    struct stat st, root;
    if (!path)
        return;
    if (lstat(path, &st) < 0) {
        reply_errno(errno, path);
        return;
    }
    if (stat("/", &root) == 0 && st.st_dev == root.st_dev && st.st_ino == root.st_ino) {
        reply_error(EBUSY, "%.2048s: refusing to delete the root directory", path);
        return;
    }
    int err = 0;
    if (!S_ISDIR(st.st_mode))
        err = unlink(path) < 0 ? errno : 0;
    else if (req_flag(r, "recursive"))
        err = remove_dir_at(AT_FDCWD, path);
    else
        err = rmdir(path) < 0 ? errno : 0;
    if (err)
        reply_errno(err, path);
    else
        reply_ok();
}

static void op_list(const struct request *r)
{
    const char *path = req_path(r);
    if (!path)
        return;
    int fd = open_for(r, path, O_RDONLY | O_DIRECTORY);
    if (fd < 0)
        return;
    DIR *d = fdopendir(fd);
    if (!d) {
        reply_errno(errno, path);
        close(fd);
        return;
    }
    for (;;) {
        errno = 0;
        struct dirent *e = readdir(d);
        if (!e) {
            if (errno) {
                reply_errno(errno, path);
                closedir(d);
                return;
            }
            break;
        }
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        struct stat st;
        if (fstatat(fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0)
            continue; /* removed while we listed it */
        struct fields f = {0};
        field_add(&f, "name", e->d_name);
        field_add_stat(&f, &st);
        if (out_frame('N', f.buf, f.len) < 0)
            break;
    }
    closedir(d);
    struct fields done = {0};
    field_add_enforced(&done, r);
    reply_fields('K', &done);
}

static void op_read(const struct request *r)
{
    const char *path = req_path(r);
    unsigned long long offset = 0, remaining = ULLONG_MAX;
    if (!path)
        return;
    const char *v = req_get(r, "offset");
    if (v && parse_uint(v, 10, INT64_MAX, &offset) < 0) {
        reply_error(EINVAL, "bad offset %.64s", v);
        return;
    }
    v = req_get(r, "length");
    if (v && parse_uint(v, 10, ULLONG_MAX, &remaining) < 0) {
        reply_error(EINVAL, "bad length %.64s", v);
        return;
    }
    /* O_NONBLOCK so a FIFO swapped in after the type check cannot hang the open. */
    int fd = open_for(r, path, O_RDONLY | O_NOCTTY | O_NONBLOCK);
    if (fd < 0)
        return;
    struct stat st;
    if (fstat(fd, &st) < 0) {
        reply_errno(errno, path);
        close(fd);
        return;
    }
    if (!S_ISREG(st.st_mode)) {
        if (S_ISDIR(st.st_mode))
            reply_errno(EISDIR, path);
        else
            reply_error(EINVAL, "%.2048s: not a regular file", path);
        close(fd);
        return;
    }
    if (offset > 0 && lseek(fd, (off_t)offset, SEEK_SET) < 0) {
        reply_errno(errno, path);
        close(fd);
        return;
    }
    struct fields f = {0};
    field_addf(&f, "size", "%lld", (long long)st.st_size);
    field_addf(&f, "mode", "%o", (unsigned)(st.st_mode & 07777));
    field_add_mtime(&f, &st.st_mtim);
    field_add(&f, "type", "file");
    field_add_enforced(&f, r);
    reply_fields('T', &f);

    char *buf = handler_buf(&g_buf.in, MAX_PAYLOAD + 1); /* FILE_CHUNK fits */
    if (!buf) {
        reply_errno(ENOMEM, path);
        close(fd);
        return;
    }
    /* Read to EOF rather than to st_size: /proc files say 0 and still have content. */
    while (remaining > 0) {
        size_t want = remaining < FILE_CHUNK ? (size_t)remaining : FILE_CHUNK;
        ssize_t n = read(fd, buf, want);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            reply_errno(errno, path);
            goto out;
        }
        if (n == 0)
            break;
        if (out_frame('D', buf, (size_t)n) < 0)
            goto out;
        remaining -= (unsigned long long)n;
    }
    reply_ok();
out:
    close(fd);
}

static void op_write(const struct request *r)
{
    const char *path = req_path(r);
    mode_t mode;
    if (!path || req_mode(r, 0644, &mode) < 0)
        return;
    int append = req_flag(r, "append");
    char target[PATH_MAX];
    if (strlen(path) >= sizeof target) {
        reply_errno(ENAMETOOLONG, path);
        return;
    }
    strcpy(target, path);

    char parent[PATH_MAX];
    const char *slash = strrchr(target, '/');
    size_t dirlen = (size_t)(slash - target);
    memcpy(parent, target, dirlen);
    parent[dirlen] = '\0';
    if (req_flag(r, "mkdirs") && dirlen > 0) {
        int err = mkdir_p(parent, 0755, NULL);
        if (err) {
            reply_errno(err, parent);
            return;
        }
    }

    struct stat st;
    if (lstat(target, &st) == 0 && S_ISLNK(st.st_mode)) {
        /* Write through the link, as a shell redirection would, rather than replace it. */
        char *real = realpath(target, NULL);
        if (real) {
            if (strlen(real) < sizeof target)
                strcpy(target, real);
            free(real);
        }
    }
    if (stat(target, &st) == 0 && S_ISDIR(st.st_mode)) {
        reply_errno(EISDIR, path);
        return;
    }

    int fd;
    if (append) {
        fd = open(target, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOCTTY, mode);
        if (fd < 0) {
            reply_errno(errno, path);
            return;
        }
    } else {
        /* Write a temp file beside the target and rename it over on 'C', so readers see the
         * old content or the new, never a prefix, and a dropped client changes nothing. */
        slash = strrchr(target, '/');
        dirlen = (size_t)(slash - target);
        int n = snprintf(g_tmp_path, sizeof g_tmp_path, "%.*s/.hangar-write-XXXXXX", (int)dirlen, target);
        if (n < 0 || (size_t)n >= sizeof g_tmp_path) {
            reply_errno(ENAMETOOLONG, path);
            return;
        }
        fd = mkostemp(g_tmp_path, O_CLOEXEC);
        if (fd < 0) {
            reply_errno(errno, path);
            return;
        }
        g_tmp_live = 1;
        if (fchmod(fd, mode) < 0) {
            reply_errno(errno, path);
            goto fail;
        }
    }

    char *buf = handler_buf(&g_buf.rx, MAX_PAYLOAD + 1);
    if (!buf) {
        reply_errno(ENOMEM, path);
        goto fail;
    }
    unsigned long long written = 0;
    for (;;) {
        char type;
        uint32_t len;
        int rc = read_frame(g_out.fd, &type, buf, &len, -1);
        if (rc == FRAME_TOO_BIG) {
            reply_error(EMSGSIZE, "frame larger than %u bytes", MAX_PAYLOAD);
            goto fail;
        }
        if (rc != FRAME_OK)
            goto fail; /* client gone before 'C': leave the target untouched */
        if (type == 'C')
            break;
        if (type != 'D') {
            reply_error(EINVAL, "unexpected frame '%c' in a write", type);
            goto fail;
        }
        if (write_all(fd, buf, len) < 0) {
            reply_errno(errno, path);
            goto fail;
        }
        written += len;
    }
    if (close(fd) < 0) { /* NFS and friends report deferred write errors here */
        fd = -1;
        reply_errno(errno, path);
        goto fail;
    }
    fd = -1;
    if (!append) {
        if (rename(g_tmp_path, target) < 0) {
            reply_errno(errno, path);
            goto fail;
        }
        g_tmp_live = 0;
    }
    struct fields f = {0};
    field_addf(&f, "size", "%llu", written);
    reply_fields('K', &f);
    return;

fail:
    if (fd >= 0)
        close(fd);
    if (g_tmp_live) {
        unlink(g_tmp_path);
        g_tmp_live = 0;
    }
}

/* ---- exec: starting the command -------------------------------------------------------- */

enum { STAGE_SETUP = 1, STAGE_CHDIR = 2, STAGE_EXEC = 3 };

struct exec_failure {
    int stage;
    int err;
};

static const char *env_lookup(char *const envp[], const char *name)
{
    size_t n = strlen(name);
    for (size_t i = 0; envp[i]; i++)
        if (strncmp(envp[i], name, n) == 0 && envp[i][n] == '=')
            return envp[i] + n + 1;
    return NULL;
}

/* The agent's own environment with the request's NAME=VALUE entries replacing or added. */
static char **merge_env(const struct request *r)
{
    size_t base = 0, extra = 0, pos = 0;
    while (environ && environ[base])
        base++;
    while (next_field(r->buf, r->len, "env", &pos))
        extra++;
    char **envp = calloc(base + extra + 1, sizeof *envp);
    if (!envp)
        return NULL;
    for (size_t i = 0; i < base; i++)
        envp[i] = environ[i];
    size_t n = base;
    const char *entry;
    pos = 0;
    while ((entry = next_field(r->buf, r->len, "env", &pos)) != NULL) {
        const char *eq = strchr(entry, '=');
        size_t name_len = (size_t)(eq - entry);
        size_t i;
        for (i = 0; i < n; i++)
            if (strncmp(envp[i], entry, name_len + 1) == 0)
                break;
        envp[i] = (char *)entry;
        if (i == n)
            n++;
    }
    envp[n] = NULL;
    return envp;
}

/* The command is started the way posix_spawn does it: clone(CLONE_VM | CLONE_VFORK) runs the
 * child on its own stack in our address space until it execs, which spares copying the
 * handler's address space (costly in gVisor) for a process that is about to replace it. The
 * child must therefore not allocate, and leaves everything it needs prepared here.
 *
 * CLONE_VFORK also suspends us until the child has exec'd or exited, so a child that cannot
 * exec leaves the reason in `fail`, in our shared memory, for us to find once clone()
 * returns (as glibc's posix_spawn does): no report pipe to create, read and close. */
struct spawn {
    char **argv;
    char **envp;
    char **sh_argv; /* argc + 2 slots, for exec_with_sh */
    const char *cwd;
    int chdir_needed; /* 0 when cwd is where the agent already is */
    int in_fd, out_fd, err_fd, tty_fd;
    int isig_fd; /* with a tty on a kernel that ignores ISIG: the isig helper's end, or -1 */
    struct exec_failure fail; /* stage 0: the child exec'd (or was killed first) */
};

/* A file that execve rejects with ENOEXEC is a script without #!: run it with /bin/sh,
 * like execvp and every shell do. */
static void exec_with_sh(const char *file, const struct spawn *sp)
{
    char *const *argv = sp->argv;
    char **sh_argv = sp->sh_argv;
    size_t argc = 0;
    while (argv[argc])
        argc++;
    sh_argv[0] = (char *)"/bin/sh";
    sh_argv[1] = (char *)file;
    for (size_t i = 1; i < argc; i++)
        sh_argv[i + 1] = argv[i];
    sh_argv[argc + 1] = NULL;
    execve("/bin/sh", sh_argv, sp->envp);
    errno = ENOEXEC;
}

/* execvpe, except that PATH comes from the command's environment rather than ours (glibc
 * searches the caller's PATH). Returns only on failure, with errno set. */
static void exec_search(const struct spawn *sp)
{
    const char *file = sp->argv[0];
    char *const *argv = sp->argv;
    char *const *envp = sp->envp;
    if (!*file) {
        errno = ENOENT;
        return;
    }
    if (strchr(file, '/')) {
        execve(file, argv, envp);
        if (errno == ENOEXEC)
            exec_with_sh(file, sp);
        return;
    }
    const char *path = env_lookup(envp, "PATH");
    if (!path)
        path = DEFAULT_PATH;
    size_t flen = strlen(file);
    int result = ENOENT;
    for (const char *dir = path;; dir++) {
        const char *end = strchrnul(dir, ':');
        size_t dlen = (size_t)(end - dir);
        char buf[PATH_MAX];
        if (dlen == 0) { /* an empty entry means the current directory */
            dir = ".";
            dlen = 1;
        }
        if (dlen + 1 + flen + 1 > sizeof buf) {
            result = ENAMETOOLONG;
        } else {
            memcpy(buf, dir, dlen);
            buf[dlen] = '/';
            memcpy(buf + dlen + 1, file, flen + 1);
            execve(buf, argv, envp);
            switch (errno) {
            case ENOEXEC:
                exec_with_sh(buf, sp);
                return;
            case EACCES:
                result = EACCES; /* remembered, but a later directory may still work */
                break;
            case ENOENT:
            case ENOTDIR:
            case ESTALE:
            case ENODEV:
            case ETIMEDOUT:
            case ELOOP:
            case ENAMETOOLONG:
                break;
            default:
                return; /* e.g. E2BIG, ENOMEM, ETXTBSY: searching on cannot help */
            }
        }
        if (!*end)
            break;
        dir = end;
    }
    errno = result;
}

static void child_fail(struct spawn *sp, int stage, int err)
{
    sp->fail.stage = stage;
    sp->fail.err = err;
    _exit(127);
}

/* The isig helper: on a kernel whose terminals ignore ISIG (gVisor before 2023) the agent
 * raises ^C's signal itself, but the foreground process group it must go to can only be
 * read by a process of the terminal's session: there TIOCGPGRP on the master fails, /proc
 * shows no tpgid and /dev/tty cannot be opened. So a tty command's child leaves this behind
 * in its session before it execs: it keeps only its socket to the agent and the terminal,
 * ignores the job-control and terminal signals, and for each request {signal, character}
 * signals the terminal's foreground group, flushes unread output and echoes "^C" as the
 * kernel would. The agent closes the socket as soon as the command exits, and the helper
 * goes, so its copy of the terminal does not delay the hang-up; it is in the command's
 * process group too, which the agent kills at the end. It runs in its own copy of the
 * address space (clone without CLONE_VM), so it only makes plain syscalls. */
static int isig_helper(void *arg)
{
    const struct spawn *sp = arg;
    int fd = sp->isig_fd, t = sp->tty_fd;
    static const int ignored[] = {SIGINT, SIGQUIT, SIGTSTP, SIGTTIN, SIGTTOU, SIGHUP, SIGPIPE};
    for (size_t i = 0; i < sizeof ignored / sizeof ignored[0]; i++)
        set_handler(ignored[i], SIG_IGN);
    int lo = fd < t ? fd : t, hi = fd < t ? t : fd;
    if (lo > 0)
        close_span(0, lo - 1);
    if (hi > lo + 1)
        close_span(lo + 1, hi - 1);
    close_span(hi + 1, 4095); /* beyond what the agent ever opens */
    prctl(PR_SET_NAME, "hangar-isig");
    for (;;) {
        unsigned char req[2];
        ssize_t n = read(fd, req, sizeof req);
        if (n < 0 && errno == EINTR)
            continue;
        if (n != (ssize_t)sizeof req)
            _exit(0);
        pid_t fg = tcgetpgrp(t);
        if (fg > 0)
            kill(-fg, req[0]);
        struct termios tm;
        if (tcgetattr(t, &tm) == 0) {
            if (!(tm.c_lflag & NOFLSH))
                ioctl(t, TCFLSH, TCOFLUSH); /* what the command wrote and nobody read yet */
            if ((tm.c_lflag & ECHO) && (tm.c_lflag & ECHOCTL)) {
                char echo[2] = {'^', (char)(req[1] ^ 0x40)};
                (void)!write(t, echo, sizeof echo);
            }
        }
    }
    return 0;
}

/* In the cloned child: become the command. Never returns. */
static int spawn_child(void *arg)
{
    struct spawn *sp = arg;
    int in_fd = sp->in_fd, out_fd = sp->out_fd, err_fd = sp->err_fd, tty_fd = sp->tty_fd;

    /* Undo what the agent changed. Without CLONE_SIGHAND these are the child's own copies.
     * Signals with a handler are reset by execve anyway; SIGTERM and SIGINT are reset here
     * so that one arriving before the exec kills the command as it should. SIGCHLD is not:
     * this child has no children, and its handler would only wake the handler's poll().
     * SIGPIPE is only blocked in the agent (see main), which the mask below undoes: a
     * blocked or ignored SIGPIPE would survive exec and break `cmd | head`. */
    set_handler(SIGTERM, SIG_DFL);
    set_handler(SIGINT, SIG_DFL);
    set_handler(SIGUSR1, SIG_DFL);
    set_handler(SIGUSR2, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);

    if (setsid() < 0)
        child_fail(sp, STAGE_SETUP, errno);
    if (tty_fd >= 0) {
        if (ioctl(tty_fd, TIOCSCTTY, 0) < 0)
            child_fail(sp, STAGE_SETUP, errno);
        /* Linux makes the new session the terminal's foreground group here by itself; gVisor
         * does not, and without a foreground group ^C (and ^Z, ^\) signal nobody. */
        pid_t me = getpid();
        if (ioctl(tty_fd, TIOCSPGRP, &me) < 0)
            child_fail(sp, STAGE_SETUP, errno);
        if (sp->isig_fd >= 0) {
            /* Without the helper ^C falls back to signalling the command's own group. */
            static char isig_stack[16 << 10] __attribute__((aligned(16)));
            clone(isig_helper, isig_stack + sizeof isig_stack, SIGCHLD, sp);
        }
        in_fd = out_fd = err_fd = tty_fd;
    }
    /* All our fds are >= 3 (main() made sure 0-2 are taken), so these cannot clobber each
     * other; dup2 clears close-on-exec on the copies. */
    if (dup2(in_fd, 0) < 0 || dup2(out_fd, 1) < 0 || dup2(err_fd, 2) < 0)
        child_fail(sp, STAGE_SETUP, errno);
    if (sp->chdir_needed && chdir(sp->cwd) < 0)
        child_fail(sp, STAGE_CHDIR, errno);
    exec_search(sp);
    child_fail(sp, STAGE_EXEC, errno);
    return 127;
}

static int open_pty(int *master, int *slave, unsigned short rows, unsigned short cols)
{
    int m = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (m < 0)
        m = open("/dev/pts/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC); /* /dev without a ptmx node */
    if (m < 0)
        return -1;
    char name[128];
    int err = 0;
    if (unlockpt(m) < 0)
        err = errno;
    else if ((err = ptsname_r(m, name, sizeof name)) == 0) {
        int s = open(name, O_RDWR | O_NOCTTY | O_CLOEXEC);
        if (s < 0) {
            err = errno;
        } else {
            struct winsize ws = {.ws_row = rows, .ws_col = cols};
            ioctl(m, TIOCSWINSZ, &ws);
            /* A new terminal's modes are whatever the kernel defaults to; gVisor's lack ISIG
             * (so ^C is a plain byte). Set what a Linux terminal starts with ("stty sane"). */
            struct termios t;
            if (tcgetattr(s, &t) == 0) {
                t.c_iflag |= ICRNL | IXON | IUTF8;
                t.c_oflag |= OPOST | ONLCR;
                t.c_lflag |= ISIG | ICANON | ECHO | ECHOE | ECHOK | IEXTEN | ECHOCTL | ECHOKE;
                t.c_cflag |= CS8 | CREAD;
                t.c_cc[VINTR] = 3;   /* ^C */
                t.c_cc[VQUIT] = 28;  /* ^\ */
                t.c_cc[VERASE] = 127;
                t.c_cc[VKILL] = 21;  /* ^U */
                t.c_cc[VEOF] = 4;    /* ^D */
                t.c_cc[VSUSP] = 26;  /* ^Z */
                tcsetattr(s, TCSANOW, &t);
            }
            *master = m;
            *slave = s;
            return 0;
        }
    }
    close(m);
    errno = err;
    return -1;
}

/* Whether this kernel's terminals ignore ISIG, as gVisor's did until 2023: there ^C reaches
 * the reader as a byte and nobody is interrupted. Probed on a scratch pty: with ISIG on, Linux
 * consumes the ^C (no foreground group, so no signal either) and the replica reads nothing. */
static int pty_lacks_isig(void)
{
    int m, s, lacks = 0;
    if (open_pty(&m, &s, 24, 80) < 0)
        return 0;
    struct termios t;
    if (tcgetattr(s, &t) == 0) {
        t.c_lflag |= ISIG;
        t.c_lflag &= (tcflag_t) ~(ICANON | ECHO);
        t.c_cc[VINTR] = 3;
        t.c_cc[VMIN] = 0;
        t.c_cc[VTIME] = 0;
        char c = 3, r;
        if (tcsetattr(s, TCSANOW, &t) == 0 && write(m, &c, 1) == 1) {
            fcntl(s, F_SETFL, fcntl(s, F_GETFL) | O_NONBLOCK);
            lacks = read(s, &r, 1) == 1;
        }
    }
    close(m);
    close(s);
    return lacks;
}

/* With emulate_isig: the signal a byte typed into the terminal stands for, or 0. */
static int isig_signal(int master, unsigned char c, struct termios *t)
{
    if (!(t->c_lflag & ISIG))
        return 0;
    if (c == t->c_cc[VINTR])
        return SIGINT;
    if (c == t->c_cc[VQUIT])
        return SIGQUIT;
    if (c == t->c_cc[VSUSP])
        return SIGTSTP;
    (void)master;
    return 0;
}

/* ---- exec: streaming ------------------------------------------------------------------- */

struct exec_io {
    int sock;
    pid_t pid;
    int out_fd; /* stdout pipe, or the pty master; -1 after EOF */
    int err_fd; /* stderr pipe; -1 with a tty or after EOF */
    int in_fd;  /* where 'I' payloads go (pipe or pty master); -1 once closed */
    int master; /* the pty master (kept until the end), or -1 */
    /* stdin: the payload of the last 'I' frame, until the command has taken all of it */
    char *in_buf;
    size_t in_off, in_len;
    int in_close_pending;
    /* the client frame being read */
    unsigned char hdr[HEADER_LEN];
    size_t hdr_got;
    char *rx_buf;
    uint32_t rx_len, rx_got;
    /* the frame being sent; only ever one, so a slow client back-pressures the command */
    char *tx;
    size_t tx_off, tx_len;
    int exited, timed_out;
    int emulate_isig; /* the kernel's ptys ignore ISIG: the agent raises ^C's SIGINT itself */
    int isig_fd;      /* ... through the isig helper in the command's session; -1 if none */
    int detachable;   /* the client asked to survive a checkpoint (see exec_detach) */
    int detach_fd;    /* while detached (sock is -1): where a re-attach arrives; else -1 */
    int64_t detached_exit_at; /* detached and exited: when it was first seen so */
};

static void kill_group(pid_t pid)
{
    kill(-pid, SIGKILL);
}

/* The exit is observed with WNOWAIT: the zombie keeps its pid, and so the process group id,
 * from being reused until we have killed the group and reaped it for real. */
static int child_exited(pid_t pid)
{
    for (;;) {
        siginfo_t si;
        memset(&si, 0, sizeof si);
        if (waitid(P_PID, (id_t)pid, &si, WEXITED | WNOHANG | WNOWAIT) == 0)
            return si.si_pid == pid;
        if (errno != EINTR)
            return errno == ECHILD;
    }
}

static void close_stdin(struct exec_io *io)
{
    if (io->in_fd >= 0 && io->in_fd != io->master)
        close(io->in_fd); /* for a tty, 'C' only stops our writes: ^D is the client's call */
    io->in_fd = -1;
    io->in_off = io->in_len = 0;
    io->in_close_pending = 0;
}

/* A second 'I' frame waits in the socket until the first has gone to the command. */
static int rx_paused(const struct exec_io *io)
{
    return io->hdr_got == HEADER_LEN && io->hdr[0] == 'I' && io->in_len > io->in_off;
}

static void exec_dispatch(struct exec_io *io)
{
    const char *v;
    unsigned long long a, b;
    io->rx_buf[io->rx_len] = '\0';
    switch (io->hdr[0]) {
    case 'I':
        if (io->in_fd >= 0 && !io->in_close_pending && io->rx_len > 0) {
            char *t = io->in_buf; /* swap buffers instead of copying */
            io->in_buf = io->rx_buf;
            io->rx_buf = t;
            io->in_off = 0;
            io->in_len = io->rx_len;
        }
        break;
    case 'C':
        io->in_close_pending = 1;
        break;
    case 'Z':
        if (io->master >= 0 && parse_uint(get_field(io->rx_buf, io->rx_len, "rows"), 10, 65535, &a) == 0 &&
            parse_uint(get_field(io->rx_buf, io->rx_len, "cols"), 10, 65535, &b) == 0) {
            struct winsize ws = {.ws_row = (unsigned short)a, .ws_col = (unsigned short)b};
            ioctl(io->master, TIOCSWINSZ, &ws); /* the kernel sends SIGWINCH */
        }
        break;
    case 'G':
        v = get_field(io->rx_buf, io->rx_len, "sig");
        if (parse_uint(v, 10, 64, &a) == 0 && a > 0)
            kill(-io->pid, (int)a);
        break;
    default:
        break; /* unknown control frames are ignored, for newer clients */
    }
}

/* Reads and acts on client frames until the socket would block. -1: client gone or broken. */
/* Reads from a non-blocking fd until buf holds want bytes (*got counts them across calls).
 * Returns 1 when complete, 0 when the fd has nothing more for now, -1 on EOF or error. */
static int read_some(int fd, void *buf, size_t want, size_t *got)
{
    while (*got < want) {
        ssize_t n = read(fd, (char *)buf + *got, want - *got);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return (errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : -1;
        }
        if (n == 0)
            return -1;
        *got += (size_t)n;
    }
    return 1;
}

static int exec_rx(struct exec_io *io)
{
    for (;;) {
        if (io->hdr_got < HEADER_LEN) {
            size_t got = io->hdr_got;
            int rc = read_some(io->sock, io->hdr, HEADER_LEN, &got);
            io->hdr_got = got;
            if (rc <= 0)
                return rc;
            io->rx_len = get_be32(io->hdr + 1);
            io->rx_got = 0;
            if (io->rx_len > MAX_PAYLOAD)
                return -1;
        }
        if (rx_paused(io))
            return 0;
        if (io->rx_got < io->rx_len) {
            size_t got = io->rx_got;
            int rc = read_some(io->sock, io->rx_buf, io->rx_len, &got);
            io->rx_got = (uint32_t)got;
            if (rc <= 0)
                return rc;
        }
        exec_dispatch(io);
        io->hdr_got = 0;
    }
}

static void exec_write_stdin(struct exec_io *io)
{
    struct termios t;
    int emulate = io->emulate_isig && io->in_fd == io->master && tcgetattr(io->master, &t) == 0;
    while (io->in_fd >= 0 && io->in_off < io->in_len) {
        size_t len = io->in_len - io->in_off;
        if (emulate) {
            /* Write up to the next signal character; that one becomes the signal, sent to
             * the terminal's foreground group (or the command's, if it has none). */
            size_t i = 0;
            int sig = 0;
            for (; i < len; i++)
                if ((sig = isig_signal(io->master, (unsigned char)io->in_buf[io->in_off + i], &t)))
                    break;
            if (i == 0 && sig) {
                unsigned char req[2] = {(unsigned char)sig, (unsigned char)io->in_buf[io->in_off]};
                pid_t fg = tcgetpgrp(io->master); /* works where the kernel allows it */
                if (fg > 0)
                    kill(-fg, sig);
                else if (io->isig_fd < 0 || write(io->isig_fd, req, sizeof req) != (ssize_t)sizeof req)
                    kill(-io->pid, sig);
                io->in_off++;
                continue;
            }
            len = i;
        }
        ssize_t n = write(io->in_fd, io->in_buf + io->in_off, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return;
            close_stdin(io); /* EPIPE/EIO: the command stopped reading; drop the rest */
            return;
        }
        io->in_off += (size_t)n;
    }
    io->in_off = io->in_len = 0;
}

/* -1: client gone. */
static int exec_tx_flush(struct exec_io *io)
{
    while (io->tx_off < io->tx_len) {
        ssize_t n = write(io->sock, io->tx + io->tx_off, io->tx_len - io->tx_off);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return (errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : -1;
        }
        io->tx_off += (size_t)n;
    }
    io->tx_off = io->tx_len = 0;
    return 0;
}

/* Reads one chunk of output into the (empty) tx buffer. 1: got data, 0: nothing now. */
static int exec_read_output(struct exec_io *io, int *fd, char type)
{
    ssize_t n;
    do
        n = read(*fd, io->tx + HEADER_LEN, OUTPUT_CHUNK);
    while (n < 0 && errno == EINTR);
    if (n > 0) {
        put_header(io->tx, type, (uint32_t)n);
        io->tx_off = 0;
        io->tx_len = HEADER_LEN + (size_t)n;
        return 1;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
        return 0;
    /* EOF, or EIO from a pty master once every slave fd is closed */
    if (*fd != io->master)
        close(*fd);
    *fd = -1;
    return 0;
}

static void exec_cleanup(struct exec_io *io)
{
    if (io->out_fd >= 0 && io->out_fd != io->master)
        close(io->out_fd);
    if (io->err_fd >= 0)
        close(io->err_fd);
    close_stdin(io);
    if (io->master >= 0)
        close(io->master);
    if (io->isig_fd >= 0)
        close(io->isig_fd); /* the helper sees EOF and exits */
    io->out_fd = io->err_fd = io->master = io->isig_fd = -1;
}

static int reap(pid_t pid, int *status)
{
    for (;;) {
        if (waitpid(pid, status, 0) == pid)
            return 0;
        if (errno != EINTR)
            return -1;
    }
}

/* ---- exec: surviving a checkpoint ------------------------------------------------------- *
 *
 * A connection to the host cannot be checkpointed (gVisor cannot save a host socket). Before a
 * checkpoint the host asks for a quiesce (op_quiesce): every handler streaming a command that
 * the client opened as detachable sends 'H' and closes its connection, and keeps the command
 * (and its pty) while listening on an abstract socket inside the sandbox, which a checkpoint
 * saves. After the restore the client connects again and sends 'A' with the command's pid: the
 * handler that takes it passes the new connection to the detached one (SCM_RIGHTS), which
 * answers 'S' and streams on. Output waits in the command's pipe meanwhile. */

static socklen_t detached_addr(struct sockaddr_un *a, pid_t pid)
{
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    int n = snprintf(a->sun_path + 1, sizeof a->sun_path - 1, "hangar-agent-detached-%d", (int)pid);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

/* 0: detached (io->sock is -1, io->detach_fd listens); -1: could not (the caller gives up). */
static int exec_detach(struct exec_io *io)
{
    int64_t deadline = now_ms() + 2000;
    while (io->tx_len) { /* the frame in flight goes first, so the stream stays whole */
        if (exec_tx_flush(io) < 0 || (io->tx_len && wait_fd(io->sock, POLLOUT, deadline) != 1))
            return -1;
    }
    struct sockaddr_un a;
    socklen_t alen = detached_addr(&a, io->pid);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return -1;
    if (bind(fd, (struct sockaddr *)&a, alen) < 0 || listen(fd, 4) < 0) {
        logmsg("detach: %s", strerror(errno));
        close(fd);
        return -1;
    }
    char frame[HEADER_LEN];
    put_header(frame, 'H', 0);
    if (write_all(io->sock, frame, sizeof frame) < 0) {
        close(fd);
        return -1;
    }
    close(io->sock);
    io->sock = -1;
    io->detach_fd = fd;
    io->hdr_got = 0; /* a client frame cut short is dropped: the next one starts afresh */
    io->rx_got = 0;
    __atomic_add_fetch(&g_shared->detached, 1, __ATOMIC_SEQ_CST);
    return 0;
}

/* A re-attach arrived on detach_fd: take over its connection. 1: attached, 0: not yet. */
static int exec_reattach(struct exec_io *io)
{
    int conn = accept4(io->detach_fd, NULL, NULL, SOCK_CLOEXEC);
    if (conn < 0)
        return 0;
    char byte;
    char cbuf[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {.iov_base = &byte, .iov_len = 1};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
    struct timeval tv = {2, 0};
    setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ssize_t n = recvmsg(conn, &m, MSG_CMSG_CLOEXEC);
    struct cmsghdr *c = n == 1 ? CMSG_FIRSTHDR(&m) : NULL;
    int fd = -1;
    if (c && c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS && c->cmsg_len == CMSG_LEN(sizeof(int)))
        memcpy(&fd, CMSG_DATA(c), sizeof fd);
    if (fd < 0) {
        close(conn);
        return 0;
    }
    set_nonblock_fresh(fd);
    g_out.fd = fd;
    g_out.len = 0;
    g_out.failed = 0;
    struct fields f = {0};
    field_addf(&f, "pid", "%d", (int)io->pid);
    reply_fields('S', &f);
    out_flush();
    ssize_t w = write(conn, "", 1); /* the passing handler may go now */
    (void)w;
    close(conn);
    if (g_out.failed) {
        close(fd);
        return 0; /* that client is gone already: stay detached for the next one */
    }
    close(io->detach_fd);
    io->detach_fd = -1;
    io->sock = fd;
    io->detached_exit_at = 0;
    __atomic_sub_fetch(&g_shared->detached, 1, __ATOMIC_SEQ_CST);
    return 1;
}

/* 'A' (in a fresh handler): hand this connection to the detached handler of command `pid`.
 * 0: handed over (the caller must neither reply nor shut the socket down); -1: replied. */
static int op_attach(const struct request *r, int sock)
{
    unsigned long long pid;
    if (parse_uint(req_get(r, "pid"), 10, INT_MAX, &pid) < 0 || pid == 0) {
        reply_error(EINVAL, "attach needs a pid");
        return -1;
    }
    struct sockaddr_un a;
    socklen_t alen = detached_addr(&a, (pid_t)pid);
    int conn = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (conn < 0 || connect(conn, (struct sockaddr *)&a, alen) < 0) {
        if (conn >= 0)
            close(conn);
        reply_error(ESRCH, "no detached command with pid %llu (it did not survive, or is attached)", pid);
        return -1;
    }
    char byte = 0;
    char cbuf[CMSG_SPACE(sizeof(int))];
    memset(cbuf, 0, sizeof cbuf);
    struct iovec iov = {.iov_base = &byte, .iov_len = 1};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &sock, sizeof sock);
    struct timeval tv = {2, 0};
    setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (sendmsg(conn, &m, MSG_NOSIGNAL) != 1 || read(conn, &byte, 1) != 1) {
        close(conn);
        reply_error(EIO, "could not hand the connection to command %llu", pid);
        return -1;
    }
    close(conn);
    return 0;
}

/* The command runs; stream until it is done. Returns -1 if the client went away (the
 * command has then been killed and reaped). */
static int exec_stream(struct exec_io *io, int64_t timeout_ms)
{
    int64_t deadline = timeout_ms > 0 ? now_ms() + timeout_ms : -1;
    int64_t drain_deadline = -1;
    enum { P_SIG, P_SOCK, P_OUT, P_ERR, P_IN, P_MAX };

    for (;;) {
        int64_t now = now_ms();
        if (!io->exited && deadline >= 0 && now >= deadline && !io->timed_out) {
            kill_group(io->pid);
            io->timed_out = 1;
        }
        if (io->sock < 0 && io->exited) {
            if (!io->detached_exit_at)
                io->detached_exit_at = now;
            else if (now - io->detached_exit_at > DETACHED_EXITED_MS)
                goto gone; /* nobody came back for it */
        }
        if (io->sock >= 0 && io->exited && ((io->out_fd < 0 && io->err_fd < 0) || now >= drain_deadline))
            break;

        struct pollfd p[P_MAX];
        int idx[P_MAX];
        int np = 0;
        for (int i = 0; i < P_MAX; i++)
            idx[i] = -1;
#define WATCH(slot, fd_, ev)                                                                   \
    do {                                                                                       \
        idx[slot] = np;                                                                        \
        p[np++] = (struct pollfd){.fd = (fd_), .events = (ev)};                                \
    } while (0)
        WATCH(P_SIG, g_sigpipe[0], POLLIN);
        if (io->sock < 0) /* detached: output waits in its pipe until someone re-attaches */
            WATCH(P_SOCK, io->detach_fd, POLLIN);
        else
            WATCH(P_SOCK, io->sock, (short)((rx_paused(io) ? 0 : POLLIN) | (io->tx_len ? POLLOUT : 0)));
        if (io->sock >= 0 && !io->tx_len && io->out_fd >= 0)
            WATCH(P_OUT, io->out_fd, POLLIN);
        if (io->sock >= 0 && !io->tx_len && io->err_fd >= 0)
            WATCH(P_ERR, io->err_fd, POLLIN);
        if (io->in_fd >= 0 && io->in_off < io->in_len)
            WATCH(P_IN, io->in_fd, POLLOUT);
#undef WATCH
        /* The 1 s cap is a safety net should a SIGCHLD ever go missing. */
        int timeout = 1000;
        if (io->exited && io->sock >= 0)
            timeout = ms_until(drain_deadline, now, 1000);
        else if (deadline >= 0)
            timeout = ms_until(deadline, now, 1000);

        int n = poll(p, (nfds_t)np, timeout);
        if (n < 0) {
            if (errno != EINTR) {
                logmsg("exec: poll: %s", strerror(errno));
                goto gone;
            }
            /* A signal handler ran (SIGCHLD, normally) and wrote to the self-pipe: act on it
             * now rather than in another round of poll(). Nothing is known to be ready. */
            for (int i = 0; i < np; i++)
                p[i].revents = 0;
        }
        if (n < 0 || p[idx[P_SIG]].revents)
            drain_fd(g_sigpipe[0]);
        if (!io->exited && child_exited(io->pid)) {
            io->exited = 1;
            drain_deadline = now_ms() + DRAIN_MS;
            if (io->isig_fd >= 0) {
                close(io->isig_fd); /* the helper goes, and with it its copy of the terminal */
                io->isig_fd = -1;
            }
        }

        if (g_detach_req && io->sock >= 0) {
            g_detach_req = 0;
            if (!io->detachable || exec_detach(io) < 0) {
                g_close_now = 1;
                goto gone; /* a checkpoint is coming and this stream cannot survive it */
            }
            continue;
        }
        short rev = p[idx[P_SOCK]].revents;
        if (io->sock < 0) {
            if (rev && exec_reattach(io) && io->exited)
                drain_deadline = now_ms() + DRAIN_MS;
            if (idx[P_IN] >= 0 && p[idx[P_IN]].revents)
                exec_write_stdin(io);
            continue;
        }
        if (rev & (POLLERR | POLLHUP | POLLNVAL))
            goto gone; /* the client hung up: nobody wants this command any more */
        if ((rev & POLLOUT) && exec_tx_flush(io) < 0)
            goto gone;
        if ((rev & POLLIN) && exec_rx(io) < 0)
            goto gone;

        if (idx[P_IN] >= 0 && p[idx[P_IN]].revents)
            exec_write_stdin(io);
        if (io->in_close_pending && io->in_off >= io->in_len)
            close_stdin(io);

        /* Output is read only into an empty tx buffer and sent right away: one chunk in
         * flight at most, so a slow client slows the command instead of filling memory. */
        if (idx[P_OUT] >= 0 && p[idx[P_OUT]].revents && io->out_fd >= 0 && !io->tx_len &&
            exec_read_output(io, &io->out_fd, 'O') && exec_tx_flush(io) < 0)
            goto gone;
        if (idx[P_ERR] >= 0 && p[idx[P_ERR]].revents && io->err_fd >= 0 && !io->tx_len &&
            exec_read_output(io, &io->err_fd, 'R') && exec_tx_flush(io) < 0)
            goto gone;
    }

    /* The command is done. Whatever is left in its group (a daemonised grandchild holding
     * our pipes) goes too; then deliver what already sits in the pipes, boundedly, since a
     * process that escaped the group could keep writing. */
    kill_group(io->pid);
    int *fds[2] = {&io->out_fd, &io->err_fd};
    const char types[2] = {'O', 'R'};
    for (int i = 0; i < 2; i++) {
        size_t total = 0;
        if (*fds[i] >= 0 && *fds[i] != io->master)
            set_nonblock_fresh(*fds[i]); /* read until empty: must not block (see op_exec) */
        while (*fds[i] >= 0 && total < FINAL_DRAIN_LIMIT) {
            if (write_all(io->sock, io->tx + io->tx_off, io->tx_len - io->tx_off) < 0)
                goto gone;
            io->tx_off = io->tx_len = 0;
            if (!exec_read_output(io, fds[i], types[i]))
                break;
            total += io->tx_len - HEADER_LEN;
        }
    }
    if (write_all(io->sock, io->tx + io->tx_off, io->tx_len - io->tx_off) < 0)
        goto gone;
    io->tx_off = io->tx_len = 0;
    exec_cleanup(io);
    return 0;

gone:
    if (io->detach_fd >= 0) {
        close(io->detach_fd);
        io->detach_fd = -1;
        __atomic_sub_fetch(&g_shared->detached, 1, __ATOMIC_SEQ_CST);
    }
    kill_group(io->pid);
    exec_cleanup(io);
    int status;
    reap(io->pid, &status);
    g_cmd_pgid = 0;
    return -1;
}

struct exec_request {
    char **argv;
    char **envp;
    char **sh_argv;
    const char *cwd;
    unsigned long long timeout_ms, rows, cols;
    int tty, want_stdin, detachable;
};

/* Validates and unpacks an 'E' request; replies F and returns -1 if it is malformed. */
static int parse_exec(const struct request *r, struct exec_request *x)
{
    size_t argc = 0, pos = 0;
    const char *v;
    while (next_field(r->buf, r->len, "arg", &pos))
        argc++;
    if (argc == 0) {
        reply_error(EINVAL, "exec needs at least one arg");
        return -1;
    }
    pos = 0;
    while ((v = next_field(r->buf, r->len, "env", &pos)) != NULL) {
        if (!strchr(v, '=') || v[0] == '=') {
            reply_error(EINVAL, "bad env entry %.256s: expected NAME=VALUE", v);
            return -1;
        }
    }
    x->timeout_ms = 0;
    x->rows = 24;
    x->cols = 80;
    if ((v = req_get(r, "timeout_ms")) && parse_uint(v, 10, 1000ULL * 86400 * 365, &x->timeout_ms) < 0) {
        reply_error(EINVAL, "bad timeout_ms %.64s", v);
        return -1;
    }
    if (((v = req_get(r, "rows")) && parse_uint(v, 10, 65535, &x->rows) < 0) ||
        ((v = req_get(r, "cols")) && parse_uint(v, 10, 65535, &x->cols) < 0)) {
        reply_error(EINVAL, "bad rows/cols");
        return -1;
    }
    x->tty = req_flag(r, "tty");
    x->want_stdin = req_flag(r, "stdin");
    x->detachable = req_flag(r, "detach");
    x->cwd = req_get(r, "cwd");
    if (!x->cwd || !*x->cwd)
        x->cwd = "/";

    x->argv = calloc(argc + 1, sizeof *x->argv);
    x->sh_argv = calloc(argc + 2, sizeof *x->sh_argv);
    x->envp = merge_env(r);
    if (!x->argv || !x->sh_argv || !x->envp) {
        reply_errno(ENOMEM, "exec");
        return -1; /* the handler exits right after; no point freeing */
    }
    pos = 0;
    for (size_t i = 0; i < argc; i++)
        x->argv[i] = (char *)next_field(r->buf, r->len, "arg", &pos);
    return 0;
}

/* Creates the command's stdio and starts it. On failure (including a failed chdir or exec
 * in the child) replies F and returns -1; on success io holds our ends and the pid. */
static int start_command(const struct exec_request *x, struct exec_io *io)
{
    /* The child's ends, closed here once it has them. */
    int c_in = -1, c_out = -1, c_err = -1, c_tty = -1, c_isig = -1;
    int in_fd, p[2];
    int err = 0;
    pid_t pid = -1;

    if (x->tty) {
        if (open_pty(&io->master, &c_tty, (unsigned short)x->rows, (unsigned short)x->cols) < 0)
            goto failed;
        io->out_fd = io->in_fd = io->master;
        io->emulate_isig = pty_lacks_isig();
        if (io->emulate_isig && socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, p) == 0) {
            io->isig_fd = p[0];
            c_isig = p[1];
            fcntl(io->isig_fd, F_SETFL, fcntl(io->isig_fd, F_GETFL) | O_NONBLOCK);
        }
    } else {
        if (pipe2(p, O_CLOEXEC) < 0)
            goto failed;
        io->out_fd = p[0];
        c_out = p[1];
        if (pipe2(p, O_CLOEXEC) < 0)
            goto failed;
        io->err_fd = p[0];
        c_err = p[1];
        if (x->want_stdin) {
            if (pipe2(p, O_CLOEXEC) < 0)
                goto failed;
            c_in = p[0];
            io->in_fd = p[1];
        } else if (g_devnull < 0) {
            /* No /dev/null in this image: an empty pipe reads as EOF just the same. */
            if (pipe2(p, O_CLOEXEC) < 0)
                goto failed;
            c_in = p[0];
            close(p[1]);
        }
    }
    in_fd = c_in >= 0 ? c_in : g_devnull; /* g_devnull is shared by every exec: never closed */

    /* The child runs on this stack until it execs; we are suspended meanwhile. */
    static char spawn_stack[64 << 10] __attribute__((aligned(16)));
    struct spawn sp = {
        .argv = x->argv,
        .envp = x->envp,
        .sh_argv = x->sh_argv,
        .cwd = x->cwd,
        .chdir_needed = !(g_cwd_is_root && strcmp(x->cwd, "/") == 0),
        .in_fd = in_fd,
        .out_fd = c_out,
        .err_fd = c_err,
        .tty_fd = c_tty,
        .isig_fd = c_isig,
    };
    sigset_t old;
    block_signals(&old);
    pid = clone(spawn_child, spawn_stack + sizeof spawn_stack, CLONE_VM | CLONE_VFORK | SIGCHLD, &sp);
    err = errno;
    if (pid > 0)
        g_cmd_pgid = pid; /* before SIGTERM can arrive: on_handler_term needs it */
    sigprocmask(SIG_SETMASK, &old, NULL);
    if (pid < 0) {
        errno = err;
        goto failed;
    }
    io->pid = pid;
    close_fds((int[]){c_in, c_out, c_err, c_tty, c_isig}, 5);
    struct exec_failure fail = sp.fail; /* complete: the child has exec'd or exited by now */
    if (fail.stage == 0)
        return 0;
    int status;
    reap(pid, &status);
    g_cmd_pgid = 0;
    exec_cleanup(io);
    if (fail.stage == STAGE_CHDIR)
        reply_error(fail.err, "chdir %.2048s: %s", x->cwd, strerror(fail.err));
    else if (fail.stage == STAGE_EXEC)
        reply_error(fail.err, "exec %.2048s: %s", x->argv[0], strerror(fail.err));
    else
        reply_error(fail.err, "starting %.2048s: %s", x->argv[0], strerror(fail.err));
    return -1;

failed:
    err = errno;
    close_fds((int[]){c_in, c_out, c_err, c_tty, c_isig}, 5);
    exec_cleanup(io);
    reply_errno(err, "exec setup");
    return -1;
}

static void op_exec(const struct request *r)
{
    struct exec_request x;
    struct exec_io io;
    memset(&io, 0, sizeof io);
    io.sock = g_out.fd;
    io.out_fd = io.err_fd = io.in_fd = io.master = io.isig_fd = io.detach_fd = -1;

    if (parse_exec(r, &x) < 0)
        return;
    io.rx_buf = handler_buf(&g_buf.rx, MAX_PAYLOAD + 1);
    io.in_buf = handler_buf(&g_buf.in, MAX_PAYLOAD + 1);
    io.tx = handler_buf(&g_buf.tx, HEADER_LEN + OUTPUT_CHUNK);
    if (!io.rx_buf || !io.in_buf || !io.tx) {
        reply_errno(ENOMEM, "exec");
        return;
    }
    if (start_command(&x, &io) < 0)
        return;

    struct fields f = {0};
    field_addf(&f, "pid", "%d", (int)io.pid);
    reply_fields('S', &f);
    out_flush();
    if (g_out.failed) {
        kill_group(io.pid);
        exec_cleanup(&io);
        int status;
        reap(io.pid, &status);
        return;
    }

    /* The socket is non-blocking since accept. Stdin (a pipe, or the pty master that is
     * also the output) must be, as poll() cannot promise room for a whole write. The output
     * pipes are read only when poll() says they are ready, which a blocking pipe honours
     * too; exec_stream makes them non-blocking only for its final drain, which reads
     * without poll(). That saves two syscalls on most execs. */
    if (io.in_fd >= 0)
        set_nonblock_fresh(io.in_fd);

    io.detachable = x.detachable;
    int streamed = exec_stream(&io, (int64_t)x.timeout_ms);
    g_out.fd = io.sock; /* a re-attach may have brought a new connection (or none: -1) */
    if (streamed < 0)
        return;

    int status = 0;
    int reaped = reap(io.pid, &status) == 0;
    g_cmd_pgid = 0;
    int code = -1, sig = 0;
    if (io.timed_out) {
        sig = SIGKILL;
    } else if (reaped && WIFEXITED(status)) {
        code = WEXITSTATUS(status);
    } else if (reaped && WIFSIGNALED(status)) {
        sig = WTERMSIG(status);
        code = 128 + sig;
    }
    f.len = 0;
    field_addf(&f, "code", "%d", code);
    field_addf(&f, "signal", "%d", sig);
    field_addf(&f, "timed_out", "%d", io.timed_out);
    reply_fields('X', &f);
}

/* ---- one connection -------------------------------------------------------------------- */

/* Half-close, then wait briefly for the client to hang up before closing: closing a socket
 * with unread input can make the client lose the reply it has not read yet. */
static void linger_close(int sock)
{
    shutdown(sock, SHUT_WR);
    int64_t deadline = now_ms() + LINGER_MS;
    char buf[16384];
    /* Read first (the socket is non-blocking): usually the client has hung up already. */
    for (;;) {
        ssize_t n = read(sock, buf, sizeof buf);
        if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK))
            break;
        if (n < 0 && errno != EINTR && wait_fd(sock, POLLIN, deadline) != 1)
            break;
    }
    close(sock);
}

/* What every handler needs, made once by the main process for all of them to inherit (see
 * g_buf). Failures are not fatal: handler_buf retries an allocation in the handler that
 * needs it, and exec gives a command an empty pipe as stdin instead of /dev/null. */
static void handler_prepare(void)
{
    /* One mmap rather than malloc: malloc would write its chunk headers, and every page the
     * main process has touched costs each fork() (made copy-on-write) and each handler (a
     * fault to copy it). Untouched, the buffers are just address space until used. */
    const size_t big = (MAX_PAYLOAD + 1 + 63) & ~(size_t)63;
    char *m = mmap(NULL, 3 * big + HEADER_LEN + OUTPUT_CHUNK, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m != MAP_FAILED) {
        g_buf.req = m;
        g_buf.rx = m + big;
        g_buf.in = m + 2 * big;
        g_buf.tx = m + 3 * big;
    }
    if (g_devnull < 0)
        g_devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
}

/* 'Q': make the sandbox checkpointable. The main process stops listening and every handler
 * closes its connection to the host (detachable commands detach, see exec_detach; the rest
 * end), then this one replies and closes too. The host sends SIGUSR2 to PID 1 (runsc kill)
 * after the restore, or should the checkpoint not happen, to listen again. */
static void op_quiesce(void)
{
    if (!g_shared) {
        reply_error(ENOMEM, "quiesce is unavailable");
        return;
    }
    __atomic_store_n(&g_shared->quiesced, QUIESCE_NONE, __ATOMIC_SEQ_CST);
    if (kill(g_agent_pid, SIGUSR1) < 0) {
        reply_errno(errno, "quiesce");
        return;
    }
    int64_t deadline = now_ms() + QUIESCE_MS + 2000;
    int state;
    while ((state = __atomic_load_n(&g_shared->quiesced, __ATOMIC_SEQ_CST)) == QUIESCE_NONE &&
           now_ms() < deadline)
        poll(NULL, 0, 2);
    if (state == QUIESCE_DONE)
        reply_ok();
    else
        reply_error(EBUSY, "connections to the agent stayed open; the sandbox cannot be checkpointed now");
}

/* ---- tunnels (preview URLs) ------------------------------------------------------------ */

/* One direction of a tunnel: bytes read from src wait in buf until written to dst. */
struct pipe_dir {
    int src, dst;
    char *buf;
    size_t len, off;
    int eof; /* src said EOF (dst then gets a half-close once buf is written) */
};

static int pipe_read(struct pipe_dir *d)
{
    ssize_t n = recv(d->src, d->buf, TUNNEL_BUF, 0);
    if (n > 0) {
        d->len = (size_t)n;
        d->off = 0;
        return 0;
    }
    if (n < 0 && (errno == EAGAIN || errno == EINTR))
        return 0;
    d->eof = 1; /* EOF, or an error (ECONNRESET): either way nothing more comes */
    shutdown(d->dst, SHUT_WR);
    return n < 0 ? -1 : 0;
}

static int pipe_write(struct pipe_dir *d)
{
    ssize_t n = send(d->dst, d->buf + d->off, d->len - d->off, MSG_NOSIGNAL);
    if (n < 0)
        return errno == EAGAIN || errno == EINTR ? 0 : -1;
    d->off += (size_t)n;
    if (d->off == d->len) {
        d->len = d->off = 0;
        if (d->eof)
            shutdown(d->dst, SHUT_WR);
    }
    return 0;
}

/* Relay bytes between the host's connection and the TCP connection until both directions
 * have ended (half-closes are passed on), either side fails, or a quiesce asks us to let go. */
static void tunnel_relay(int host, int tcp)
{
    static char up_buf[TUNNEL_BUF], down_buf[TUNNEL_BUF];
    fcntl(tcp, F_SETFL, fcntl(tcp, F_GETFL) | O_NONBLOCK);
    fcntl(host, F_SETFL, fcntl(host, F_GETFL) | O_NONBLOCK);
    struct pipe_dir up = {.src = host, .dst = tcp, .buf = up_buf};
    struct pipe_dir down = {.src = tcp, .dst = host, .buf = down_buf};
    while (!(up.eof && !up.len && down.eof && !down.len)) {
        if (g_detach_req || g_got_term)
            return; /* a quiesce (or the end): a tunnel is not kept across a checkpoint */
        struct pollfd p[2] = {{.fd = host}, {.fd = tcp}};
        if (!up.eof && !up.len)
            p[0].events |= POLLIN;
        if (down.len)
            p[0].events |= POLLOUT;
        if (!down.eof && !down.len)
            p[1].events |= POLLIN;
        if (up.len)
            p[1].events |= POLLOUT;
        int n = poll(p, 2, 250);
        if (n < 0 && errno != EINTR)
            return;
        if (n <= 0)
            continue;
        if ((p[0].revents & (POLLIN | POLLHUP | POLLERR)) && !up.eof && !up.len && pipe_read(&up) < 0)
            return;
        if ((p[1].revents & (POLLIN | POLLHUP | POLLERR)) && !down.eof && !down.len && pipe_read(&down) < 0)
            return;
        if ((p[1].revents & (POLLOUT | POLLERR | POLLHUP)) && up.len && pipe_write(&up) < 0)
            return;
        if ((p[0].revents & (POLLOUT | POLLERR | POLLHUP)) && down.len && pipe_write(&down) < 0)
            return;
    }
}

/* 'T': a TCP connection to a port of the sandbox's own loopback (a preview URL's server).
 * Replies K once connected (F, with ECONNREFUSED, when nothing listens there: on 127.0.0.1
 * nor ::1); from then on the connection carries the raw bytes both ways until both sides
 * have closed. Only the sandbox's loopback is reachable this way, whatever its egress rules. */
static void op_tunnel(const struct request *r)
{
    const char *port_s = req_get(r, "port");
    char *end = NULL;
    long port = port_s ? strtol(port_s, &end, 10) : -1;
    if (!port_s || !*port_s || *end || port < 1 || port > 65535) {
        reply_error(EINVAL, "port must be a number from 1 to 65535");
        return;
    }
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        reply_errno(errno, "socket");
        return;
    }
    struct sockaddr_in a4 = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a4.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int err = 0;
    if (connect(fd, (struct sockaddr *)&a4, sizeof a4) < 0) {
        err = errno;
        close(fd);
        /* A server listening only on ::1. */
        fd = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_in6 a6 = {.sin6_family = AF_INET6, .sin6_port = htons((uint16_t)port)};
        a6.sin6_addr = in6addr_loopback;
        if (fd >= 0 && connect(fd, (struct sockaddr *)&a6, sizeof a6) == 0) {
            err = 0;
        } else if (fd >= 0) {
            close(fd);
            fd = -1;
        }
    }
    if (fd < 0 || err) {
        reply_error(err ? err : ECONNREFUSED, "nothing accepts connections on port %ld in the sandbox (%s)",
                    port, strerror(err ? err : ECONNREFUSED));
        return;
    }
    reply_ok();
    out_flush();
    if (!g_out.failed)
        tunnel_relay(g_out.fd, fd);
    close(fd);
    g_close_now = 1; /* everything was relayed already: no lingering */
}

/* Serves the one request of a connection; sock must be non-blocking (see read_full). */
static void serve(int sock)
{
    g_out.fd = sock;
    g_out.len = 0;
    g_out.failed = 0;
    struct request req = {0};
    req.buf = handler_buf(&g_buf.req, MAX_PAYLOAD + 1);
    if (!req.buf) {
        close(sock);
        return;
    }
    int rc = read_frame(sock, &req.type, req.buf, &req.len, now_ms() + REQUEST_TIMEOUT_MS);
    if (rc == FRAME_TOO_BIG) {
        reply_error(EMSGSIZE, "frame larger than %u bytes", MAX_PAYLOAD);
    } else if (rc != FRAME_OK) {
        close(sock);
        return;
    } else {
        switch (req.type) {
        case 'P':
            op_ping();
            break;
        case 'E':
            op_exec(&req);
            break;
        case 'R':
            op_read(&req);
            break;
        case 'W':
            op_write(&req);
            break;
        case 'L':
            op_list(&req);
            break;
        case 'M':
            op_mkdir(&req);
            break;
        case 'D':
            op_delete(&req);
            break;
        case 'S':
            op_stat(&req);
            break;
        case 'Q':
            op_quiesce();
            out_flush();
            close(sock); /* at once: the host checkpoints as soon as it sees this close */
            return;
        case 'T':
            op_tunnel(&req);
            break;
        case 'A':
            if (op_attach(&req, sock) == 0)
                return; /* the connection is the detached handler's now: just drop our copy */
            break;
        default:
            reply_error(EINVAL, "unknown request type 0x%02x", (unsigned char)req.type);
            break;
        }
    }
    out_flush();
    if (g_close_now)
        close(g_out.fd);
    else
        linger_close(g_out.fd); /* exec: the connection it ended on */
}

/* ---- the main process ------------------------------------------------------------------ */

/* Spares. In gVisor (ptrace platform) a fork costs ~3 ms, more than all the rest of a ping,
 * so handlers are forked ahead of time: the main process keeps SPARES of them waiting on the
 * listening socket, which several processes may accept on. The one that gets a connection
 * marks its slot on g_board busy and serves it. Only when it took the last idle spare does
 * it also wake the main process (a byte on g_notify), which then forks replacements at once;
 * otherwise the main process finds out when the handler exits. A spare that dies before
 * getting a connection is replaced when it is reaped, its slot still marked idle.
 *
 * When to fork a replacement: at once if no spare is left, otherwise once a handler has
 * exited (or at the 1 s poll timeout, should handlers keep running). A sandbox is usually
 * held to one CPU, and a fork running alongside a request slows it by about what the fork
 * costs; forked after the handler is done, it mostly fills the idle time before the next
 * request instead, while the other spare stands ready.
 *
 * The main process accepts connections itself only while it has no spare (forks failing):
 * then it forks per connection as before, and can at least tell the client that it cannot
 * fork. Otherwise a burst of connections waits in the listen backlog for spares; the main
 * process forks them as fast as it could fork handlers.
 *
 * gVisor wakes every spare for each connection; all but one find nothing to accept and wait
 * again. With two spares that costs little, and it lets a second connection be served while
 * the first one's replacement is yet to be forked. */
#define SPARES 2
/* After a failed fork, or a spare that died waiting, wait this long before forking another:
 * whatever keeps going wrong must not turn the main process into a fork loop. */
#define SPARE_RETRY_MS 100

enum { SLOT_EMPTY, SLOT_IDLE, SLOT_BUSY };

/* Shared memory (MAP_SHARED, made before any fork): the state of each spare slot. The main
 * process sets IDLE before it forks a spare into the slot, and EMPTY if it reaps that spare
 * still in it; the spare sets BUSY when it has a connection, and never touches the slot
 * again, so the main process may then fork the next spare into it. */
static struct board {
    int slot[SPARES];
} *g_board;

static pid_t g_spares[SPARES];     /* main only: the last process forked into each slot, or 0 */
static int g_notify[2] = {-1, -1}; /* last idle spare taken -> main: "fork more now" */
static int64_t g_spare_retry_at;   /* no spare is forked before this (now_ms); 0: any time */
static int g_spare_fork_failing;   /* to log a run of failed forks once */
static int g_spare_slot;           /* in a spare: its slot */
static sigset_t g_handler_mask;    /* the signal mask handlers run with */

static int slot_state(int slot)
{
    return __atomic_load_n(&g_board->slot[slot], __ATOMIC_SEQ_CST);
}

static void set_slot_state(int slot, int state)
{
    __atomic_store_n(&g_board->slot[slot], state, __ATOMIC_SEQ_CST);
}

static int idle_spares(void)
{
    int n = 0;
    for (int i = 0; i < SPARES; i++)
        n += slot_state(i) == SLOT_IDLE;
    return n;
}

static void track_handler(pid_t pid)
{
    if (g_nhandlers == g_handlers_cap) {
        size_t cap = g_handlers_cap ? g_handlers_cap * 2 : 64;
        pid_t *p = realloc(g_handlers, cap * sizeof *p);
        if (!p)
            return; /* untracked: only matters for a non-init agent's shutdown */
        g_handlers = p;
        g_handlers_cap = cap;
    }
    g_handlers[g_nhandlers++] = pid;
}

/* Reaps every exited child: handlers, spares and, as PID 1, every orphan in the sandbox.
 * Returns 1 while any child remains. */
static int reap_children(void)
{
    for (;;) {
        int status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid > 0) {
            for (size_t i = 0; i < g_nhandlers; i++) {
                if (g_handlers[i] == pid) {
                    g_handlers[i] = g_handlers[--g_nhandlers];
                    break;
                }
            }
            for (int slot = 0; slot < SPARES; slot++) {
                if (g_spares[slot] != pid)
                    continue;
                /* Still IDLE: it never got a connection (it marks BUSY before anything that
                 * could fail). Exited, it can no longer change the slot. */
                if (slot_state(slot) == SLOT_IDLE && !g_got_term && !g_quiescing) {
                    logmsg("spare handler %d ended while waiting (status 0x%x)", (int)pid, (unsigned)status);
                    g_spare_retry_at = now_ms() + SPARE_RETRY_MS;
                }
                g_spares[slot] = 0;
                set_slot_state(slot, SLOT_EMPTY);
            }
            continue;
        }
        if (pid == 0)
            return 1;
        if (errno == EINTR)
            continue;
        return errno != ECHILD;
    }
}

/* In a new handler or spare, right after fork() with signals still blocked: drop what is
 * the main process's and make the handler's own self-pipe (on_signal writes to it). The
 * caller closes listen_fd and g_notify[1] once it no longer needs them. */
static void become_handler(void)
{
    g_is_handler = 1;
    close_set((int[]){g_sigpipe[0], g_sigpipe[1], g_notify[0]}, 3);
    g_notify[0] = -1;
    if (make_sigpipe() < 0)
        _exit(1);
    if (!g_is_init) {
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() != g_agent_pid)
            _exit(0); /* the agent died before the line above */
    }
}

/* The life of a spare: wait for a connection, serve it. Never returns. Signals stay blocked
 * except inside ppoll(): an idle spare ends on SIGTERM there, and none can arrive between
 * accept() and g_serving = 1, which would lose the connection. */
static void run_spare(int listen_fd)
{
    int fd;
    for (;;) {
        struct pollfd p = {.fd = listen_fd, .events = POLLIN};
        int n = ppoll(&p, 1, NULL, &g_handler_mask);
        if (n < 0 && errno == EINTR)
            continue;
        if (n > 0 && (p.revents & POLLIN)) {
            fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
            if (fd >= 0)
                break;
            /* EAGAIN: another spare (or the main process) was quicker. ECONNABORTED: the
             * client gave up while queued. */
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED)
                continue;
            logmsg("accept: %s", strerror(errno));
        } else if (n < 0) {
            logmsg("poll: %s", strerror(errno));
        }
        /* EMFILE, ENOBUFS, an error on the socket...: back off instead of spinning */
        struct timespec pause = {0, 50 * 1000000};
        ppoll(NULL, 0, &pause, &g_handler_mask);
    }
    g_serving = 1;
    /* Sequentially consistent, so that of two spares taking the last two connections at
     * once, at least one sees the other busy and wakes the main process. */
    set_slot_state(g_spare_slot, SLOT_BUSY);
    if (idle_spares() == 0) {
        ssize_t w = write(g_notify[1], "", 1); /* should it fail, our exit tells */
        (void)w;
    }
    close_set((int[]){g_notify[1], listen_fd}, 2);
    sigprocmask(SIG_SETMASK, &g_handler_mask, NULL);
    serve(fd);
    _exit(0);
}

static int start_spare(int listen_fd, int slot)
{
    sigset_t old;
    block_signals(&old);
    g_spare_slot = slot; /* for the child */
    set_slot_state(slot, SLOT_IDLE);
    pid_t pid = fork();
    if (pid == 0) {
        become_handler();
        run_spare(listen_fd);
    }
    int err = errno;
    if (pid > 0) {
        track_handler(pid);
        g_spares[slot] = pid;
    } else {
        set_slot_state(slot, SLOT_EMPTY);
    }
    sigprocmask(SIG_SETMASK, &old, NULL);
    if (pid < 0) {
        if (!g_spare_fork_failing)
            logmsg("fork: %s", strerror(err));
        g_spare_fork_failing = 1;
        return -1;
    }
    g_spare_fork_failing = 0;
    return 0;
}

/* Forks a spare into every slot without an idle one (a busy one's process has become a
 * plain handler). 0: done; -1: not now (see SPARE_RETRY_MS). */
static int top_up_spares(int listen_fd)
{
    if (g_spare_retry_at && now_ms() < g_spare_retry_at)
        return -1;
    g_spare_retry_at = 0;
    for (int slot = 0; slot < SPARES; slot++) {
        if (slot_state(slot) != SLOT_IDLE && start_spare(listen_fd, slot) < 0) {
            g_spare_retry_at = now_ms() + SPARE_RETRY_MS;
            return -1;
        }
    }
    return 0;
}

/* A connection the main process accepted itself (no spare): fork a handler for it. */
static void start_handler(int listen_fd, int fd)
{
    sigset_t old;
    block_signals(&old);
    pid_t pid = fork();
    if (pid == 0) {
        close_set((int[]){listen_fd, g_notify[1]}, 2);
        g_serving = 1;
        become_handler();
        sigprocmask(SIG_SETMASK, &g_handler_mask, NULL);
        serve(fd);
        _exit(0);
    }
    int err = errno;
    if (pid > 0)
        track_handler(pid);
    sigprocmask(SIG_SETMASK, &old, NULL);
    if (pid < 0) {
        logmsg("fork: %s", strerror(err));
        g_out.fd = fd;
        g_out.len = 0;
        g_out.failed = 0;
        reply_error(err, "agent cannot fork: %s", strerror(err));
        out_flush();
    }
    close(fd);
}

static void accept_all(int listen_fd)
{
    for (;;) {
        int fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd >= 0) {
            start_handler(listen_fd, fd);
            continue;
        }
        if (errno == EINTR || errno == ECONNABORTED)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            /* EMFILE, ENOBUFS...: back off instead of spinning on a ready listen socket */
            logmsg("accept: %s", strerror(errno));
            poll(NULL, 0, 50);
        }
        return;
    }
}

static int open_listener(const char *path)
{
    /* Bound under a temporary name and renamed into place once listening: the socket's path
     * exists only while something listens on it, so the launcher may take "the path is there"
     * for "the agent is ready" without a round trip (a connection made then waits in the
     * backlog for a handler), and nobody can connect between bind() and listen(). */
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    static const char suffix[] = ".new";
    if (strlen(path) + sizeof suffix > sizeof addr.sun_path) {
        logmsg("socket path too long (max %zu bytes): %s", sizeof addr.sun_path - sizeof suffix, path);
        return -1;
    }
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s%s", path, suffix);
    const char *tmp = addr.sun_path;

    const char *slash = strrchr(path, '/');
    if (slash && slash != path) {
        char parent[sizeof addr.sun_path];
        memcpy(parent, path, (size_t)(slash - path));
        parent[slash - path] = '\0';
        mkdir_p(parent, 0755, NULL);
    }
    struct stat st;
    if (lstat(path, &st) == 0 && !S_ISSOCK(st.st_mode)) {
        logmsg("%s exists and is not a socket; not replacing it", path);
        return -1;
    }
    if (lstat(tmp, &st) == 0) {
        if (!S_ISSOCK(st.st_mode)) {
            logmsg("%s exists and is not a socket; not replacing it", tmp);
            return -1;
        }
        unlink(tmp); /* stale, from an earlier run */
    }
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
        logmsg("socket: %s", strerror(errno));
        return -1;
    }
    /* The umask closes the window between bind and chmod; restored at once, because the
     * commands inherit it. */
    mode_t old_umask = umask(077);
    int rc = bind(fd, (struct sockaddr *)&addr, sizeof addr);
    umask(old_umask);
    if (rc < 0) {
        logmsg("bind %s: %s", tmp, strerror(errno));
        close(fd);
        return -1;
    }
    chmod(tmp, 0600);
    if (listen(fd, 128) < 0) {
        logmsg("listen: %s", strerror(errno));
        close(fd);
        unlink(tmp);
        return -1;
    }
    /* Replaces a stale socket from an earlier run, if there is one. */
    if (rename(tmp, path) < 0) {
        logmsg("rename %s to %s: %s", tmp, path, strerror(errno));
        close(fd);
        unlink(tmp);
        return -1;
    }
    return fd;
}

/* SIGUSR1 (from op_quiesce): stop listening, and have every handler let go of its host
 * connection. Returns the listening fd, now -1. */
static int quiesce_start(int listen_fd, const char *socket_path)
{
    if (listen_fd >= 0) {
        close(listen_fd);
        unlink(socket_path); /* connecting now fails at once rather than queueing */
    }
    g_quiescing = 1;
    for (size_t i = 0; i < g_nhandlers; i++)
        kill(g_handlers[i], SIGUSR1);
    /* Idle spares hold the listening socket too: they go (a busy one ignores SIGTERM). */
    for (int slot = 0; slot < SPARES; slot++)
        if (g_spares[slot] > 0 && slot_state(slot) == SLOT_IDLE)
            kill(g_spares[slot], SIGTERM);
    return -1;
}

/* SIGTERM: stop taking connections, end everything, exit 0. */
static void shutdown_agent(int listen_fd, const char *socket_path)
{
    close(listen_fd);
    unlink(socket_path);
    if (g_is_init) {
        kill(-1, SIGTERM); /* every process in the sandbox except us */
    } else {
        for (size_t i = 0; i < g_nhandlers; i++)
            kill(g_handlers[i], SIGTERM);
    }
    int64_t deadline = now_ms() + SHUTDOWN_GRACE_MS;
    while (reap_children() && now_ms() < deadline) {
        struct pollfd p = {.fd = g_sigpipe[0], .events = POLLIN};
        if (poll(&p, 1, ms_until(deadline, now_ms(), 50)) > 0)
            drain_fd(g_sigpipe[0]);
    }
    if (reap_children()) {
        if (g_is_init) {
            kill(-1, SIGKILL);
        } else {
            for (size_t i = 0; i < g_nhandlers; i++)
                kill(g_handlers[i], SIGKILL);
        }
        deadline = now_ms() + 1000;
        while (reap_children() && now_ms() < deadline)
            poll(NULL, 0, 10);
    }
    exit(0);
}

static void usage(FILE *out)
{
    fprintf(out, "usage: hangar-agent [--socket PATH]\n"
                 "Serves exec and file requests on a unix socket (default %s,\n"
                 "or $HANGAR_AGENT_SOCKET). Meant to run as PID 1 of a sandbox.\n",
            DEFAULT_SOCKET);
}

int main(int argc, char **argv)
{
    const char *socket_path = getenv("HANGAR_AGENT_SOCKET");
    if (!socket_path || !*socket_path)
        socket_path = DEFAULT_SOCKET;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--socket") == 0 && i + 1 < argc) {
            socket_path = argv[++i];
        } else if (strncmp(argv[i], "--socket=", 9) == 0) {
            socket_path = argv[i] + 9;
        } else if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            usage(stdout);
            return 0;
        } else {
            usage(stderr);
            return 2;
        }
    }

    /* Keep fds 0-2 taken, so no pipe or socket of ours can land there: child_exec relies on
     * that when it dup2()s onto them. */
    for (int fd = 0; fd < 3; fd++)
        if (fcntl(fd, F_GETFD) < 0 && open("/dev/null", O_RDWR) < 0)
            return 1;

    g_agent_pid = getpid();
    g_is_init = g_agent_pid == 1;
    char cwd[2];
    g_cwd_is_root = getcwd(cwd, sizeof cwd) != NULL && strcmp(cwd, "/") == 0;
    /* A vanished client (or a command that stopped reading stdin) is an EPIPE to handle, not
     * a death. SIGPIPE is blocked rather than ignored: an ignored signal stays ignored across
     * exec, so each command would need it reset, while spawn_child resets the mask anyway. */
    sigset_t pipe_set;
    sigemptyset(&pipe_set);
    sigaddset(&pipe_set, SIGPIPE);
    signal(SIGPIPE, SIG_DFL); /* in case whoever started us ignored it */
    sigprocmask(SIG_BLOCK, &pipe_set, NULL);
    /* Non-blocking at both ends: a spare must never wait on the main process. These fds
     * come first, so that the ones each handler closes have consecutive numbers. */
    if (make_sigpipe() < 0 || pipe2(g_notify, O_CLOEXEC | O_NONBLOCK) < 0) {
        logmsg("pipe: %s", strerror(errno));
        return 1;
    }
    g_board = mmap(NULL, sizeof *g_board, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    g_shared = mmap(NULL, sizeof *g_shared, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (g_board == MAP_FAILED || g_shared == MAP_FAILED) {
        logmsg("mmap: %s", strerror(errno));
        return 1;
    }
    sigprocmask(SIG_SETMASK, NULL, &g_handler_mask); /* SIGPIPE blocked, as above */
    set_handler(SIGCHLD, on_signal);
    set_handler(SIGTERM, on_signal);
    set_handler(SIGINT, on_signal);
    set_handler(SIGUSR1, on_signal);
    set_handler(SIGUSR2, on_signal);

    int listen_fd = open_listener(socket_path);
    if (listen_fd < 0)
        return 1;
    handler_prepare();
    static const char ready[] = "hangar-agent ready\n";
    if (write_all(STDERR_FILENO, ready, sizeof ready - 1) < 0) {
        /* stderr may be gone; nothing to do about it */
    }

    int refill = 1; /* see SPARES: when to fork replacements */
    int64_t quiesce_deadline = -1; /* quiescing (see op_quiesce) until done or then */
    while (!g_got_term) {
        if (g_quiesce_req) {
            g_quiesce_req = 0;
            g_relisten_req = 0; /* one asked for before this quiesce is moot */
            listen_fd = quiesce_start(listen_fd, socket_path);
            quiesce_deadline = now_ms() + QUIESCE_MS;
        }
        if (quiesce_deadline >= 0) {
            reap_children();
            /* Every handler left is detached, save the one that asked. */
            if ((int)g_nhandlers - __atomic_load_n(&g_shared->detached, __ATOMIC_SEQ_CST) <= 1) {
                __atomic_store_n(&g_shared->quiesced, QUIESCE_DONE, __ATOMIC_SEQ_CST);
                quiesce_deadline = -1;
            } else if (now_ms() >= quiesce_deadline) {
                char open_pids[256] = "";
                size_t used = 0;
                for (size_t i = 0; i < g_nhandlers && used < sizeof open_pids - 16; i++)
                    used += (size_t)snprintf(open_pids + used, sizeof open_pids - used, " %d", (int)g_handlers[i]);
                logmsg("quiesce: connections stayed open (handlers:%s; %d detached); listening again",
                       open_pids, __atomic_load_n(&g_shared->detached, __ATOMIC_SEQ_CST));
                __atomic_store_n(&g_shared->quiesced, QUIESCE_FAILED, __ATOMIC_SEQ_CST);
                quiesce_deadline = -1;
                g_relisten_req = 1;
            }
        }
        if (g_relisten_req && quiesce_deadline < 0 && listen_fd < 0) {
            listen_fd = open_listener(socket_path);
            if (listen_fd >= 0) {
                g_relisten_req = 0;
                g_quiescing = 0;
                __atomic_store_n(&g_shared->quiesced, QUIESCE_NONE, __ATOMIC_SEQ_CST);
                refill = 1;
            }
        } else if (g_relisten_req && listen_fd >= 0) {
            g_relisten_req = 0;
        }
        int idle = listen_fd < 0 ? SPARES : idle_spares();
        if (listen_fd >= 0 && (refill || idle == 0)) {
            refill = top_up_spares(listen_fd) < 0;
            idle = idle_spares();
        }
        struct pollfd p[3] = {
            {.fd = g_sigpipe[0], .events = POLLIN},
            {.fd = g_notify[0], .events = POLLIN},
            /* Connections are the spares' business while there is one (see SPARES). */
            {.fd = idle ? -1 : listen_fd, .events = POLLIN},
        };
        /* The timeout only backs up SIGCHLD: orphans must not pile up as zombies. Short of
         * spares, it is also when to try forking them again. */
        int timeout = 1000;
        if (refill && g_spare_retry_at)
            timeout = ms_until(g_spare_retry_at, now_ms(), 1000);
        if (quiesce_deadline >= 0 || (g_relisten_req && listen_fd < 0))
            timeout = 5;
        int n = poll(p, 3, timeout);
        if (n < 0 && errno != EINTR) {
            logmsg("poll: %s", strerror(errno));
            poll(NULL, 0, 50);
        }
        /* EINTR: a handler ran and wrote to the self-pipe; take that byte now rather than in
         * another round of poll(). */
        int signalled = n < 0 || (n > 0 && p[0].revents);
        if (signalled)
            drain_fd(g_sigpipe[0]);
        if (n > 0 && p[1].revents) {
            drain_fd(g_notify[0]);
            refill = 1;
        }
        /* Children are reaped on SIGCHLD, and on the timeout should one ever go missing. */
        if (signalled || n == 0) {
            reap_children();
            refill = 1;
        }
        if (n > 0 && listen_fd >= 0 && (p[2].revents & POLLIN))
            accept_all(listen_fd);
    }
    shutdown_agent(listen_fd, socket_path);
    return 0;
}
