/* The first process of a local sandbox's namespace, which starts the prompt's commands.
 *
 * hermes-batch builds this file with the machine's C compiler the first time a
 * run needs it (see namespace_init.py) and otherwise uses unshare, setpriv and
 * a bash helper, which do the same in three programs.  It speaks the same
 * protocol as that helper (launchers.HELPER):
 *
 *   hermes-batch-namespace-... [-u] [-k CAPS] [-m MAX] CONTROL CWD SPILL
 *
 * It makes a PID and mount namespace (with -u also a user namespace mapping the
 * caller's uid and gid onto themselves, for a caller without root), forks the
 * namespace's first process and waits for it, exiting as it does; if this
 * outer process dies, the first process is killed (as unshare --kill-child).
 * The first process mounts the namespace's own /proc, lowers its privileges
 * (no new privileges; with -k, the capability bounding set and its own
 * capabilities reduced to the hexadecimal mask CAPS, which its commands then
 * keep as root and lose otherwise), says "ready" and then
 * reads requests on its input, one per line:
 *
 *   ID      run the command written in CONTROL/ID.sh in CWD, its output (and
 *           errors) to the FIFO CONTROL/ID.out, its input /dev/null, with
 *           /bin/sh -c, in a process group of its own; both files are
 *           removed once opened
 *   dID     the same in SPILL
 *   kPGID   SIGKILL the process group PGID
 *
 * and answers "p ID PGID" once a command started and "x ID STATUS" once it
 * ended (its exit status, 128 + the signal's number when a signal ended it).
 * A command that cannot start (its fork failed, or MAX commands, 4096 by
 * default, are running) gets only "x ID 126", and its FIFO says why.
 * It reaps every orphan of the namespace.  When its input ends (the runner
 * closed it or died) or on SIGTERM or SIGINT it exits, and the kernel then
 * kills everything left in the namespace.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#include <linux/capability.h>

#define MAX_COMMANDS 4096 /* commands running at once in one namespace (-m, at most this); more are refused */
#define MAX_ID 64

static const char *dirs[2]; /* CONTROL, SPILL */
static const char *cwd;
static int max_commands = MAX_COMMANDS;

struct command {
    pid_t pid;
    char id[MAX_ID + 1];
};
static struct command commands[MAX_COMMANDS];

static void fail(const char *what) {
    fprintf(stderr, "hermes-batch-namespace: %s: %s\n", what, strerror(errno));
    exit(125);
}

static void write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text)) fail(path);
    close(fd);
}

static void answer(char kind, const char *id, long value) {
    char line[MAX_ID + 48];
    int n = snprintf(line, sizeof line, "%c %s %ld\n", kind, id, value);
    while (write(STDOUT_FILENO, line, n) < 0 && errno == EINTR) {
    }
}

/* The capability bounding set, and this process's own capabilities, down to the mask `keep`. */
static void lower_capabilities(uint64_t keep) {
    for (int cap = 0; cap <= 63; cap++) {
        if (keep & (UINT64_C(1) << cap)) continue;
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 && errno != EINVAL) fail("dropping a capability");
    }
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    if (syscall(SYS_capget, &header, data) < 0) fail("reading capabilities");
    for (int i = 0; i < 2; i++) { /* what it does not have it cannot keep */
        data[i].effective = data[i].permitted &= (uint32_t)(keep >> (32 * i));
        data[i].inheritable = 0;
    }
    if (syscall(SYS_capset, &header, data) < 0) fail("lowering capabilities");
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL) fail("clearing ambient capabilities");
}

