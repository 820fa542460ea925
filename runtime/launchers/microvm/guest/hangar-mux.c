/*
 * hangar-mux: many byte streams over one, for a microVM's guest agent; and the VM's init.
 *
 * The guest agent (runtime/launchers/agent/hangar-agent.c) serves one request per unix-socket
 * connection. A VM reaches the host through one virtio-serial port, a single byte stream, so
 * this program carries every connection over it as a numbered stream, with flow control of
 * its own per stream (a window of WINDOW bytes, given back with CREDIT frames as the receiving
 * end writes them out), so one stalled reader never holds up another stream.
 *
 * One binary, three roles:
 *   hangar-mux host --vm PATH --listen PATH [--config FILE]
 *       on the node: connects to QEMU's end of the port (a unix socket QEMU listens on),
 *       sends the sandbox's configuration, and once the guest says its agent is up, listens on
 *       --listen: each connection accepted there is a new stream (the agent's client connects
 *       there as to gVisor's socket). Exits when QEMU closes the port.
 *   hangar-mux host --vsock CID:PORT --listen PATH [--config FILE]
 *       the same over vsock (a node with /dev/vhost-vsock): connects to the guest's vsock
 *       listener at CID:PORT, trying until the guest listens.
 *   hangar-mux guest --listen-port PATH --agent PATH
 *       the guest's end over a unix socket instead of a port: for tests on the host. Like the
 *       guest's vsock end, it takes a new host whenever the last one has gone.
 *   /init (PID 1 of the VM's initramfs)
 *       loads the virtio modules, mounts the sandbox's root (the image's read-only disk under
 *       an overlay whose upper layer is the sandbox's own disk), moves into it, takes the
 *       configuration from the host (its network included: eth0's address and route; its
 *       volumes, each a disk named by its serial, mounted at their paths),
 *       starts the agent as PID 1 of a PID namespace of its own
 *       (the sandbox sees neither this process nor the kernel's threads), and then serves the
 *       guest's end of the port.
 *
 * The link is the virtio-serial port, or (kernel argument hangar.link=vsock:PORT) a vsock
 * connection the guest accepts on PORT: a host that goes (a restore, a restarted mux) is
 * replaced by the next one to connect.
 *
 * Frames on the link: 1 byte type, 4 bytes stream id, 4 bytes length (both big-endian), payload.
 *
 * Build: gcc -static -O2 -Wall -Wextra -o hangar-mux hangar-mux.c
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <arpa/inet.h>
#include <net/if.h>
#include <net/route.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/sysmacros.h>
#include <sys/reboot.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/un.h>
#include <linux/vm_sockets.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum { F_HELLO = 1, F_CONFIG = 2, F_OPEN = 3, F_DATA = 4, F_CREDIT = 5, F_CLOSE = 6, F_RESET = 7,
       F_SHUTDOWN = 8, F_BYE = 9 };

#define HEADER 9
#define MAX_FRAME (64u << 10)
#define WINDOW (256u << 10)      /* bytes a stream may have in flight towards its reader */
#define LINK_HIGH (1u << 20)     /* stop reading streams while this much waits for the link */
#define MAX_STREAMS 4096
#define MAX_CONFIG (1u << 20)

struct buf {
    char *p;
    size_t len, cap;
};

struct stream {
    uint32_t id;
    int fd;
    struct buf out;     /* from the peer, to write to fd */
    uint32_t credit;    /* bytes we may still send the peer */
    uint32_t unacked;   /* bytes written to fd not yet given back as credit */
    int rd_eof;         /* fd said EOF (CLOSE sent) */
    int peer_eof;       /* the peer sent CLOSE */
    int wr_shut;
};

static int g_host;                 /* host role: opens streams; guest role: accepts them */
static int g_link = -1;
static int g_link_listen = -1;     /* guest: where a host connects (vsock; a unix socket in tests) */
static struct buf g_link_out, g_link_in;
static struct stream *g_streams[MAX_STREAMS];
static size_t g_nstreams;
static uint32_t g_next_id = 1;
static const char *g_agent_path;   /* guest: where the agent listens */
static int g_listen = -1;          /* host: where clients connect, once the guest is ready */
static const char *g_listen_path;
static char *g_config;             /* host: what CONFIG carries */
static size_t g_config_len;
static int g_ready;                /* host: HELLO seen; guest: HELLO sent */
static volatile sig_atomic_t g_shutdown_req; /* host: SIGUSR1 asks the guest to stop */
static int g_sigpipe[2] = {-1, -1};
static pid_t g_agent_pid;          /* init: the agent's pid */
static int g_is_init;
static char *g_volumes[32];        /* init: the volumes mounted writable, to unmount at the end */
static int g_nvolumes;
static void reconfigure(const char *cfg, size_t len);

static void logmsg(const char *fmt, ...)
{
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line - 1, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if ((size_t)n > sizeof line - 2)
        n = sizeof line - 2;
    line[n++] = '\n';
    if (write(STDERR_FILENO, "hangar-mux: ", 12) < 0 || write(STDERR_FILENO, line, (size_t)n) < 0) {
        /* nowhere to say it */
    }
}

static void die(const char *what)
{
    logmsg("%s: %s", what, strerror(errno));
    if (g_is_init) {
        sync();
        reboot(RB_POWER_OFF);
    }
    exit(1);
}

/* The end of the VM, its processes gone: its writable volumes unmounted (or, still busy, made
 * read-only), so each is clean on its disk (its journal written out) for whoever mounts it next,
 * then everything synced. */
static void volumes_down(void)
{
    for (int i = 0; i < g_nvolumes; i++)
        if (umount2(g_volumes[i], 0) < 0 && mount(NULL, g_volumes[i], NULL, MS_REMOUNT | MS_RDONLY, NULL) < 0)
            logmsg("volume at %s stays mounted: %s", g_volumes[i], strerror(errno));
    g_nvolumes = 0;
    sync();
}

static void buf_add(struct buf *b, const void *data, size_t len)
{
    if (b->len + len > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + len)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p)
            die("realloc");
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, data, len);
    b->len += len;
}

