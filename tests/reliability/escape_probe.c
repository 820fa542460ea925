/*
 * escape_probe: what a sandboxed program can do with raw sockets and ptrace, for
 * tests/reliability/test_escape.py (busybox has neither a sniffer nor a debugger). Built static
 * on the host by the test and copied into the sandbox.
 *
 *   escape_probe sniff SECONDS MARKER
 *       opens every raw socket it can (AF_PACKET of every protocol, AF_INET raw of UDP, TCP
 *       and ICMP), reads what they receive for SECONDS, and says for each socket whether it
 *       opened and whether any packet it read held MARKER:
 *         open packet ok | open packet EPERM ...
 *         seen 0 packets 12
 *   escape_probe ptrace PID...
 *       tries PTRACE_ATTACH, then PTRACE_SEIZE, on each PID: "pid 123 attach ESRCH seize ESRCH",
 *       or "pid 123 attached CMDLINE" (and detaches) when it could.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/if_ether.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static const char *err_name(int e)
{
    switch (e) {
    case EPERM: return "EPERM";
    case EACCES: return "EACCES";
    case ESRCH: return "ESRCH";
    case EAFNOSUPPORT: return "EAFNOSUPPORT";
    case EPROTONOSUPPORT: return "EPROTONOSUPPORT";
    case EINVAL: return "EINVAL";
    case ENOSYS: return "ENOSYS";
    default: return strerror(e);
    }
}

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static int sniff(double seconds, const char *marker)
{
    struct {
        const char *name;
        int domain, type, proto;
    } kinds[] = {
        {"packet", AF_PACKET, SOCK_RAW, 0},
        {"packet-dgram", AF_PACKET, SOCK_DGRAM, 0},
        {"inet-udp", AF_INET, SOCK_RAW, IPPROTO_UDP},
        {"inet-tcp", AF_INET, SOCK_RAW, IPPROTO_TCP},
        {"inet-icmp", AF_INET, SOCK_RAW, IPPROTO_ICMP},
        {"inet6-udp", AF_INET6, SOCK_RAW, IPPROTO_UDP},
    };
    enum { N = sizeof kinds / sizeof *kinds };
    struct pollfd pfd[N];
    int n = 0;
    for (int i = 0; i < N; i++) {
        int proto = kinds[i].domain == AF_PACKET ? htons(ETH_P_ALL) : kinds[i].proto;
        int fd = socket(kinds[i].domain, kinds[i].type | SOCK_NONBLOCK | SOCK_CLOEXEC, proto);
        if (fd < 0) {
            printf("open %s %s\n", kinds[i].name, err_name(errno));
            continue;
        }
        printf("open %s ok\n", kinds[i].name);
        pfd[n++] = (struct pollfd){.fd = fd, .events = POLLIN};
    }
    fflush(stdout);
    long packets = 0, seen = 0;
    size_t mlen = strlen(marker);
    static char buf[65536];
    double end = now() + seconds;
    while (n > 0 && now() < end) {
        int left = (int)((end - now()) * 1000) + 1;
        if (poll(pfd, (nfds_t)n, left) <= 0)
            continue;
        for (int i = 0; i < n; i++) {
            if (!(pfd[i].revents & POLLIN))
                continue;
            ssize_t r;
            while ((r = recv(pfd[i].fd, buf, sizeof buf, 0)) > 0) {
                packets++;
                if (mlen && memmem(buf, (size_t)r, marker, mlen))
                    seen++;
            }
        }
    }
    printf("seen %ld packets %ld\n", seen, packets);
    return 0;
}

static void cmdline(pid_t pid, char *out, size_t len)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/cmdline", (int)pid);
    out[0] = '\0';
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    ssize_t r = read(fd, out, len - 1);
    close(fd);
    for (ssize_t i = 0; i < r; i++)
        if (out[i] == '\0' || out[i] == '\n')
            out[i] = ' ';
    out[r > 0 ? r : 0] = '\0';
}

static int trace(int argc, char **argv)
{
    for (int i = 0; i < argc; i++) {
        pid_t pid = (pid_t)atoi(argv[i]);
        char cmd[256];
        if (ptrace(PTRACE_ATTACH, pid, NULL, NULL) == 0) {
            waitpid(pid, NULL, __WALL);
            cmdline(pid, cmd, sizeof cmd);
            printf("pid %d attached %s\n", (int)pid, cmd);
            ptrace(PTRACE_DETACH, pid, NULL, NULL);
            continue;
        }
        int attach = errno;
        if (ptrace(PTRACE_SEIZE, pid, NULL, NULL) == 0) {
            cmdline(pid, cmd, sizeof cmd);
            printf("pid %d attached %s\n", (int)pid, cmd);
            ptrace(PTRACE_DETACH, pid, NULL, NULL);
            continue;
        }
        printf("pid %d attach %s seize %s\n", (int)pid, err_name(attach), err_name(errno));
    }
    return 0;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc == 4 && strcmp(argv[1], "sniff") == 0)
        return sniff(atof(argv[2]), argv[3]);
    if (argc >= 3 && strcmp(argv[1], "ptrace") == 0)
        return trace(argc - 2, argv + 2);
    fprintf(stderr, "usage: escape_probe sniff SECONDS MARKER | escape_probe ptrace PID...\n");
    return 2;
}