/* In the child: become the command, or exit 126 (no folder) or 127 (no shell). */
static void become(const char *dir, const char *id, const sigset_t *mask) {
    char path[PATH_MAX];
    sigprocmask(SIG_SETMASK, mask, NULL);
    setpgid(0, 0);
    int null = open("/dev/null", O_RDONLY);
    snprintf(path, sizeof path, "%s/%s.out", dir, id);
    int out = open(path, O_WRONLY | O_NOFOLLOW); /* the FIFO the runner holds open to read */
    if (null < 0 || out < 0) _exit(126);
    unlink(path); /* here, not in the runner, whose event loop it cost a tenth of a millisecond */
    dup2(null, STDIN_FILENO);
    dup2(out, STDOUT_FILENO);
    dup2(out, STDERR_FILENO);
    if (null > STDERR_FILENO) close(null);
    if (out > STDERR_FILENO) close(out);
    if (chdir(cwd) < 0) _exit(126);
    snprintf(path, sizeof path, "%s/%s.sh", dir, id);
    int script = open(path, O_RDONLY | O_NOFOLLOW);
    struct stat shown;
    if (script < 0 || fstat(script, &shown) < 0) _exit(126);
    char *text = malloc((size_t)shown.st_size + 1);
    size_t size = 0;
    ssize_t got = 1;
    while (text && size < (size_t)shown.st_size && got != 0) {
        got = read(script, text + size, (size_t)shown.st_size - size);
        if (got < 0) {
            if (errno == EINTR) continue;
            _exit(126);
        }
        size += got;
    }
    if (!text) _exit(126);
    text[size] = 0;
    close(script);
    unlink(path);
    execl("/bin/sh", "sh", "-c", text, (char *)NULL);
    fprintf(stderr, "/bin/sh: %s\n", strerror(errno));
    _exit(127);
}

/* A command that cannot start: why, through its FIFO (so the runner's read ends at once), and status 126. */
static void refuse(const char *dir, const char *id, const char *why) {
    char path[PATH_MAX], line[256];
    snprintf(path, sizeof path, "%s/%s.out", dir, id);
    int out = open(path, O_WRONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
    if (out >= 0) {
        int n = snprintf(line, sizeof line, "hermes-batch: the command could not start (%s)\n", why);
        if (write(out, line, n) < 0) {
        }
        close(out);
    }
    answer('x', id, 126);
}

static void start(const char *request, const sigset_t *mask) {
    int spilled = request[0] == 'd';
    const char *id = request + spilled;
    size_t length = strlen(id);
    if (length == 0 || length > MAX_ID || strchr(id, '/') || strchr(id, ' ')) return;
    int slot = 0;
    while (slot < max_commands && commands[slot].pid != 0) slot++;
    if (slot == max_commands) {
        refuse(dirs[spilled], id, "too many commands at once");
        return;
    }
    pid_t pid = fork();
    if (pid < 0) {
        refuse(dirs[spilled], id, strerror(errno));
        return;
    }
    if (pid == 0) become(dirs[spilled], id, mask);
    setpgid(pid, pid); /* as the child does: whichever runs first */
    commands[slot].pid = pid;
    memcpy(commands[slot].id, id, length + 1);
    answer('p', id, pid);
}

static void reap(void) {
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        for (int slot = 0; slot < max_commands; slot++) {
            if (commands[slot].pid != pid) continue;
            long code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
            answer('x', commands[slot].id, code);
            commands[slot].pid = 0;
            break;
        }
    }
}