static void buf_drop(struct buf *b, size_t n)
{
    memmove(b->p, b->p + n, b->len - n);
    b->len -= n;
    if (b->len == 0 && b->cap > (1u << 20)) { /* give a burst's memory back */
        free(b->p);
        b->p = NULL;
        b->cap = 0;
    }
}

static void put32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)(v >> 24);
    p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
}

static uint32_t get32(const unsigned char *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static void send_frame(int type, uint32_t id, const void *data, uint32_t len)
{
    unsigned char h[HEADER];
    h[0] = (unsigned char)type;
    put32(h + 1, id);
    put32(h + 5, len);
    buf_add(&g_link_out, h, HEADER);
    if (len)
        buf_add(&g_link_out, data, len);
}

static void send_u32(int type, uint32_t id, uint32_t v)
{
    unsigned char p[4];
    put32(p, v);
    send_frame(type, id, p, 4);
}

static struct stream *stream_find(uint32_t id)
{
    for (size_t i = 0; i < g_nstreams; i++)
        if (g_streams[i]->id == id)
            return g_streams[i];
    return NULL;
}

static struct stream *stream_new(uint32_t id, int fd)
{
    if (g_nstreams == MAX_STREAMS)
        return NULL;
    struct stream *s = calloc(1, sizeof *s);
    if (!s)
        die("calloc");
    s->id = id;
    s->fd = fd;
    s->credit = WINDOW;
    g_streams[g_nstreams++] = s;
    return s;
}

static void stream_free(struct stream *s)
{
    for (size_t i = 0; i < g_nstreams; i++) {
        if (g_streams[i] == s) {
            g_streams[i] = g_streams[--g_nstreams];
            break;
        }
    }
    if (s->fd >= 0)
        close(s->fd);
    free(s->out.p);
    free(s);
}

/* The stream is done with, at once: the peer is told unless it told us. */
static void stream_reset(struct stream *s, int tell)
{
    if (tell)
        send_frame(F_RESET, s->id, NULL, 0);
    stream_free(s);
}

static void reset_all(void)
{
    while (g_nstreams)
        stream_free(g_streams[0]);
}

static void stream_maybe_done(struct stream *s)
{
    if (s->rd_eof && s->peer_eof && s->out.len == 0)
        stream_free(s);
}

static int set_nonblock(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

static int unix_addr(struct sockaddr_un *a, const char *path)
{
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    if (strlen(path) >= sizeof a->sun_path) {
        errno = ENAMETOOLONG;
        return -1;
    }
    strcpy(a->sun_path, path);
    return 0;
}

/* A stream socket of DOMAIN connected to A, or -1 with errno set. */
static int stream_connect(int domain, const struct sockaddr *a, socklen_t len)
{
    int fd = socket(domain, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    if (connect(fd, a, len) < 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

static int unix_connect(const char *path)
{
    struct sockaddr_un a;
    if (unix_addr(&a, path) < 0)
        return -1;
    return stream_connect(AF_UNIX, (struct sockaddr *)&a, sizeof a);
}

/* Bound under a temporary name and renamed into place once listening, as the agent does: the
 * path exists only while something accepts there ("listening" needs no round trip). */
static int unix_listen(const char *path)
{
    char tmp[sizeof ((struct sockaddr_un *)0)->sun_path];
    if (snprintf(tmp, sizeof tmp, "%s.new", path) >= (int)sizeof tmp) {
        errno = ENAMETOOLONG;
        return -1;
    }
    struct sockaddr_un a;
    if (unix_addr(&a, tmp) < 0)
        return -1;
    unlink(tmp);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return -1;
    mode_t old = umask(077);
    int rc = bind(fd, (struct sockaddr *)&a, sizeof a);
    umask(old);
    if (rc < 0 || listen(fd, 128) < 0 || rename(tmp, path) < 0) {
        int e = errno;
        close(fd);
        unlink(tmp);
        errno = e;
        return -1;
    }
    return fd;
}

/* -- frames from the link ----------------------------------------------------------------- */

static void on_data(struct stream *s, const char *p, uint32_t len)
{
    if (s->peer_eof || s->out.len + len > WINDOW) { /* past its window: the peer is broken */
        stream_reset(s, 1);
        return;
    }
    if (s->fd < 0)
        return;
    /* Written at once where the socket takes it; the rest waits for POLLOUT. */
    if (s->out.len == 0) {
        ssize_t n = write(s->fd, p, len);
        if (n < 0 && errno != EAGAIN) {
            stream_reset(s, 1);
            return;
        }
        if (n > 0) {
            p += n;
            len -= (uint32_t)n;
            s->unacked += (uint32_t)n;
        }
    }
    if (len)
        buf_add(&s->out, p, len);
}

static void guest_open(uint32_t id)
{
    if (stream_find(id)) {
        send_frame(F_RESET, id, NULL, 0);
        return;
    }
    int fd = unix_connect(g_agent_path);
    if (fd < 0 || set_nonblock(fd) < 0) {
        if (fd >= 0)
            close(fd);
        send_frame(F_RESET, id, NULL, 0);
        return;
    }
    if (!stream_new(id, fd)) {
        close(fd);
        send_frame(F_RESET, id, NULL, 0);
    }
}

static void on_frame(int type, uint32_t id, const char *p, uint32_t len)
{
    struct stream *s = id ? stream_find(id) : NULL;
    switch (type) {
    case F_HELLO:
        if (g_host && !g_ready) {
            g_listen = unix_listen(g_listen_path);
            if (g_listen < 0)
                die("listen");
            g_ready = 1;
        }
        break;
    case F_CONFIG: /* a (re)connected host: whatever streams there were are gone */
        if (!g_host) {
            reset_all();
            if (g_is_init && len) {
                char *cfg = malloc(len + 1);
                if (cfg) {
                    memcpy(cfg, p, len);
                    cfg[len] = '\0';
                    reconfigure(cfg, len);
                    free(cfg);
                }
                /* A VM restored from a checkpoint: its agent was quiesced before it was saved
                 * (it stopped listening, its detachable commands let go of their streams), and
                 * listens again now (one listening already takes no notice). */
                if (g_agent_pid > 0)
                    kill(g_agent_pid, SIGUSR2);
            }
            /* Ready again once the agent listens (a quiesced one has let go of its socket):
             * the loop says HELLO then. */
            if (g_ready && access(g_agent_path, F_OK) == 0)
                send_frame(F_HELLO, 0, NULL, 0);
            else
                g_ready = 0;
        }
        break;
    case F_OPEN:
        if (!g_host)
            guest_open(id);
        break;
    case F_DATA:
        if (s)
            on_data(s, p, len);
        break;
    case F_CREDIT:
        if (s && len == 4)
            s->credit += get32((const unsigned char *)p);
        break;
    case F_CLOSE:
        if (s) {
            s->peer_eof = 1;
            /* Nothing left to write: the half-close goes on now (the loop passes it on only
             * for a stream with events, and a reader waiting for this EOF makes none). */
            if (s->out.len == 0 && !s->wr_shut) {
                shutdown(s->fd, SHUT_WR);
                s->wr_shut = 1;
            }
            stream_maybe_done(s);
        }
        break;
    case F_RESET:
        if (s)
            stream_free(s);
        break;
    case F_SHUTDOWN:
        if (!g_host && g_is_init) {
            if (g_agent_pid > 0)
                kill(g_agent_pid, SIGTERM); /* the agent ends every process of the sandbox */
            for (int i = 0; i < 300 && g_agent_pid > 0; i++) {
                if (waitpid(g_agent_pid, NULL, WNOHANG) == g_agent_pid)
                    g_agent_pid = 0;
                else
                    usleep(10000);
            }
            volumes_down(); /* what the sandbox wrote is on its disks before QEMU goes */
            send_frame(F_BYE, 0, NULL, 0);
        } else if (!g_host) {
            send_frame(F_BYE, 0, NULL, 0);
        }
        break;
    case F_BYE:
        if (g_host)
            exit(0);
        break;
    default:
        break;
    }
}

static void link_parse(void)
{
    size_t off = 0;
    while (g_link_in.len - off >= HEADER) {
        const unsigned char *h = (const unsigned char *)g_link_in.p + off;
        uint32_t len = get32(h + 5);
        if (len > (h[0] == F_CONFIG ? MAX_CONFIG : MAX_FRAME)) {
            errno = EPROTO;
            die("frame too long on the link");
        }
        if (g_link_in.len - off < HEADER + len)
            break;
        on_frame(h[0], get32(h + 1), (const char *)h + HEADER, len);
        off += HEADER + len;
    }
    if (off)
        buf_drop(&g_link_in, off);
}

/* -- the loop -------------------------------------------------------------------------------- */

static void on_signal(int sig)
{
    int saved = errno;
    if (sig == SIGUSR1)
        g_shutdown_req = 1;
    char c = (char)sig;
    if (write(g_sigpipe[1], &c, 1) < 0) {
        /* full: a wakeup is pending anyway */
    }
    errno = saved;
}

static void reap(void)
{
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        if (g_is_init && pid == g_agent_pid) {
            /* The sandbox's agent is gone: so is the sandbox. */
            logmsg("the agent exited (status %d): powering off", status);
            volumes_down();
            reboot(RB_POWER_OFF);
        }
    }
}

static void accept_clients(void)
{
    for (;;) {
        int fd = accept4(g_listen, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0)
            return;
        uint32_t id = g_next_id++;
        if (g_next_id == 0)
            g_next_id = 1;
        if (!stream_new(id, fd)) {
            close(fd);
            continue;
        }
        send_frame(F_OPEN, id, NULL, 0);
    }
}

/* Guest: the host's connection went (a restore, a restarted mux): its streams with it, and
 * whatever was on the way. The next host to connect sends CONFIG, and HELLO answers it. */
static void link_lost(void)
{
    close(g_link);
    g_link = -1;
    reset_all();
    buf_drop(&g_link_in, g_link_in.len);
    buf_drop(&g_link_out, g_link_out.len);
}

static void link_accept(void)
{
    int fd = accept4(g_link_listen, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd >= 0)
        g_link = fd;
}

static void serve(void)
{
    static char rbuf[MAX_FRAME];
    struct pollfd *pfd = calloc(MAX_STREAMS + 3, sizeof *pfd);
    struct stream **pst = calloc(MAX_STREAMS + 3, sizeof *pst);
    if (!pfd || !pst)
        die("calloc");
    for (;;) {
        if (g_shutdown_req) {
            g_shutdown_req = 0;
            send_frame(F_SHUTDOWN, 0, NULL, 0);
        }
        size_t n = 0;
        if (g_link >= 0)
            pfd[n] = (struct pollfd){.fd = g_link, .events = POLLIN | (g_link_out.len ? POLLOUT : 0)};
        else /* no host: wait for the next one */
            pfd[n] = (struct pollfd){.fd = g_link_listen, .events = POLLIN};
        pst[n++] = NULL;
        pfd[n] = (struct pollfd){.fd = g_sigpipe[0], .events = POLLIN};
        pst[n++] = NULL;
        int room = g_link_out.len < LINK_HIGH;
        if (g_listen >= 0 && room) {
            pfd[n] = (struct pollfd){.fd = g_listen, .events = POLLIN};
            pst[n++] = NULL;
        }
        size_t first = n;
        for (size_t i = 0; i < g_nstreams; i++) {
            struct stream *s = g_streams[i];
            short ev = 0;
            if (!s->rd_eof && s->credit > 0 && room)
                ev |= POLLIN;
            if (s->out.len)
                ev |= POLLOUT;
            pfd[n] = (struct pollfd){.fd = ev ? s->fd : -1, .events = ev};
            pst[n++] = s;
        }
        int rc = poll(pfd, n, g_host || g_ready ? 1000 : 10); /* not ready: watch for the agent's socket */
        if (rc < 0) {
            if (errno == EINTR)
                continue;
            die("poll");
        }
        if (pfd[1].revents) {
            char drain[64];
            while (read(g_sigpipe[0], drain, sizeof drain) > 0) {
            }
        }
        reap();
        if (g_link < 0) {
            if (pfd[0].revents & POLLIN)
                link_accept();
        } else if (pfd[0].revents & (POLLIN | POLLHUP | POLLERR)) {
            ssize_t r = read(g_link, rbuf, sizeof rbuf);
            if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) {
                if (g_host)
                    exit(0); /* QEMU closed its end: the VM is gone */
                if (g_link_listen >= 0) {
                    link_lost();
                    continue;
                }
                /* A guest port with no host on it: wait for one to come back. */
                if (r == 0 || errno == EPIPE || errno == ECONNRESET)
                    poll(NULL, 0, 100);
                if (!g_is_init && r == 0)
                    exit(0);
            } else if (r > 0) {
                buf_add(&g_link_in, rbuf, (size_t)r);
                link_parse();
            }
        }
        if (g_link >= 0 && pfd[0].revents & POLLOUT && g_link_out.len) {
            ssize_t w = write(g_link, g_link_out.p, g_link_out.len);
            if (w > 0)
                buf_drop(&g_link_out, (size_t)w);
            else if (w < 0 && errno != EAGAIN && errno != EINTR && g_host)
                exit(0);
        }
        if (g_listen >= 0 && room && pfd[2].revents & POLLIN)
            accept_clients();
        for (size_t i = first; i < n; i++) {
            struct stream *s = pst[i];
            short re = pfd[i].revents;
            if (!re || stream_find(s->id) != s)
                continue; /* freed by a frame above */
            if (re & POLLOUT && s->out.len) {
                ssize_t w = write(s->fd, s->out.p, s->out.len);
                if (w < 0 && errno != EAGAIN) {
                    stream_reset(s, 1);
                    continue;
                }
                if (w > 0) {
                    buf_drop(&s->out, (size_t)w);
                    s->unacked += (uint32_t)w;
                }
            }
            if (re & (POLLIN | POLLHUP | POLLERR) && !s->rd_eof && s->credit > 0) {
                size_t want = s->credit < MAX_FRAME ? s->credit : MAX_FRAME;
                ssize_t r = read(s->fd, rbuf, want);
                if (r > 0) {
                    send_frame(F_DATA, s->id, rbuf, (uint32_t)r);
                    s->credit -= (uint32_t)r;
                } else if (r == 0 || (errno != EAGAIN && errno != EINTR)) {
                    if (r < 0 && s->out.len == 0 && s->peer_eof) {
                        stream_reset(s, 1);
                        continue;
                    }
                    s->rd_eof = 1;
                    send_frame(F_CLOSE, s->id, NULL, 0);
                }
            }
            if (s->peer_eof && s->out.len == 0 && !s->wr_shut) {
                shutdown(s->fd, SHUT_WR);
                s->wr_shut = 1;
            }
            stream_maybe_done(s);
        }
        /* Credit goes back once a quarter window was written out (or the buffer emptied). */
        for (size_t i = 0; i < g_nstreams; i++) {
            struct stream *s = g_streams[i];
            if (s->unacked >= WINDOW / 4 || (s->unacked && s->out.len == 0)) {
                send_u32(F_CREDIT, s->id, s->unacked);
                s->unacked = 0;
            }
        }
        /* The guest says it is ready once its agent listens. */
        if (!g_host && !g_ready && access(g_agent_path, F_OK) == 0) {
            send_frame(F_HELLO, 0, NULL, 0);
            g_ready = 1;
        }
    }
}

static void setup_signals(void)
{
    if (pipe2(g_sigpipe, O_CLOEXEC | O_NONBLOCK) < 0)
        die("pipe");
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART;
    sigaction(SIGCHLD, &sa, NULL);
    sigaction(SIGUSR1, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
}

/* -- roles ------------------------------------------------------------------------------------ */

static char *read_file_all(const char *path, size_t *len)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    struct buf b = {0};
    char chunk[4096];
    ssize_t n;
    while ((n = read(fd, chunk, sizeof chunk)) > 0 && b.len < MAX_CONFIG)
        buf_add(&b, chunk, (size_t)n);
    close(fd);
    *len = b.len;
    return b.p ? b.p : calloc(1, 1);
}

/* The guest's vsock listener at "CID:PORT", or -1 (nothing listens there yet, or no vsock). */
static int vsock_connect(const char *where)
{
    char *end;
    unsigned long cid = strtoul(where, &end, 10);
    if (*end != ':')
        return -1;
    unsigned long port = strtoul(end + 1, NULL, 10);
    struct sockaddr_vm a = {.svm_family = AF_VSOCK, .svm_cid = (unsigned)cid, .svm_port = (unsigned)port};
    return stream_connect(AF_VSOCK, (struct sockaddr *)&a, sizeof a);
}

static int host_main(const char *vm, const char *vsock, const char *listen_path, const char *config)
{
    g_host = 1;
    g_listen_path = listen_path;
    if (config) {
        g_config = read_file_all(config, &g_config_len);
        if (!g_config)
            die(config);
    }
    /* QEMU creates its socket as it starts: wait for it (a VM that never comes up is the
     * launcher's to give up on; it kills us with QEMU). */
    for (int i = 0;; i++) {
        g_link = vsock ? vsock_connect(vsock) : unix_connect(vm);
        if (g_link >= 0)
            break;
        if (i > 6000)
            die(vsock ? vsock : vm);
        usleep(10000);
    }
    set_nonblock(g_link);
    send_frame(F_CONFIG, 0, g_config, (uint32_t)g_config_len);
    serve();
    return 0;
}

static int guest_test_main(const char *listen_port, const char *agent)
{
    g_agent_path = agent;
    g_link_listen = unix_listen(listen_port);
    if (g_link_listen < 0)
        die(listen_port);
    struct pollfd p = {.fd = g_link_listen, .events = POLLIN};
    poll(&p, 1, -1);
    link_accept();
    if (g_link < 0)
        die("accept");
    serve();
    return 0;
}

/* -- init ------------------------------------------------------------------------------------- */

/* The sandbox's /dev, in the agent's mount namespace: the harmless nodes only, as gVisor's (the
 * VM's own devices, its disks, memory and consoles, stay in init's namespace), and without the
 * capabilities to make or use others (mknod, raw I/O, kernel modules). */
static void must_mount(const char *src, const char *dst, const char *type, unsigned long flags, const char *data);

static void sandbox_dev(void)
{
    static const struct {
        const char *name;
        unsigned maj, min;
    } nodes[] = {{"null", 1, 3}, {"zero", 1, 5}, {"full", 1, 7}, {"random", 1, 8}, {"urandom", 1, 9}, {"tty", 5, 0}};
    static const char *links[][2] = {{"/proc/self/fd", "/dev/fd"}, {"/proc/self/fd/0", "/dev/stdin"},
                                     {"/proc/self/fd/1", "/dev/stdout"}, {"/proc/self/fd/2", "/dev/stderr"},
                                     {"pts/ptmx", "/dev/ptmx"}};
    umount2("/dev", MNT_DETACH);
    must_mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k");
    mode_t old = umask(0);
    for (size_t i = 0; i < sizeof nodes / sizeof nodes[0]; i++) {
        char path[32];
        snprintf(path, sizeof path, "/dev/%s", nodes[i].name);
        if (mknod(path, S_IFCHR | 0666, makedev(nodes[i].maj, nodes[i].min)) < 0)
            die("mknod");
    }
    mkdir("/dev/pts", 0755);
    mkdir("/dev/shm", 01777);
    umask(old);
    must_mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620");
    must_mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777");
    for (size_t i = 0; i < sizeof links / sizeof links[0]; i++)
        if (symlink(links[i][0], links[i][1]) < 0)
            die("symlink");
    static const int drop[] = {27 /* CAP_MKNOD */, 17 /* CAP_SYS_RAWIO */, 16 /* CAP_SYS_MODULE */};
    for (size_t i = 0; i < sizeof drop / sizeof drop[0]; i++)
        if (prctl(PR_CAPBSET_DROP, drop[i], 0, 0, 0) < 0)
            die("capbset");
}

static void must_mount(const char *src, const char *dst, const char *type, unsigned long flags, const char *data)
{
    mkdir(dst, 0755);
    if (mount(src, dst, type, flags, data) < 0) {
        logmsg("mount %s on %s (%s): %s", src, dst, type, strerror(errno));
        die("mount");
    }
}

static unsigned link_vsock_port(void);

static void load_modules(void)
{
    FILE *f = fopen("/modules.list", "re");
    if (!f)
        return;
    int vsock = link_vsock_port() != 0; /* its modules only where its link is vsock */
    char name[256], path[300];
    while (fgets(name, sizeof name, f)) {
        name[strcspn(name, "\n")] = '\0';
        if (!*name || (!vsock && strstr(name, "vsock")))
            continue;
        snprintf(path, sizeof path, "/modules/%s", name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0 || (syscall(SYS_finit_module, fd, "", 0) < 0 && errno != EEXIST))
            logmsg("module %s: %s", name, strerror(errno));
        if (fd >= 0)
            close(fd);
    }
    fclose(f);
}

static int wait_path(const char *path, int ms)
{
    for (int i = 0; i < ms; i += 5) {
        if (access(path, F_OK) == 0)
            return 0;
        usleep(5000);
    }
    return -1;
}

/* The virtio disk whose serial (QEMU's serial= property) is SERIAL, as /dev/vdX in DEV, waiting
 * up to MS for it to appear: the launcher names each disk, so the order QEMU's transports
 * give them never matters. */
static int find_disk(const char *serial, char *dev, size_t len, int ms)
{
    for (int waited = 0; waited <= ms; waited += 5) {
        DIR *d = opendir("/sys/block");
        struct dirent *e;
        while (d && (e = readdir(d))) {
            if (strncmp(e->d_name, "vd", 2) != 0)
                continue;
            char path[300], got[64];
            snprintf(path, sizeof path, "/sys/block/%s/serial", e->d_name);
            FILE *f = fopen(path, "re");
            if (!f)
                continue;
            int ok = fgets(got, sizeof got, f) != NULL;
            fclose(f);
            got[strcspn(got, "\n")] = '\0';
            if (ok && strcmp(got, serial) == 0) {
                snprintf(dev, len, "/dev/%.32s", e->d_name);
                closedir(d);
                if (wait_path(dev, 2000) == 0)
                    return 0;
                return -1;
            }
        }
        if (d)
            closedir(d);
        usleep(5000);
    }
    return -1;
}

static void mkdir_p(const char *path, mode_t mode)
{
    char buf[4096];
    if (strlen(path) >= sizeof buf)
        return;
    strcpy(buf, path);
    for (char *p = buf + 1; *p; p++) {
        if (*p == '/') {
            *p = '\0';
            mkdir(buf, mode);
            *p = '/';
        }
    }
    mkdir(buf, mode);
}

/* A volume (the config's vol=SERIAL,ro|rw,PATH field): the disk named SERIAL holds an ext4
 * filesystem (a Hangar volume's image), mounted at PATH, made if missing, with the options the
 * node mounts volumes with for gVisor. A volume that cannot be mounted stops the boot, saying
 * why on the console: a sandbox never starts without a volume it asked for. */
static void mount_volume(const char *spec)
{
    const char *c1 = strchr(spec, ','), *c2 = c1 ? strchr(c1 + 1, ',') : NULL;
    char serial[32], dev[64];
    if (!c1 || !c2 || (size_t)(c1 - spec) >= sizeof serial || c2[1] != '/') {
        logmsg("volume: bad field %s", spec);
        die("volume");
    }
    memcpy(serial, spec, (size_t)(c1 - spec));
    serial[c1 - spec] = '\0';
    int ro = strncmp(c1 + 1, "ro,", 3) == 0;
    const char *path = c2 + 1;
    if (find_disk(serial, dev, sizeof dev, 5000) < 0) {
        logmsg("volume at %s: no disk %s", path, serial);
        die("volume");
    }
    mkdir_p(path, 0755);
    /* Read-only, its journal is not replayed (that would write): what was last synced. */
    if (mount(dev, path, "ext4", MS_NOSUID | MS_NODEV | (ro ? MS_RDONLY : 0), ro ? "noload" : "") < 0) {
        logmsg("volume at %s (%s): %s", path, dev, strerror(errno));
        die("volume");
    }
    if (!ro) {
        if (g_nvolumes < (int)(sizeof g_volumes / sizeof *g_volumes))
            g_volumes[g_nvolumes++] = strdup(path);
        char lf[4200];
        snprintf(lf, sizeof lf, "%s/lost+found", path);
        rmdir(lf); /* mkfs's, when empty: the user's files only, as on the host */
    }
}

/* The port QEMU names "hangar": /sys/class/virtio-ports/vportNpM/name says which it is. */
static int open_port(void)
{
    for (int tries = 0; tries < 2000; tries++) {
        DIR *d = opendir("/sys/class/virtio-ports");
        struct dirent *e;
        while (d && (e = readdir(d))) {
            if (e->d_name[0] == '.')
                continue;
            char path[300], name[64] = "";
            snprintf(path, sizeof path, "/sys/class/virtio-ports/%s/name", e->d_name);
            int fd = open(path, O_RDONLY | O_CLOEXEC);
            if (fd >= 0) {
                ssize_t n = read(fd, name, sizeof name - 1);
                close(fd);
                name[n > 0 ? n : 0] = '\0';
                name[strcspn(name, "\n")] = '\0';
            }
            if (strcmp(name, "hangar") == 0) {
                snprintf(path, sizeof path, "/dev/%s", e->d_name);
                if (wait_path(path, 2000) == 0) {
                    int port = open(path, O_RDWR | O_CLOEXEC | O_NONBLOCK);
                    closedir(d);
                    return port;
                }
            }
        }
        if (d)
            closedir(d);
        usleep(5000);
    }
    return -1;
}

static void copy_file(const char *src, const char *dst, mode_t mode)
{
    int in = open(src, O_RDONLY | O_CLOEXEC);
    int out = open(dst, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
    if (in < 0 || out < 0)
        die(src);
    char chunk[65536];
    ssize_t n;
    while ((n = read(in, chunk, sizeof chunk)) > 0)
        if (write(out, chunk, (size_t)n) != n)
            die(dst);
    close(in);
    close(out);
}

static void write_text(const char *path, const char *text)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (write(fd, text, strlen(text)) < 0)
            logmsg("%s: %s", path, strerror(errno));
        close(fd);
    }
}

/* The node's CA bundle (the config's ca= field) at /.hangar/ca-certificates.crt, read-only, as
 * gVisor mounts it: what SSL_CERT_FILE and its kind name (the launcher sets them). */
static void install_ca_bundle(const char *pem)
{
    const char *path = "/.hangar/ca-certificates.crt";
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0444);
    size_t len = strlen(pem);
    if (fd < 0 || write(fd, pem, len) != (ssize_t)len) {
        logmsg("%s: %s", path, strerror(errno));
        if (fd >= 0)
            close(fd);
        return;
    }
    close(fd);
    if (mount(path, path, NULL, MS_BIND, NULL) < 0 ||
        mount(NULL, path, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, NULL) < 0)
        logmsg("%s: read-only: %s", path, strerror(errno));
}

static void loopback_up(void)
{
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    strcpy(ifr.ifr_name, "lo");
    if (s >= 0 && ioctl(s, SIOCGIFFLAGS, &ifr) == 0) {
        ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
        ioctl(s, SIOCSIFFLAGS, &ifr);
    }
    if (s >= 0)
        close(s);
}

static int if_ioctl(int s, unsigned long req, struct ifreq *ifr, const char *what)
{
    strcpy(ifr->ifr_name, "eth0");
    if (ioctl(s, req, ifr) < 0) {
        logmsg("eth0: %s: %s", what, strerror(errno));
        return -1;
    }
    return 0;
}

/* The sandbox's network (the config's net=ADDR/PREFIX,GATEWAY field): eth0, the virtio-net
 * device on the tap the node bridged to the sandbox's veth, with the address the node leased
 * and a default route through the node's end. IPv4 only, as with gVisor (the node drops IPv6). */
static void network_up(const char *spec)
{
    char addr[32] = "", gw[32] = "";
    unsigned prefix = 32;
    if (sscanf(spec, "%31[0-9.]/%u,%31[0-9.]", addr, &prefix, gw) != 3 || prefix > 32) {
        logmsg("bad net= field: %s", spec);
        return;
    }
    if (wait_path("/sys/class/net/eth0", 5000) < 0) {
        logmsg("no eth0 (virtio_net)");
        return;
    }
    write_text("/proc/sys/net/ipv6/conf/eth0/disable_ipv6", "1");
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0)
        return;
    struct ifreq ifr;
    struct sockaddr_in *sin = (struct sockaddr_in *)&ifr.ifr_addr;
    struct in_addr want;
    inet_pton(AF_INET, addr, &want);
    /* Configured already (a restored VM, given its network again): the same address is left
     * alone; another (a new lease on the new node's network) replaces it, the interface taken
     * down first so its old routes and neighbours (the old gateway's MAC) go with it. */
    memset(&ifr, 0, sizeof ifr);
    strcpy(ifr.ifr_name, "eth0");
    if (ioctl(s, SIOCGIFADDR, &ifr) == 0) {
        if (sin->sin_addr.s_addr == want.s_addr)
            goto route;
        memset(&ifr, 0, sizeof ifr);
        if (if_ioctl(s, SIOCGIFFLAGS, &ifr, "flags") == 0) {
            ifr.ifr_flags &= ~IFF_UP;
            if_ioctl(s, SIOCSIFFLAGS, &ifr, "down");
        }
    }
    memset(&ifr, 0, sizeof ifr);
    sin->sin_family = AF_INET;
    sin->sin_addr = want;
    if (if_ioctl(s, SIOCSIFADDR, &ifr, "address") < 0)
        goto out;
    memset(&ifr, 0, sizeof ifr);
    sin->sin_family = AF_INET;
    sin->sin_addr.s_addr = htonl(prefix ? 0xffffffffu << (32 - prefix) : 0);
    if (if_ioctl(s, SIOCSIFNETMASK, &ifr, "netmask") < 0)
        goto out;
    memset(&ifr, 0, sizeof ifr);
    if (if_ioctl(s, SIOCGIFFLAGS, &ifr, "flags") < 0)
        goto out;
    ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
    if (if_ioctl(s, SIOCSIFFLAGS, &ifr, "up") < 0)
        goto out;
route:;
    struct rtentry rt;
    memset(&rt, 0, sizeof rt);
    ((struct sockaddr_in *)&rt.rt_dst)->sin_family = AF_INET;
    ((struct sockaddr_in *)&rt.rt_genmask)->sin_family = AF_INET;
    struct sockaddr_in *g = (struct sockaddr_in *)&rt.rt_gateway;
    g->sin_family = AF_INET;
    inet_pton(AF_INET, gw, &g->sin_addr);
    rt.rt_flags = RTF_UP | RTF_GATEWAY;
    rt.rt_dev = (char *)"eth0";
    if (ioctl(s, SIOCADDRT, &rt) < 0 && errno != EEXIST)
        logmsg("default route via %s: %s", gw, strerror(errno));
out:
    close(s);
}

/* The host's clock (the config's time=SECONDS.NANOSECONDS field): a VM restored from a
 * checkpoint would otherwise go on from the moment it was saved. */
static void clock_from_host(const char *spec)
{
    long long sec = 0, nsec = 0;
    if (sscanf(spec, "%lld.%lld", &sec, &nsec) < 1)
        return;
    struct timespec ts = {.tv_sec = (time_t)sec, .tv_nsec = nsec};
    if (clock_settime(CLOCK_REALTIME, &ts) < 0)
        logmsg("clock: %s", strerror(errno));
}

/* A CONFIG frame from a host that connected again (the mux restarted, or the VM restored from
 * a checkpoint on a node's network of this moment): the clock and the network follow it; the
 * rest (environment, volumes, hostname) is the running sandbox's already. */
static void reconfigure(const char *cfg, size_t len)
{
    for (size_t i = 0; i < len; i += strlen(cfg + i) + 1) {
        const char *f = cfg + i;
        if (strncmp(f, "time=", 5) == 0)
            clock_from_host(f + 5);
        else if (strncmp(f, "net=", 4) == 0)
            network_up(f + 4);
    }
}

/* Reads the host's CONFIG frame (blocking) off the port: "key=value\0" fields. */
static char *read_config(size_t *len)
{
    static char rbuf[65536];
    for (;;) {
        if (g_link_in.len >= HEADER) {
            const unsigned char *h = (const unsigned char *)g_link_in.p;
            uint32_t flen = get32(h + 5);
            if (flen > MAX_CONFIG)
                die("config too long");
            if (g_link_in.len >= HEADER + flen) {
                if (h[0] == F_CONFIG) {
                    char *cfg = malloc(flen + 1);
                    memcpy(cfg, h + HEADER, flen);
                    cfg[flen] = '\0';
                    *len = flen;
                    buf_drop(&g_link_in, HEADER + flen);
                    return cfg;
                }
                buf_drop(&g_link_in, HEADER + flen);
                continue;
            }
        }
        if (g_link < 0) { /* vsock: no host connected yet */
            struct pollfd l = {.fd = g_link_listen, .events = POLLIN};
            poll(&l, 1, 1000);
            link_accept();
            continue;
        }
        struct pollfd p = {.fd = g_link, .events = POLLIN};
        poll(&p, 1, 1000);
        ssize_t r = read(g_link, rbuf, sizeof rbuf);
        if (r > 0) {
            buf_add(&g_link_in, rbuf, (size_t)r);
        } else if (r == 0 || (errno != EAGAIN && errno != EINTR)) {
            if (g_link_listen >= 0)
                link_lost(); /* that host went before its CONFIG: the next one */
            else
                usleep(20000); /* no host on the port yet */
        }
    }
}