/* The request loop; `handled` are the signals it reads (blocked), `mask` what its commands start with. */
static int serve(const sigset_t *handled, const sigset_t *mask) {
    int signals = signalfd(-1, handled, SFD_CLOEXEC | SFD_NONBLOCK);
    if (signals < 0) fail("signalfd");
    if (write(STDOUT_FILENO, "ready\n", 6) != 6) return 1;
    char buffer[4096];
    size_t used = 0;
    struct pollfd watched[2] = {{STDIN_FILENO, POLLIN, 0}, {signals, POLLIN, 0}};
    for (;;) {
        if (poll(watched, 2, -1) < 0) {
            if (errno == EINTR) continue;
            return 1;
        }
        if (watched[1].revents) {
            struct signalfd_siginfo info;
            int ended = 0;
            while (read(signals, &info, sizeof info) == sizeof info) {
                if (info.ssi_signo != SIGCHLD) ended = 1;
            }
            reap();
            if (ended) return 0;
        }
        if (watched[0].revents) {
            ssize_t got = read(STDIN_FILENO, buffer + used, sizeof buffer - 1 - used);
            if (got < 0 && errno == EINTR) continue;
            if (got <= 0) return 0; /* the runner closed our input, or died */
            used += got;
            char *line = buffer, *end;
            while ((end = memchr(line, '\n', buffer + used - line)) != NULL) {
                *end = 0;
                if (line[0] == 'k') {
                    char *rest;
                    long pgid = strtol(line + 1, &rest, 10);
                    if (*rest == 0 && pgid > 1) kill(-pgid, SIGKILL);
                } else {
                    start(line, mask);
                }
                line = end + 1;
            }
            used = buffer + used - line;
            memmove(buffer, line, used);
            if (used == sizeof buffer - 1) used = 0; /* a line longer than any request: dropped */
        }
    }
}

int main(int argc, char **argv) {
    int user = 0, lower = 0;
    uint64_t keep = 0;
    int option;
    while ((option = getopt(argc, argv, "+uk:m:")) != -1) {
        if (option == 'u') user = 1;
        else if (option == 'm') {
            max_commands = atoi(optarg);
            if (max_commands < 1 || max_commands > MAX_COMMANDS) max_commands = MAX_COMMANDS;
        }
        else if (option == 'k') {
            lower = 1;
            keep = strtoull(optarg, NULL, 16);
        } else return 125;
    }
    if (argc - optind != 3) {
        fprintf(stderr, "usage: %s [-u] [-k CAPS] [-m MAX] CONTROL CWD SPILL\n", argv[0]);
        return 125;
    }
    dirs[0] = argv[optind];
    cwd = argv[optind + 1];
    dirs[1] = argv[optind + 2];

    uid_t uid = getuid();
    gid_t gid = getgid();
    if (unshare(CLONE_NEWPID | CLONE_NEWNS | (user ? CLONE_NEWUSER : 0)) < 0) fail("unshare");
    if (user) {
        char map[64];
        write_file("/proc/self/setgroups", "deny");
        snprintf(map, sizeof map, "%u %u 1", (unsigned)uid, (unsigned)uid);
        write_file("/proc/self/uid_map", map);
        snprintf(map, sizeof map, "%u %u 1", (unsigned)gid, (unsigned)gid);
        write_file("/proc/self/gid_map", map);
    }

    sigset_t handled, mask;
    sigemptyset(&handled);
    sigaddset(&handled, SIGCHLD);
    sigaddset(&handled, SIGTERM);
    sigaddset(&handled, SIGINT);
    sigprocmask(SIG_BLOCK, &handled, &mask); /* before the fork, so no signal is missed */
    int outer_alive[2]; /* the outer process holds the write end until it ends */
    if (pipe2(outer_alive, O_CLOEXEC) < 0) fail("pipe");
    pid_t first = fork();
    if (first < 0) fail("fork");
    if (first > 0) { /* the outer process: wait for the first one and end as it ended */
        sigprocmask(SIG_SETMASK, &mask, NULL);
        close(outer_alive[0]);
        int status;
        while (waitpid(first, &status, 0) < 0) {
            if (errno != EINTR) return 125;
        }
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0) fail("prctl");
    close(outer_alive[1]);
    struct pollfd outer = {outer_alive[0], POLLIN, 0};
    if (poll(&outer, 1, 0) != 0) return 125; /* the outer process died before the death signal was set */
    close(outer_alive[0]);
    if (mount("none", "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) fail("making the mounts private");
    if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NOEXEC | MS_NODEV, NULL) < 0) fail("mounting /proc");
    if (lower) lower_capabilities(keep);
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) fail("no_new_privs");
    return serve(&handled, &mask);
}