/* The vsock port of hangar.link=vsock:PORT on the kernel's command line, or 0 (the serial port). */
static unsigned link_vsock_port(void)
{
    char cmdline[4096] = "";
    int fd = open("/proc/cmdline", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        ssize_t n = read(fd, cmdline, sizeof cmdline - 1);
        close(fd);
        cmdline[n > 0 ? n : 0] = '\0';
    }
    const char *at = strstr(cmdline, "hangar.link=vsock:");
    return at ? (unsigned)strtoul(at + strlen("hangar.link=vsock:"), NULL, 10) : 0;
}

static int vsock_listen(unsigned port)
{
    /* The transport registers as its virtio device is probed: give it a moment. */
    for (int tries = 0; tries < 400; tries++) {
        int fd = socket(AF_VSOCK, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd >= 0) {
            struct sockaddr_vm a = {.svm_family = AF_VSOCK, .svm_cid = VMADDR_CID_ANY, .svm_port = port};
            if (bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && listen(fd, 4) == 0)
                return fd;
            close(fd);
        }
        usleep(5000);
    }
    return -1;
}

static int init_main(void)
{
    g_is_init = 1;
    must_mount("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755");
    int con = open("/dev/console", O_RDWR | O_CLOEXEC);
    if (con >= 0) {
        dup2(con, 1);
        dup2(con, 2);
    }
    logmsg("init"); /* the KVM probe (boot.py) waits for this line: the guest kernel ran /init */
    must_mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    must_mount("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    load_modules();
    char root[64], disk[64];
    if (find_disk("hangar-root", root, sizeof root, 10000) < 0)
        die("no disk hangar-root (the image's)");
    must_mount(root, "/lower", "ext4", MS_RDONLY, "noload");
    if (find_disk("hangar-disk", disk, sizeof disk, 2000) == 0) {
        must_mount(disk, "/disk", "ext4", MS_NOATIME, "noinit_itable"); /* no zeroing in the background */
    } else {
        must_mount("tmpfs", "/disk", "tmpfs", 0, "mode=0755");
    }
    mkdir("/disk/upper", 0755);
    mkdir("/disk/work", 0755);
    must_mount("overlay", "/newroot", "overlay", 0, "lowerdir=/lower,upperdir=/disk/upper,workdir=/disk/work");
    must_mount("tmpfs", "/newroot/.hangar", "tmpfs", MS_NOSUID, "mode=0755,size=64m");
    copy_file("/hangar-agent", "/newroot/.hangar/agent", 0755);
    mkdir("/newroot/.hangar/run", 0700);
    const char *moves[] = {"/dev", "/proc", "/sys"};
    for (int i = 0; i < 3; i++) {
        char dst[64];
        snprintf(dst, sizeof dst, "/newroot%s", moves[i]);
        mkdir(dst, 0755);
        if (mount(moves[i], dst, NULL, MS_MOVE, NULL) < 0)
            die("move mount");
    }
    if (chdir("/newroot") < 0 || mount(".", "/", NULL, MS_MOVE, NULL) < 0 || chroot(".") < 0 || chdir("/") < 0)
        die("switch root");
    must_mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "ptmxmode=0666,mode=0620");
    must_mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777");
    loopback_up();
    /* Out of memory, the sandbox stops (as it does in gVisor), saying so on the console. */
    write_text("/proc/sys/vm/panic_on_oom", "1");
    /* Allocations succeed and the pages count when touched, as in gVisor under its cgroup: a
     * command asking for more than the VM has meets the limit, not a refused malloc. */
    write_text("/proc/sys/vm/overcommit_memory", "1");

    unsigned vport = link_vsock_port();
    if (vport) {
        g_link_listen = vsock_listen(vport);
        if (g_link_listen < 0)
            die("cannot listen on vsock (is vmw_vsock_virtio_transport loaded?)");
    } else {
        g_link = open_port();
        if (g_link < 0)
            die("no virtio-serial port named hangar");
    }
    size_t clen = 0;
    char *cfg = read_config(&clen);
    /* The agent's environment: the config's env= fields. */
    size_t nenv = 0;
    for (size_t i = 0; i < clen; i += strlen(cfg + i) + 1)
        nenv++;
    char **envp = calloc(nenv + 3, sizeof *envp);
    size_t k = 0;
    envp[k++] = (char *)"HANGAR_AGENT_SOCKET=/.hangar/run/agent.sock";
    for (size_t i = 0; i < clen; i += strlen(cfg + i) + 1) {
        char *f = cfg + i;
        if (strncmp(f, "env=", 4) == 0)
            envp[k++] = f + 4;
        else if (strncmp(f, "hostname=", 9) == 0)
            sethostname(f + 9, strlen(f + 9));
        else if (strncmp(f, "ca=", 3) == 0)
            install_ca_bundle(f + 3);
        else if (strncmp(f, "net=", 4) == 0)
            network_up(f + 4);
        else if (strncmp(f, "vol=", 4) == 0)
            mount_volume(f + 4);
        else if (strncmp(f, "time=", 5) == 0)
            clock_from_host(f + 5);
    }
    envp[k] = NULL;
    const char *cwd = "/";
    for (size_t i = 0; i < clen; i += strlen(cfg + i) + 1)
        if (strncmp(cfg + i, "cwd=", 4) == 0)
            cwd = cfg + i + 4;
    g_agent_path = "/.hangar/run/agent.sock";
    setup_signals();

    /* The agent is PID 1 of a PID namespace of its own, with its own /proc: the sandbox sees
     * its processes only, never this one (which it could otherwise kill) or kernel threads. */
    if (unshare(CLONE_NEWPID) < 0)
        die("unshare");
    pid_t pid = fork();
    if (pid < 0)
        die("fork");
    if (pid == 0) {
        /* Its own mount namespace, for a /proc of its PID namespace: this one keeps the VM's. */
        if (unshare(CLONE_NEWNS) < 0)
            _exit(125);
        mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL);
        umount2("/proc", MNT_DETACH);
        must_mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
        sandbox_dev();
        int null = open("/dev/null", O_RDWR);
        if (null >= 0) {
            dup2(null, 0);
            dup2(null, 1);
            dup2(null, 2);
        }
        close(g_link);
        if (chdir(cwd) < 0 && chdir("/") < 0)
            _exit(126);
        char *argv[] = {(char *)"/.hangar/agent", NULL};
        execve(argv[0], argv, envp);
        _exit(127);
    }
    g_agent_pid = pid;
    serve();
    return 0;
}

int main(int argc, char **argv)
{
    if (getpid() == 1)
        return init_main();
    const char *role = argc > 1 ? argv[1] : "";
    const char *vm = NULL, *vsock = NULL, *listen_path = NULL, *config = NULL, *agent = NULL, *port = NULL;
    for (int i = 2; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--vm") == 0)
            vm = argv[i + 1];
        else if (strcmp(argv[i], "--vsock") == 0)
            vsock = argv[i + 1];
        else if (strcmp(argv[i], "--listen") == 0)
            listen_path = argv[i + 1];
        else if (strcmp(argv[i], "--config") == 0)
            config = argv[i + 1];
        else if (strcmp(argv[i], "--agent") == 0)
            agent = argv[i + 1];
        else if (strcmp(argv[i], "--listen-port") == 0)
            port = argv[i + 1];
    }
    setup_signals();
    if (strcmp(role, "host") == 0 && (vm || vsock) && listen_path)
        return host_main(vm, vsock, listen_path, config);
    if (strcmp(role, "guest") == 0 && port && agent)
        return guest_test_main(port, agent);
    fprintf(stderr, "usage: hangar-mux host (--vm PATH | --vsock CID:PORT) --listen PATH [--config FILE]\n"
                    "       hangar-mux guest --listen-port PATH --agent PATH\n");
    return 2;
}
